"""A unit's settings: one frozen object, resolved and validated once at construction.

How the unit shards is a ``Sharding`` (``sharding.py``, [Note: neutral settings]), in neither
front door's words. ``resolve_settings`` reads FSDP1's constructor options (torch's names,
types and error texts) and translates its strategy and groups into one; the FSDP1 front door
exposes the result under torch's attribute names (``sharding_strategy``, ``cpu_offload``,
``mixed_precision``, ...). FSDP2's front door builds its ``Settings`` from its own options
(``_fsdp2/shard.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .. import _switches
from .._comm.groups import effective_strategy, resolve_groups
from .._switches import Switches
from ..api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from . import init
from .sharding import Sharding, for_strategy

__all__: list[str] = []

HOMOGENEOUS_ATTR_NAMES = ["_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval"]
"""Settings every unit under one root must agree on (torch's attribute names)."""
_HOMOGENEOUS_FIELDS = dict(
    zip(HOMOGENEOUS_ATTR_NAMES, ["use_orig_params", "limit_all_gathers", "use_full_prec_in_eval"])
)


@dataclass(frozen=True)
class Settings:
    """A unit's validated configuration, resolved once from the constructor's arguments."""

    sharding: Sharding
    """Which ranks split and replicate the parameters, and when they are resharded."""
    use_orig_params: bool
    backward_prefetch: BackwardPrefetch | None
    forward_prefetch: bool
    limit_all_gathers: bool
    device_id: torch.device | None
    mixed_precision: MixedPrecision | None
    """None when no field is set: the unit computes in the parameters' own dtype."""
    offload_params: bool
    ignored_modules: tuple[nn.Module, ...]
    """As given (their subtrees are ignored too): left unmanaged, unmoved, uncast."""
    ignored_params: tuple[nn.Parameter, ...]
    param_init_fn: Callable[[nn.Module], None] | None
    sync_module_states: bool
    switches: Switches
    """The environment switches, read as the unit is built, before anything that may
    communicate (ranks that are threads of one process share the environment, and one may set
    it meanwhile)."""
    mp_policy: Any = None
    """FSDP2's ``MixedPrecisionPolicy`` as given (all-gather extensions receive it)."""

    @property
    def use_full_prec_in_eval(self) -> bool:
        """``FSDP_USE_FULL_PREC_IN_EVAL=1``."""
        return self.switches.use_full_prec_in_eval


def resolve_mixed_precision(mixed_precision: Any) -> MixedPrecision | None:
    if mixed_precision is None:
        return None
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision must be a fullshard.MixedPrecision or None, got {mixed_precision!r}"
        )
    for name in ("param_dtype", "reduce_dtype", "buffer_dtype"):
        dtype = getattr(mixed_precision, name)
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise TypeError(
                f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got {dtype!r}"
            )
    classes = mixed_precision._module_classes_to_ignore
    if not all(isinstance(cls, type) and issubclass(cls, nn.Module) for cls in classes):
        raise TypeError(
            "MixedPrecision._module_classes_to_ignore must be a sequence of nn.Module classes, "
            f"got {classes!r}"
        )
    if (
        mixed_precision.param_dtype is None
        and mixed_precision.reduce_dtype is None
        and mixed_precision.buffer_dtype is None
        and not mixed_precision.keep_low_precision_grads
    ):
        return None
    return mixed_precision


_CONSTRUCTOR_OPTIONS = frozenset(
    [
        "process_group",
        "sharding_strategy",
        "cpu_offload",
        "backward_prefetch",
        "mixed_precision",
        "ignored_modules",
        "param_init_fn",
        "device_id",
        "sync_module_states",
        "forward_prefetch",
        "limit_all_gathers",
        "use_orig_params",
        "ignored_states",
        "device_mesh",
    ]
)


def is_group_like(group: Any) -> bool:
    """A ProcessGroup, a tuple, or (as torch accepts) any object with rank() and size()."""
    if isinstance(group, (dist.ProcessGroup, tuple)):
        return True
    return callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))


def resolve_settings(kwargs: dict[str, Any], *, manual: bool = False) -> Settings:
    """Validate the FSDP1 constructor's options; ``manual``: no auto_wrap_policy built this
    unit or was given to it (torch then requires explicit hybrid groups)."""
    unknown = set(kwargs) - _CONSTRUCTOR_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown FullyShardedDataParallel options {sorted(unknown)} (from a wrap policy's "
            f"overrides?); valid options are {sorted(_CONSTRUCTOR_OPTIONS)}"
        )
    switches = _switches.reload()
    strategy = kwargs.get("sharding_strategy") or ShardingStrategy.FULL_SHARD
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a fullshard.ShardingStrategy, got {strategy!r}")
    process_group, mesh = kwargs.get("process_group"), kwargs.get("device_mesh")
    if process_group is not None and not is_group_like(process_group):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (or, for hybrid "
            f"strategies, a (shard, replicate) tuple of them) or None, got {process_group!r}"
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh or None, got {mesh!r}")
    groups = resolve_groups(strategy, process_group, mesh, manual=manual)
    sharding = for_strategy(effective_strategy(strategy, groups), groups)
    cpu_offload = kwargs.get("cpu_offload")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a fullshard.CPUOffload or None, got {cpu_offload!r}")
    prefetch = kwargs.get("backward_prefetch", BackwardPrefetch.BACKWARD_PRE)
    if prefetch is not None and not isinstance(prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {prefetch!r}")
    ignored_modules, ignored_params = init.resolve_ignored(
        kwargs.get("ignored_modules"), kwargs.get("ignored_states")
    )
    param_init_fn = kwargs.get("param_init_fn")
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}")
    return Settings(
        sharding=sharding,
        use_orig_params=bool(kwargs.get("use_orig_params", False)),
        backward_prefetch=prefetch,
        forward_prefetch=bool(kwargs.get("forward_prefetch", False)),
        limit_all_gathers=bool(kwargs.get("limit_all_gathers", True)),
        device_id=init.device_from_device_id(
            kwargs.get("device_id"), dist.get_rank() if dist.is_initialized() else 0
        ),
        mixed_precision=resolve_mixed_precision(kwargs.get("mixed_precision")),
        offload_params=bool(cpu_offload is not None and cpu_offload.offload_params),
        ignored_modules=ignored_modules,
        ignored_params=ignored_params,
        param_init_fn=param_init_fn,
        sync_module_states=bool(kwargs.get("sync_module_states", False)),
        switches=switches,
    )


def check_homogeneous(settings: list[Settings]) -> None:
    """Every unit under one root agrees on ``HOMOGENEOUS_ATTR_NAMES``."""
    for attr_name, field in _HOMOGENEOUS_FIELDS.items():
        values = {getattr(s, field) for s in settings}
        if len(values) > 1:
            raise ValueError(
                f"Expects one homogeneous value for {attr_name} but got {values}; pass the same "
                "value to every FullyShardedDataParallel constructor (and the same environment)"
            )
