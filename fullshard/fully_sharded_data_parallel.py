"""``FullyShardedDataParallel``: construction, auto-wrapping and the public methods.

The module owns construction-time decisions only (validated settings, which parameters a
unit manages, its handle); per-step state lives in the unit's ``UnitRuntime``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from . import _dcp_state_dict, _init_utils, _optim_state_dict, _state_dict
from ._comm.groups import ShardingGroups, effective_strategy, resolve_groups
from ._compile import eager, eager_frame
from ._optim_state_dict import OptimStateKeyType
from ._runtime import RootState, TrainingState, UnitRuntime, iter_tensors, map_tensors
from ._traversal import FLAT_PARAM_NAMES, FSDP_WRAPPED_MODULE, clean_fqn, flat_param_owner
from .api import (
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .flat_param import RELEASED_FROM, FlatParameter, FlatParamHandle, HandleState

_WRAPPED_BY = "_fullshard_wrapped"
"""Set on every module a FullyShardedDataParallel wraps, so it is not wrapped twice."""

__all__ = [
    "FSDP_WRAPPED_MODULE",
    "HOMOGENEOUS_ATTR_NAMES",
    "FullyShardedDataParallel",
    "OptimStateKeyType",
]

HOMOGENEOUS_ATTR_NAMES = ["_use_orig_params", "limit_all_gathers", "_use_full_prec_in_eval"]
"""Attributes every unit under one root must agree on."""

_USE_FULL_PREC_IN_EVAL = "FSDP_USE_FULL_PREC_IN_EVAL"
FORWARD_METHODS = frozenset({"generate"})
"""Methods of a wrapped module that run its forward: called on the unit, they run as its
forward (with its parameters unsharded), as FSDP2's ``register_fsdp_forward_method`` does."""


@dataclass(frozen=True)
class _Settings:
    """A unit's validated configuration, resolved once from the constructor's arguments."""

    strategy: ShardingStrategy
    groups: ShardingGroups
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
    use_full_prec_in_eval: bool
    """``FSDP_USE_FULL_PREC_IN_EVAL=1``, read before anything that may communicate (ranks
    that are threads of one process share the environment, and one may set it meanwhile)."""


def _resolve_mixed_precision(mixed_precision: Any) -> MixedPrecision | None:
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


def _is_group_like(group: Any) -> bool:
    """A ProcessGroup, a tuple, or (as torch accepts) any object with rank() and size()."""
    if isinstance(group, (dist.ProcessGroup, tuple)):
        return True
    return callable(getattr(group, "rank", None)) and callable(getattr(group, "size", None))


def _resolve_settings(kwargs: dict[str, Any]) -> _Settings:
    unknown = set(kwargs) - _CONSTRUCTOR_OPTIONS
    if unknown:
        raise TypeError(
            f"unknown FullyShardedDataParallel options {sorted(unknown)} (from a wrap policy's "
            f"overrides?); valid options are {sorted(_CONSTRUCTOR_OPTIONS)}"
        )
    use_full_prec_in_eval = os.environ.get(_USE_FULL_PREC_IN_EVAL, "") == "1"
    strategy = kwargs.get("sharding_strategy") or ShardingStrategy.FULL_SHARD
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a fullshard.ShardingStrategy, got {strategy!r}")
    process_group, mesh = kwargs.get("process_group"), kwargs.get("device_mesh")
    if process_group is not None and not _is_group_like(process_group):
        raise TypeError(
            "process_group must be a torch.distributed.ProcessGroup (or, for hybrid "
            f"strategies, a (shard, replicate) tuple of them) or None, got {process_group!r}"
        )
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"device_mesh must be a torch.distributed.DeviceMesh or None, got {mesh!r}")
    groups = resolve_groups(strategy, process_group, mesh)
    cpu_offload = kwargs.get("cpu_offload")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a fullshard.CPUOffload or None, got {cpu_offload!r}")
    prefetch = kwargs.get("backward_prefetch", BackwardPrefetch.BACKWARD_PRE)
    if prefetch is not None and not isinstance(prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a BackwardPrefetch or None, got {prefetch!r}")
    ignored_modules, ignored_params = _init_utils.resolve_ignored(
        kwargs.get("ignored_modules"), kwargs.get("ignored_states")
    )
    _init_utils.check_not_fsdp(ignored_modules, FullyShardedDataParallel)
    param_init_fn = kwargs.get("param_init_fn")
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}")
    return _Settings(
        strategy=effective_strategy(strategy, groups),
        groups=groups,
        use_orig_params=bool(kwargs.get("use_orig_params", False)),
        backward_prefetch=prefetch,
        forward_prefetch=bool(kwargs.get("forward_prefetch", False)),
        limit_all_gathers=bool(kwargs.get("limit_all_gathers", True)),
        device_id=_init_utils.device_from_device_id(
            kwargs.get("device_id"), dist.get_rank() if dist.is_initialized() else 0
        ),
        mixed_precision=_resolve_mixed_precision(kwargs.get("mixed_precision")),
        offload_params=bool(cpu_offload is not None and cpu_offload.offload_params),
        ignored_modules=ignored_modules,
        ignored_params=ignored_params,
        param_init_fn=param_init_fn,
        sync_module_states=bool(kwargs.get("sync_module_states", False)),
        use_full_prec_in_eval=use_full_prec_in_eval,
    )


class FullyShardedDataParallel(nn.Module):
    """Shards a module's parameters across ranks; the API of torch's FSDP (FSDP1).

    Wrap the model (usually with an ``auto_wrap_policy`` so each block is its own unit),
    build the optimizer over the wrapped model's parameters, and train as usual::

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    """

    def __init__(
        self,
        module: nn.Module,
        process_group: Any = None,
        sharding_strategy: ShardingStrategy | None = None,
        cpu_offload: CPUOffload | None = None,
        auto_wrap_policy: Any = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: MixedPrecision | None = None,
        ignored_modules: Iterable[nn.Module] | None = None,
        param_init_fn: Callable[[nn.Module], None] | None = None,
        device_id: int | str | torch.device | None = None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,
        ignored_states: Iterable[Any] | None = None,
        device_mesh: Any = None,
    ) -> None:
        super().__init__()
        kwargs = dict(
            process_group=process_group,
            sharding_strategy=sharding_strategy,
            cpu_offload=cpu_offload,
            backward_prefetch=backward_prefetch,
            mixed_precision=mixed_precision,
            ignored_modules=ignored_modules,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            use_orig_params=use_orig_params,
            ignored_states=ignored_states,
            device_mesh=device_mesh,
        )
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__qualname__} "
                f"({module!r:.80})"
            )
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "the module is already a FullyShardedDataParallel instance; wrap it only once"
            )
        _supersede_previous_wrapper(module)
        settings = _resolve_settings(kwargs)
        _watch_optimizers()
        _dcp_state_dict.install_when_imported()  # torch's checkpoint API sees the units
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(
                "FSDP will not all-gather parameters for containers that do not implement "
                f"forward: {type(module).__name__}. Wrap the modules it holds (or a module that "
                "calls them) instead, or pass an auto_wrap_policy that wraps them",
                stacklevel=2,
            )
        _init_utils.warn_if_root_ignored(module, settings.ignored_modules)
        if auto_wrap_policy is not None:
            ignored = _init_utils.expand_ignored(module, settings.ignored_modules)
            _auto_wrap(module, auto_wrap_policy, kwargs, settings.mixed_precision, ignored)
        self._init_unit(module, settings, excluded_params=set())

    @classmethod
    def _build_unit(
        cls, module: nn.Module, kwargs: dict[str, Any], excluded_params: set[nn.Parameter]
    ) -> FullyShardedDataParallel:
        """Construct a unit for auto-wrapping, leaving ``excluded_params`` to an ancestor."""
        unit = cls.__new__(cls)
        nn.Module.__init__(unit)
        unit._init_unit(module, _resolve_settings(kwargs), excluded_params)
        return unit

    def _init_unit(
        self, module: nn.Module, settings: _Settings, excluded_params: set[nn.Parameter]
    ) -> None:
        self._fsdp_wrapped_module = module
        # A plain attribute (no submodule, no state) that does not keep this unit alive.
        module.__dict__[_WRAPPED_BY] = weakref.ref(self)
        self._superseded = False
        """Set when the module was wrapped again (see ``_supersede_previous_wrapper``)."""
        mixed_precision = settings.mixed_precision
        self._upcasts_for_class = mixed_precision is not None and isinstance(
            module, tuple(mixed_precision._module_classes_to_ignore)
        )
        """The module's class is in ``MixedPrecision._module_classes_to_ignore``: it runs in
        full precision, with its floating-point inputs cast to float32 and outputs cast back."""
        if self._upcasts_for_class:
            mixed_precision = None
        self._mixed_precision = mixed_precision
        self.mixed_precision = mixed_precision or MixedPrecision()
        self.cpu_offload = CPUOffload(offload_params=settings.offload_params)
        self.rank = settings.groups.shard_rank
        self.world_size = settings.groups.shard_size
        self._settings = settings
        self._use_orig_params = settings.use_orig_params
        self.limit_all_gathers = settings.limit_all_gathers
        self._use_full_prec_in_eval = settings.use_full_prec_in_eval
        self.sharding_strategy = settings.strategy
        self.process_group = settings.groups.shard
        self._ignored_modules = _init_utils.expand_ignored(module, settings.ignored_modules)
        """Modules (whole subtrees) this unit leaves alone: unmanaged, unmoved, uncast."""
        ignored_params = {
            p for m in self._ignored_modules for p in m.parameters(recurse=False)
        } | set(settings.ignored_params)
        for nested in module.modules():  # what nested units ignore, their ancestors do too
            if isinstance(nested, FullyShardedDataParallel):
                ignored_params |= nested._ignored_params
        self._ignored_params: set[nn.Parameter] = ignored_params
        """Parameters this unit leaves alone (its own ignored states and nested units')."""
        managed_modules = _modules_of_unit(self)
        default_device = _init_utils.default_compute_device(settings.groups.shard)
        _init_utils.materialize(
            managed_modules,
            ignored_params,
            settings.param_init_fn,
            settings.device_id or default_device,
        )
        params, owners, fqns = _collect_unit_params(module, excluded_params | ignored_params)
        where = f"the module of type {type(module).__name__} wrapped by FSDP"
        _init_utils.check_single_device(list(zip(fqns, params)), settings.device_id, where)
        if settings.device_id is not None:
            _init_utils.move_cpu_states(managed_modules, ignored_params, settings.device_id)
        elif params and params[0].device.type == "cpu" and default_device.type != "cpu":
            _init_utils.warn_cpu_init()
        self.compute_device: torch.device = _init_utils.compute_device(
            params[0].device if params else None,
            settings.device_id,
            default_device,
            dist.get_rank() if dist.is_initialized() else 0,
        )
        """Where the unit computes (see [Note: devices] in ``_init_utils``); fixed at
        construction: moving the module later must match it."""
        buffers = [b for m in managed_modules for b in m.buffers(recurse=False)]
        if settings.sync_module_states:
            _init_utils.sync_module_states([p.detach() for p in params] + buffers, settings.groups)
        self._handle: FlatParamHandle | None = None
        if params:
            self._handle = FlatParamHandle(
                params,
                owners,
                fqns,
                settings.groups,
                settings.strategy,
                settings.use_orig_params,
                self.compute_device,
                label=type(module).__name__,
                mixed_precision=mixed_precision,
                offload_params=settings.offload_params,
            )
            if not settings.use_orig_params:
                owner = flat_param_owner(module)
                for name, flat_param in zip(FLAT_PARAM_NAMES, self._handle.flat_params):
                    owner.register_parameter(name, flat_param)
        self._runtime = UnitRuntime(self._handle, settings.strategy)
        self._state_dict_type = StateDictType.FULL_STATE_DICT
        self._state_dict_config: StateDictConfig = FullStateDictConfig()
        self._optim_state_dict_config: OptimStateDictConfig = FullOptimStateDictConfig()
        self.register_load_state_dict_pre_hook(_state_dict.load_pre_hook)
        self._managed_buffers: list[tuple[nn.Module, str, torch.dtype]] = []
        """Floating-point buffers of this unit (not of nested units) and their own dtypes;
        filled at lazy initialisation."""

    # -- module plumbing ------------------------------------------------------------------

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fsdp_wrapped_module

    def __getattr__(self, name: str) -> Any:
        """Forward missing attributes to the wrapped module; its forward methods (such as
        transformers' ``generate``, which calls the inner model's forward) run as this
        unit's forward, with its parameters unsharded (torch's FSDP1 runs them on sharded
        parameters and fails)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            attr = getattr(self._fsdp_wrapped_module, name)
            if name in FORWARD_METHODS and callable(attr):
                return functools.partial(self._call_forward_method, attr)
            return attr

    def _call_forward_method(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._runtime.training_state == TrainingState.SUMMON_FULL_PARAMS:
            return self._forward_in_summon(method, args, kwargs)
        return self._run_forward(method, args, kwargs)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (e.g. a wrapped ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside ``summon_full_params``, names without wrapper prefixes (torch's behaviour);
        where this rank sees the full parameters, those instead of the flat parameters."""
        in_summon = self._runtime.training_state == TrainingState.SUMMON_FULL_PARAMS
        exposed = self._runtime.exposes_full_params
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            if exposed and isinstance(param, FlatParameter):
                continue
            if in_summon:
                name = clean_fqn(name)
            yield name, param

    # -- forward ----------------------------------------------------------------------------

    @eager_frame
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Runs eagerly under torch.compile; the wrapped module's forward is compiled as a
        # frame of its own. See [Note: torch.compile runs the wrapper eagerly].
        if self._runtime.training_state == TrainingState.SUMMON_FULL_PARAMS:
            return self._forward_in_summon(self._fsdp_wrapped_module, args, kwargs)
        return self._run_forward(self._fsdp_wrapped_module, args, kwargs)

    @eager_frame
    def _run_forward(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Run ``fn`` (the wrapped module, or one of its forward methods such as
        ``generate``) as this unit's forward: parameters unsharded around it.

        Only ``fn`` is compiled under torch.compile: the bookkeeping before and after it is
        disabled for dynamo (see [Note: torch.compile runs the wrapper eagerly])."""
        with torch.autograd.profiler.record_function(f"fullshard::forward({self._label})"):
            args, kwargs, input_dtype = self._before_forward(args, kwargs)
            output = fn(*args, **kwargs)
            return self._after_forward(output, input_dtype, (args, kwargs))

    @eager
    def _before_forward(self, args: Any, kwargs: Any) -> tuple[Any, Any, torch.dtype | None]:
        """Lazy init, device checks, input casts and the pre-forward hook (unshard).

        Returns the inputs to run with and, for classes that upcast under mixed precision,
        the dtype to cast the output back to."""
        runtime = self._runtime
        if self._superseded:
            raise RuntimeError(
                f"this FullyShardedDataParallel wrapper of {type(self.module).__qualname__} was "
                "superseded: the module was wrapped again by another FullyShardedDataParallel "
                "instance, which now drives its nested units; use the new wrapper"
            )
        if runtime.is_root is None:
            self._lazy_init()
        full_precision = self._forces_full_precision()
        mixed_precision = self._mixed_precision
        if self._handle is not None:
            _init_utils.check_on_compute_device(
                self._handle.flat_param.device,
                self.compute_device,
                self._handle.offload_params,
                self._label,
            )
        if runtime.is_root:
            args, kwargs = self._to_compute_device(args, kwargs)
            self._cast_buffers(full_precision)
        if mixed_precision is not None and not full_precision:
            cast_inputs = (
                mixed_precision.cast_root_forward_inputs
                if runtime.is_root
                else mixed_precision.cast_forward_inputs
            )
            if cast_inputs and mixed_precision.param_dtype is not None:
                args, kwargs = _cast_floating(mixed_precision.param_dtype, (args, kwargs))
        input_dtype = None
        if self._upcasts_for_class:
            input_dtype = _first_floating_dtype((args, kwargs))
            args, kwargs = _cast_floating(torch.float32, (args, kwargs))
        runtime.pre_forward(full_precision, training=self.training)
        return args, kwargs, input_dtype

    @eager
    def _after_forward(self, output: Any, input_dtype: torch.dtype | None, inputs: Any) -> Any:
        """The post-forward hook (reshard, backward hooks on the outputs and ``inputs``)."""
        if input_dtype is not None:
            output = _cast_floating(input_dtype, output)
        return self._runtime.post_forward(output, inputs)

    def _forward_in_summon(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Inside ``summon_full_params`` (generation code runs the inner model there): the
        module already sees its full parameters, so ``fn`` (the wrapped module or one of its
        forward methods) computes with them, in their own dtype, and the unit's state is left
        to the summon. Under no_grad: gradients of the summoned parameters would be dropped
        when the summon ends, so a backward through this output raises instead."""
        if not self._runtime.exposes_full_params:
            raise RuntimeError(
                f"forward of FSDP unit '{self._label}' inside summon_full_params(rank0_only=True)"
                f" on rank {dist.get_rank()}, which does not hold the full parameters; run the "
                "forward on rank 0 only, or summon with rank0_only=False"
            )
        with torch.no_grad():
            return fn(*args, **kwargs)

    @property
    def _label(self) -> str:
        return self._handle.label if self._handle is not None else "(no params)"

    def _forces_full_precision(self) -> bool:
        """Eval in full precision despite mixed precision (FSDP_USE_FULL_PREC_IN_EVAL=1)."""
        return (
            self._mixed_precision is not None
            and self._use_full_prec_in_eval
            and not self._fsdp_wrapped_module.training
        )

    def _cast_buffers(self, full_precision: bool) -> None:
        """Root only: buffers in ``buffer_dtype`` for compute, or their own dtype in full
        precision eval. Cast only when the mode changes (the first forward included)."""
        root_state = self._runtime.root
        if root_state.buffers_full_precision == full_precision:
            return
        root_state.buffers_full_precision = full_precision
        for unit in FullyShardedDataParallel.fsdp_modules(self):
            mixed_precision = unit._mixed_precision
            buffer_dtype = mixed_precision.buffer_dtype if mixed_precision is not None else None
            for module, name, orig_dtype in unit._managed_buffers:
                buffer = module._buffers[name]
                dtype = orig_dtype if full_precision or buffer_dtype is None else buffer_dtype
                if buffer is not None and buffer.dtype != dtype:
                    buffer.data = buffer.data.to(dtype)

    def _to_compute_device(self, args: Any, kwargs: Any) -> tuple[Any, Any]:
        device = self.compute_device

        def move(tensor: torch.Tensor) -> torch.Tensor:
            return tensor if tensor.device == device else tensor.to(device)

        return map_tensors(move, args), map_tensors(move, kwargs)

    def _lazy_init(self) -> None:
        """Make this unit the root of every unit below it (at its first forward)."""
        units = [
            (clean_fqn(name), m)
            for name, m in self.named_modules()
            if isinstance(m, FullyShardedDataParallel)
        ]
        _check_homogeneous([m for _, m in units])
        for fqn, unit in units:
            if unit is not self and unit._runtime.training_state != TrainingState.IDLE:
                raise RuntimeError(f"FSDP unit '{fqn}' is in use while its root initialises")
            unit._runtime.is_root = unit is self
            if unit._handle is not None:
                unit._handle.label = fqn or "(root)"
                unit._handle.init_optimizers_in_backward()
            unit._managed_buffers = [
                (module, name, buffer.dtype)
                for module in _modules_of_unit(unit)
                for name, buffer in module._buffers.items()
                if buffer is not None and buffer.is_floating_point()
            ]
        root_state = RootState(
            [m._runtime for _, m in units],
            self._settings.backward_prefetch,
            self._settings.forward_prefetch,
        )
        for _, unit in units:
            unit._runtime.root_state = root_state

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``module.half()``, ``.to(dtype)``, ``.cuda()``...: convert, then re-point the shard.

        ``nn.Module._apply`` converts registered parameters (the flat parameter, or the
        original parameters with ``use_orig_params``); the handle then adopts the converted
        shard so the unsharded buffers, views and dtypes follow (pure fp16 after wrapping).
        """
        handle = self._handle
        if handle is not None and handle.state != HandleState.SHARDED:
            if self._runtime.training_state != TrainingState.IDLE:
                raise RuntimeError(
                    f"cannot convert FSDP unit '{handle.label}' during forward/backward or inside "
                    "summon_full_params"
                )
            handle.reshard()  # kept unsharded by a forward with no backward
        if handle is not None:
            handle.sync_orig_grads()  # before `_apply` converts the original grads apart
        result = super()._apply(fn, recurse)
        if handle is None:
            return result
        flat_params = handle.flat_params
        if self._use_orig_params:
            new_shards = [fn(flat_param._local_shard) for flat_param in flat_params]
            grad = handle.flat_param.grad
            grad = fn(grad) if grad is not None else None
        else:
            parameters = flat_param_owner(self._fsdp_wrapped_module)._parameters
            for index, (name, flat_param) in enumerate(zip(FLAT_PARAM_NAMES, flat_params)):
                registered = parameters[name]
                assert registered is not None
                if registered is not flat_param:  # overwritten: torch.__future__, or meta
                    parameters[name] = flat_param
                    handle.check_adoptable(registered.data, index)
                    flat_param.data = registered.data
                    flat_param.grad = registered.grad
            new_shards = [flat_param.data for flat_param in flat_params]
            grad = handle.flat_param.grad
        unchanged = all(
            new.data_ptr() == old._local_shard.data_ptr()
            and new.dtype == old._local_shard.dtype
            and new.device == old._local_shard.device
            for new, old in zip(new_shards, flat_params)
        )
        if not unchanged:
            handle.adopt_shards(new_shards, grad)
        return result

    def check_is_root(self) -> bool:
        """Whether this unit is the root (initialising lazily if needed)."""
        if self._runtime.is_root is None:
            self._lazy_init()
        return bool(self._runtime.is_root)

    def _unshard(self, async_op: bool = False) -> _Unshard | None:
        """torch's explicit prefetch (a private method its tests and some trainers call):
        issue this unit's all-gather now, e.g. from a parent's forward to overlap it with
        other work; the unit's own forward then finds its parameters gathered. With
        ``async_op`` returns an object whose ``wait()`` waits for the gather."""
        self._assert_state(TrainingState.IDLE)
        handle = self._handle
        if handle is not None and handle.state == HandleState.SHARDED:
            handle.unshard(self._forces_full_precision())
        work = _Unshard(handle)
        if async_op:
            return work
        work.wait()
        return None

    def _wait_unshard_streams_on_current_stream(self) -> None:
        """torch's stream synchronisation after explicit prefetches: fullshard's transports
        order their own copies, so there is nothing to wait for."""

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm of all parameters, over every rank's shards, in place.

        Call it on the root after backward (every rank must call it: it communicates). Returns
        the total norm before clipping, in the gradients' dtype (promoted across them), or a
        float32 zero with a warning on a rank with no gradients.
        """
        if not self.check_is_root():
            raise RuntimeError(
                "`clip_grad_norm_()` should only be called on the root FSDP instance"
            )
        if self._runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(
                "clip_grad_norm_() must be called after backward, outside forward/backward and "
                "summon_full_params"
            )
        from ._clip_grad import clip_grad_norm_

        return clip_grad_norm_(self, max_norm, norm_type)

    # -- state dicts ------------------------------------------------------------------------

    def state_dict(
        self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False
    ) -> Any:
        """The model's state dict in the type set by ``state_dict_type`` (FULL by default:
        the unwrapped model's keys and full tensors). Collective: call it on every rank."""
        if args:
            raise TypeError(
                "FullyShardedDataParallel.state_dict() takes destination, prefix and keep_vars "
                "as keyword arguments only"
            )
        return _state_dict.unit_state_dict(self, destination, prefix, keep_vars)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict of the type set by ``state_dict_type`` (collective). Missing and
        unexpected keys are reported with the unwrapped model's names."""
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [clean_fqn(k) for k in result.missing_keys]
        unexpected = [clean_fqn(k) for k in result.unexpected_keys]
        if strict and (missing or unexpected):
            parts = []
            if unexpected:
                parts.append(
                    f"Unexpected key(s) in state_dict: {', '.join(map(repr, unexpected))}."
                )
            if missing:
                parts.append(f"Missing key(s) in state_dict: {', '.join(map(repr, missing))}.")
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__} "
                f"({self._state_dict_type.name}):\n\t" + "\n\t".join(parts)
            )
        return type(result)(missing, unexpected)

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state dict type of every FSDP unit in ``module``; returns the previous
        settings (those of the first unit)."""
        defaults: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
            StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
            StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
            StateDictType.SHARDED_STATE_DICT: (
                ShardedStateDictConfig,
                ShardedOptimStateDictConfig,
            ),
        }
        if not isinstance(state_dict_type, StateDictType):
            raise TypeError(f"state_dict_type must be a StateDictType, got {state_dict_type!r}")
        config_cls, optim_config_cls = defaults[state_dict_type]
        config = state_dict_config if state_dict_config is not None else config_cls()
        optim_config = (
            optim_state_dict_config if optim_state_dict_config is not None else optim_config_cls()
        )
        if type(config) is not config_cls:
            raise StateDictConfigError(
                f"Expected state_dict_config of type {config_cls} but got {type(config)} for "
                f"{state_dict_type}"
            )
        if type(optim_config) is not optim_config_cls:
            raise StateDictConfigError(
                f"Expected optim_state_dict_config of type {optim_config_cls} but got "
                f"{type(optim_config)} for {state_dict_type}"
            )
        units = FullyShardedDataParallel.fsdp_modules(module)
        if not units:
            raise ValueError(
                f"set_state_dict_type: {type(module).__name__} contains no FSDP unit; pass the "
                "wrapped model"
            )
        previous = FullyShardedDataParallel.get_state_dict_type(module)
        for unit in units:
            unit._state_dict_type = state_dict_type
            unit._state_dict_config = config
            unit._optim_state_dict_config = optim_config
        return previous

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state dict settings shared by every FSDP unit in ``module``."""
        settings: StateDictSettings | None = None
        for unit in FullyShardedDataParallel.fsdp_modules(module):
            current = StateDictSettings(
                unit._state_dict_type, unit._state_dict_config, unit._optim_state_dict_config
            )
            if settings is None:
                settings = current
            elif settings != current:
                raise AssertionError(
                    "All FSDP modules must have the same state_dict settings. Got "
                    f"{settings} and {current}; set them with "
                    "FullyShardedDataParallel.set_state_dict_type(model, ...)"
                )
        if settings is None:
            raise ValueError(f"{type(module).__name__} contains no FSDP unit")
        return settings

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """Within the block, ``state_dict()`` / ``load_state_dict()`` (and the optimizer state
        dict functions) of every unit in ``module`` use ``state_dict_type``."""
        previous = FullyShardedDataParallel.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )
        try:
            yield
        finally:
            FullyShardedDataParallel.set_state_dict_type(
                module,
                previous.state_dict_type,
                previous.state_dict_config,
                previous.optim_state_dict_config,
            )

    # -- optimizer state dicts (see [Note: optimizer state keys]) --------------------------------

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim``'s state in ``model``'s state dict type: FULL (per original parameter,
        keyed by FQN, full tensors; ``rank0_only`` and ``offload_to_cpu`` from the optimizer
        config), SHARDED (the same keys, parameter-shaped states as dim-0 DTensors, for DCP)
        or LOCAL (``optim.state_dict()`` as is). ``optim_state_dict`` stands in for
        ``optim.state_dict()`` when given. Collective: call it on every rank."""
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            return optim_state_dict if optim_state_dict is not None else optim.state_dict()
        config = settings.optim_state_dict_config
        return _optim_state_dict.produce(
            model,
            optim,
            optim_state_dict,
            full=settings.state_dict_type == StateDictType.FULL_STATE_DICT,
            rank0_only=getattr(config, "rank0_only", False),
            offload_to_cpu=config.offload_to_cpu,
            group=group,
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from a dict ``optim_state_dict`` gave (in
        ``model``'s state dict type; with FULL ``rank0_only`` only rank 0 needs to pass it).
        ``load_directly`` also loads it. Collective: call it on every rank."""
        if is_named_optimizer:
            raise NotImplementedError(
                "optim_state_dict_to_load(is_named_optimizer=True): fullshard supports "
                "torch.optim optimizers only"
            )
        settings = FullyShardedDataParallel.get_state_dict_type(model)
        if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
            result = optim_state_dict
        else:
            result = _optim_state_dict.load(
                model,
                [list(g["params"]) for g in optim.param_groups],
                optim_state_dict,
                rank0_only=getattr(settings.optim_state_dict_config, "rank0_only", False)
                and settings.state_dict_type == StateDictType.FULL_STATE_DICT,
                group=group,
            )
        if load_directly:
            optim.load_state_dict(result)
        return result

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The full optimizer state dict (FQN-keyed, on the CPU), on rank 0 only unless
        ``rank0_only=False`` (the other ranks get ``{}``). Collective."""
        del optim_input  # the optimizer's own param groups say which parameter is which
        return _optim_state_dict.produce(
            model, optim, None, full=True, rank0_only=rank0_only, offload_to_cpu=True, group=group
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """The FQN-keyed optimizer state dict with parameter-shaped states as dim-0 DTensors
        (for DCP; load with ``flatten_sharded_optim_state_dict``). Collective."""
        return _optim_state_dict.produce(
            model, optim, None, full=False, rank0_only=False, offload_to_cpu=True, group=group
        )

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's loadable part of a full optimizer state dict every rank holds. The
        optimizer's parameters come from ``optim``, else ``optim_input``, else
        ``model.parameters()``."""
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_state_dict.load(model, groups, full_optim_state_dict, rank0_only=False)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """This rank's loadable part of a ``sharded_optim_state_dict`` (collective)."""
        groups = _optim_state_dict._param_groups(model, optim, None)
        return _optim_state_dict.load(model, groups, sharded_optim_state_dict, rank0_only=False)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any | None = None,
    ) -> dict[str, Any]:
        """Like ``shard_full_optim_state_dict``, with the full dict on rank 0 only (the others
        pass None): rank 0 broadcasts it one tensor at a time. Collective."""
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_state_dict.load(
            model, groups, full_optim_state_dict, rank0_only=True, group=group
        )

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter name (what FSDP's full dicts use) or by id
        (what an optimizer over an unwrapped model loads). Ids follow ``optim``'s param
        groups, else ``optim_input``, else ``model.parameters()``."""
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_state_dict.rekey(optim_state_dict, optim_state_key_type, model, groups)

    # -- public static methods ----------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP unit in ``module`` (itself included), or only the top-level ones."""
        units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if not root_only:
            return units
        nested = {id(m) for unit in units for m in unit.module.modules() if m is not unit}
        return [unit for unit in units if id(unit) not in nested]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with full parameters visible (edits are written back).

        Each unit exposes only its own parameters while ``fn`` runs over its modules; nested
        units do the same in their own ``apply``, which ``nn.Module.apply`` reaches as it
        recurses (as in torch)."""
        self._assert_state(TrainingState.IDLE)
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    # -- torch's read-only attributes ------------------------------------------------------
    # What torch's test harness (common_fsdp) and users' code read from a wrapper.

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._settings.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._settings.forward_prefetch

    @property
    def params(self) -> list[FlatParameter]:
        """torch's list of this unit's flat parameters (empty for a unit with none)."""
        return self._handle.flat_params if self._handle is not None else []

    @property
    def _inter_node_pg(self) -> Any:
        """Hybrid strategies: the group the sharded gradient is all-reduced over (torch's
        name); None otherwise."""
        return self._settings.groups.replicate

    @property
    def training_state(self) -> TrainingState:
        return self._runtime.training_state

    def _assert_state(self, state: Any) -> None:
        """Raise ``ValueError`` unless the unit is in ``state`` (one or a list; fullshard's or
        torch's ``TrainingState``, compared by name), as torch's ``_assert_state``."""
        states = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state.name not in {s.name for s in states}:
            raise ValueError(
                f"expected to be in states {list(states)} but current state is "
                f"{self.training_state} (FSDP unit '{self._label}')"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate unsharded gradients locally, with no communication, inside the block."""
        if not self.check_is_root():
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        units = FullyShardedDataParallel.fsdp_modules(self)
        previous = [unit._runtime.sync_gradients for unit in units]
        for unit in units:
            unit._runtime.sync_gradients = False
        try:
            yield
        finally:
            for unit, value in zip(units, previous):
                unit._runtime.sync_gradients = value

    @staticmethod
    @contextlib.contextmanager
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ) -> Generator[None, None, None]:
        """Expose every unit's full parameters inside the block (see ``_summon``)."""
        from ._summon import summon

        with summon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield


class StateDictConfigError(ValueError, RuntimeError):
    """A state-dict config of the wrong type for the state-dict type. torch raises
    RuntimeError; fullshard raised ValueError before, so it is both."""


class _Unshard:
    """What ``_unshard(async_op=True)`` returns: ``wait()`` waits for the all-gather."""

    def __init__(self, handle: FlatParamHandle | None) -> None:
        self._handle = handle

    def wait(self) -> None:
        if self._handle is not None and self._handle.state == HandleState.UNSHARDING:
            self._handle.wait_unshard()
        self._handle = None


def _supersede_previous_wrapper(module: nn.Module) -> None:
    """Wrapping a module again (e.g. a trained model for inference, with its nested units)
    is allowed, as in torch, when its previous wrapper manages no parameters of its own: the
    nested units keep theirs and follow the new root. The previous wrapper then refuses to
    run. A previous wrapper holding parameters cannot be replaced (they live in its flat
    parameter), so that is an error; so is a previous wrapper that no longer exists, since
    what it held cannot be told any more (its flat parameter may still be registered)."""
    previous_ref = module.__dict__.get(_WRAPPED_BY)
    if previous_ref is None:
        return
    previous = previous_ref()
    if previous is None or previous._handle is not None:
        raise ValueError(
            f"this {type(module).__qualname__} is already wrapped by another "
            "FullyShardedDataParallel instance, which owns its parameters now; wrap each "
            "module once and use that wrapper"
        )
    previous._superseded = True


def _cast_floating(dtype: torch.dtype, obj: Any) -> Any:
    """Cast every floating-point tensor inside ``obj`` (nested containers) to ``dtype``."""

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype == dtype:
            return tensor
        return tensor.to(dtype)

    return map_tensors(cast, obj)


def _first_floating_dtype(obj: Any) -> torch.dtype | None:
    for tensor in iter_tensors(obj):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def _modules_of_unit(unit: FullyShardedDataParallel) -> list[nn.Module]:
    """The modules a unit manages: its wrapped module's subtree minus nested units' subtrees."""
    result: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        result.append(module)
        for child in module.children():
            if not isinstance(child, FullyShardedDataParallel) and (
                child not in unit._ignored_modules
            ):
                visit(child)

    visit(unit.module)
    return result


def _check_homogeneous(units: list[FullyShardedDataParallel]) -> None:
    for attr_name in HOMOGENEOUS_ATTR_NAMES:
        values = {getattr(unit, attr_name) for unit in units}
        if len(values) > 1:
            raise ValueError(
                f"Expects one homogeneous value for {attr_name} but got {values}; pass the same "
                "value to every FullyShardedDataParallel constructor (and the same environment)"
            )


def _collect_unit_params(
    module: nn.Module, excluded: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]], list[str]]:
    """The parameters this unit manages, every (module, attr) that refers to each, and names.

    A parameter belongs to the unit unless a nested unit manages it or an auto-wrapping
    ancestor keeps it (``excluded``: shared with modules outside this subtree). Parameters
    shared inside the subtree are managed once, with one owner per referring module.
    """
    nested_owners = _nested_unit_owners(module)
    params: list[nn.Parameter] = []
    owners: list[list[tuple[nn.Module, str]]] = []
    fqns: list[str] = []
    index_of: dict[int, int] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for name, param in list(submodule._parameters.items()):
            if param is None or isinstance(param, FlatParameter) or param in excluded:
                continue
            fqn = clean_fqn(f"{prefix}.{name}" if prefix else name)
            if id(param) in nested_owners:
                if (id(submodule), name) not in nested_owners[id(param)]:
                    raise ValueError(
                        f"parameter '{fqn}' is shared with a nested FSDP unit that already "
                        "manages it, so the two would diverge. Wrap the common ancestor of the "
                        "modules sharing it instead of one of them, or pass an auto_wrap_policy "
                        "to the outer unit: auto-wrapping keeps shared parameters in the ancestor"
                    )
                continue
            if id(param) in index_of:
                slot_owners = owners[index_of[id(param)]]
                if (submodule, name) not in slot_owners:
                    slot_owners.append((submodule, name))
                continue
            index_of[id(param)] = len(params)
            params.append(param)
            owners.append([(submodule, name)])
            fqns.append(fqn)
    return params, owners, fqns


def _nested_unit_owners(module: nn.Module) -> dict[int, set[tuple[int, str]]]:
    """For each parameter a nested unit manages, the (module id, attr) pairs it maintains."""
    result: dict[int, set[tuple[int, str]]] = {}
    for submodule in module.modules():
        if not isinstance(submodule, FullyShardedDataParallel) or submodule._handle is None:
            continue
        handle = submodule._handle
        for param, slot_owners in zip(handle.orig_params, handle.owners):
            result[id(param)] = {(id(m), name) for m, name in slot_owners}
    return result


def _post_order(root: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(root)
    return order


# Modules that read their children's parameters without calling the children's forward
# (nn.MultiheadAttention uses `self.out_proj.weight` directly). A unit made of such a child
# would never be unsharded, so auto-wrapping leaves these children to the enclosing unit.
_READS_CHILD_PARAMS_DIRECTLY: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
    weakref.WeakKeyDictionary()
)
"""Optimizer -> how many parameters it held when last checked (checked again if that changes)."""
_OPTIMIZER_HOOK: list[Any] = []


def _watch_optimizers() -> None:
    """Once per process: check every optimizer's parameters before its first step."""
    if not _OPTIMIZER_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer_params))


def _check_optimizer_params(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    """An optimizer built before wrapping (use_orig_params=False) holds the original
    parameters, which FSDP emptied: its steps would silently do nothing."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = getattr(param, RELEASED_FROM, None)
            if name is not None:
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameters that FullyShardedDataParallel "
                    f"took over when it wrapped the model (e.g. {name}): they are empty "
                    "now and never get gradients, so this step would change nothing. Build the "
                    "optimizer after wrapping, over the wrapped model's parameters() (or wrap "
                    "with use_orig_params=True, which keeps the original parameters)"
                )
    _CHECKED_OPTIMIZERS[optimizer] = count


def _auto_wrap(
    root: nn.Module,
    policy: Any,
    kwargs: dict[str, Any],
    mixed_precision: MixedPrecision | None,
    ignored: set[nn.Module],
) -> None:
    """Wrap the policy's target submodules of ``root`` bottom-up, in place.

    With mixed precision, every module of a class in ``_module_classes_to_ignore`` becomes a
    unit of its own too, so that it can run in full precision (as torch's FSDP does).
    """
    from .wrap import resolve_policy

    resolved = resolve_policy(policy)
    if resolved is None:
        return
    for name, submodule in root.named_modules():
        if isinstance(submodule, FullyShardedDataParallel):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{clean_fqn(name)} in the {type(root).__qualname__} being wrapped. Wrap by hand "
                "or with the policy, not both: drop the inner FullyShardedDataParallel, or the "
                "auto_wrap_policy"
            )
    targets = resolved._run_policy(root, ignored, dict(kwargs))
    if mixed_precision is not None and mixed_precision._module_classes_to_ignore:
        ignored_classes = tuple(mixed_precision._module_classes_to_ignore)
        overridden = [
            m
            for m in root.modules()
            if m is not root and m not in ignored and isinstance(m, ignored_classes)
        ]
        if overridden:
            warnings.warn(
                "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the "
                f"wrapped module has submodules of type:\n{ {type(m) for m in overridden} }\n"
                "These modules will be wrapped as separate FSDP instances with mixed precision "
                "disabled.",
                stacklevel=3,
            )
            extra = {id(m) for m in overridden}
            targets = {
                m: targets.get(m, dict(kwargs))
                for m in _post_order(root)
                if m in targets or id(m) in extra
            }
    param_owners: dict[int, list[nn.Module]] = {}
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for submodule in root.modules():
        for param in submodule._parameters.values():
            if param is not None:
                param_owners.setdefault(id(param), []).append(submodule)
        for name, child in submodule._modules.items():
            if child is not None:
                parents.setdefault(id(child), []).append((submodule, name))
    leaf_only = {
        id(m)
        for container in root.modules()
        if isinstance(container, _READS_CHILD_PARAMS_DIRECTLY)
        for m in container.modules()
        if m is not container
    }
    for target, target_kwargs in targets.items():
        if (
            target is root
            or isinstance(target, FullyShardedDataParallel)
            or id(target) in leaf_only
        ):
            continue
        subtree = {id(m) for m in target.modules()}
        excluded = {
            param
            for m in target.modules()
            for param in m._parameters.values()
            if param is not None
            and any(id(owner) not in subtree for owner in param_owners.get(id(param), []))
        }
        unit = FullyShardedDataParallel._build_unit(target, {**kwargs, **target_kwargs}, excluded)
        for parent, name in parents.get(id(target), []):
            parent._modules[name] = unit
