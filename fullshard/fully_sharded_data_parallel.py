"""``FullyShardedDataParallel``: the FSDP1 front door, a wrapper module over one engine unit.

The wrapper resolves its settings (``_engine.settings``), builds its unit bottom-up
(``_engine.build``, with ``_auto_wrap`` for a policy's targets) and delegates: the forward
path to ``_engine.forward``, state dicts, summon and clipping to ``_features``. What torch's
FSDP1 exposes on a wrapper (``sharding_strategy``, ``cpu_offload``, ``_handle``, ...) are
read-only views of the unit's state.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ._auto_wrap import auto_wrap
from ._engine import forward as _forward
from ._engine import init as _init
from ._engine.build import build_unit
from ._engine.compile import eager_frame
from ._engine.convert import after_apply, before_apply
from ._engine.flat_param import FlatParameter
from ._engine.names import FSDP_PREFIX, FSDP_WRAPPED_MODULE, clean_fqn
from ._engine.optimizer_check import watch_optimizers
from ._engine.runtime import TrainingState
from ._engine.settings import HOMOGENEOUS_ATTR_NAMES, Settings, resolve_settings
from ._engine.unit import Unit, units_in
from ._features import dcp_state_dict as _dcp_state_dict
from ._features import state_dict as _state_dict
from ._features.clip_grad import clip_grad_norm_
from ._features.optim_state_dict import OptimStateKeyType
from ._features.state_dict_type import StateDictConfigError
from ._features.summon import summon
from ._fsdp1_attributes import TorchAttributes
from ._fsdp1_state_dicts import StateDictMethods
from .api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    from_torch,
)

__all__ = [
    "FSDP_WRAPPED_MODULE",
    "HOMOGENEOUS_ATTR_NAMES",
    "FullyShardedDataParallel",
    "OptimStateKeyType",
    "StateDictConfigError",
]

FORWARD_METHODS = frozenset({"generate"})
"""Methods of a wrapped module that run its forward: called on the unit, they run as its
forward (with its parameters unsharded), as FSDP2's ``register_fsdp_forward_method`` does."""

_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[FullyShardedDataParallel]]
_WRAPPERS = weakref.WeakKeyDictionary()
"""Wrapped module -> the wrapper that wraps it (both weakly), so it is not wrapped twice."""


class FullyShardedDataParallel(TorchAttributes, StateDictMethods, nn.Module):
    """Shards a module's parameters across ranks; the API of torch's FSDP (FSDP1).

    Wrap the model (usually with an ``auto_wrap_policy`` so each block is its own unit),
    build the optimizer over the wrapped model's parameters, and train as usual::

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    """

    _unit: Unit
    """The engine's unit this wrapper is the front door of (the only state it holds)."""

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
        # torch's own config objects, field for field ([Note: torch's configuration objects])
        kwargs = {name: from_torch(value) for name, value in kwargs.items()}
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__qualname__} "
                f"({module!r:.80})"
            )
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError(
                "the module is already a FullyShardedDataParallel instance; wrap it only once"
            )
        settings = resolve_settings(kwargs, manual=auto_wrap_policy is None)
        _supersede_previous_wrapper(module)
        watch_optimizers()
        _dcp_state_dict.install_when_imported()  # torch's checkpoint API sees the units
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            warnings.warn(
                "FSDP will not all-gather parameters for containers that do not implement "
                f"forward: {type(module).__name__}. Wrap the modules it holds (or a module that "
                "calls them) instead, or pass an auto_wrap_policy that wraps them",
                stacklevel=2,
            )
        _init.warn_if_root_ignored(module, settings.ignored_modules)
        if auto_wrap_policy is not None:
            ignored = _init.expand_ignored(module, settings.ignored_modules)
            auto_wrap(
                module,
                auto_wrap_policy,
                kwargs,
                settings.mixed_precision,
                ignored,
                FullyShardedDataParallel._build_unit,
            )
        self._init_unit(module, settings, excluded_params=set())

    @classmethod
    def _build_unit(
        cls, module: nn.Module, kwargs: dict[str, Any], excluded_params: set[nn.Parameter]
    ) -> FullyShardedDataParallel:
        """Construct a unit for auto-wrapping, leaving ``excluded_params`` to an ancestor."""
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._init_unit(module, resolve_settings(kwargs), excluded_params)
        return wrapper

    def _init_unit(
        self, module: nn.Module, settings: Settings, excluded_params: set[nn.Parameter]
    ) -> None:
        self._fsdp_wrapped_module = module
        _WRAPPERS[module] = weakref.ref(self)
        self._unit = build_unit(self, module, settings, excluded_params)
        self.register_load_state_dict_pre_hook(_state_dict.load_pre_hook)

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
        """Run ``method`` as this unit's forward (inside ``summon_full_params``, on the
        parameters it exposes)."""
        if self._unit.runtime.training_state == TrainingState.SUMMON_FULL_PARAMS:
            return _forward.forward_in_summon(self._unit, method, args, kwargs)
        return self._run_forward(method, args, kwargs)

    def __getitem__(self, key: int) -> Any:
        """Forward indexing to the wrapped module (e.g. a wrapped ``nn.Sequential``)."""
        return self._fsdp_wrapped_module.__getitem__(key)  # type: ignore[operator]

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Inside ``summon_full_params``, names without FSDP's prefix (torch's behaviour: an
        activation-checkpointing wrapper's stays); where this rank sees the full parameters,
        those instead of the flat parameters."""
        runtime = self._unit.runtime
        in_summon = runtime.training_state == TrainingState.SUMMON_FULL_PARAMS
        exposed = runtime.exposes_full_params
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            if exposed and isinstance(param, FlatParameter):
                continue
            yield name.replace(FSDP_PREFIX, "") if in_summon else name, param

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Inside ``summon_full_params``, names without FSDP's prefix, as torch's."""
        in_summon = self._unit.runtime.training_state == TrainingState.SUMMON_FULL_PARAMS
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield name.replace(FSDP_PREFIX, "") if in_summon else name, buffer

    # -- forward ----------------------------------------------------------------------------

    @eager_frame
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # Runs eagerly under torch.compile; the wrapped module's forward is compiled as a
        # frame of its own. See [Note: torch.compile runs the wrapper eagerly].
        return self._call_forward_method(self._fsdp_wrapped_module, *args, **kwargs)

    @eager_frame
    def _run_forward(self, fn: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        """Run ``fn`` (the wrapped module, or one of its forward methods such as
        ``generate``) as this unit's forward: parameters unsharded around it.

        Only ``fn`` is compiled under torch.compile: the bookkeeping before and after it is
        disabled for dynamo (see [Note: torch.compile runs the wrapper eagerly])."""
        unit = self._unit
        if unit.superseded:
            raise RuntimeError(
                f"this FullyShardedDataParallel wrapper of {type(self.module).__qualname__} was "
                "superseded: the module was wrapped again by another FullyShardedDataParallel "
                "instance, which now drives its nested units; use the new wrapper"
            )
        with torch.autograd.profiler.record_function(f"fullshard::forward({unit.label})"):
            args, kwargs, input_dtype = _forward.before_forward(unit, args, kwargs, self.training)
            output = fn(*args, **kwargs)
            return _forward.after_forward(unit, output, input_dtype, (args, kwargs))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``module.half()``, ``.to(dtype)``, ``.cuda()``...: convert, then re-point the shard
        (see ``_engine.convert``)."""
        before_apply(self._unit)
        result = super()._apply(fn, recurse)
        after_apply(self._unit, fn)
        return result

    def check_is_root(self) -> bool:
        """Whether this unit is the root (initialising lazily if needed)."""
        return _forward.is_root(self._unit)

    def _unshard(self, async_op: bool = False) -> _forward.UnshardWork | None:
        """torch's explicit prefetch (a private method its tests and some trainers call):
        issue this unit's all-gather now, e.g. from a parent's forward to overlap it with
        other work; the unit's own forward then finds its parameters gathered. With
        ``async_op`` returns an object whose ``wait()`` waits for the gather."""
        self._assert_state(TrainingState.IDLE)
        work = _forward.unshard(self._unit)
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
        if self._unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(
                "clip_grad_norm_() must be called after backward, outside forward/backward and "
                "summon_full_params"
            )
        return clip_grad_norm_(self._unit, max_norm, norm_type)

    def register_comm_hook(self, state: object, hook: Callable[..., None]) -> None:
        """Reduce every unit's gradients with ``hook`` instead of fullshard's collectives:
        ``hook(state, grad)`` in place under NO_SHARD, ``hook(state, padded_grad, output)``
        into this rank's shard otherwise (torch's ``default_hooks`` have both forms; see
        [Note: communication hooks] in ``_engine/grads.py``). Register it on the root, once,
        before the first forward; not with hybrid strategies."""
        if not self.check_is_root():
            raise AssertionError("register_comm_hook can only be called on a root instance.")
        for unit in units_in(self):
            strategy = unit.settings.sharding.strategy
            if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
                raise AssertionError(
                    f"Communication hook is not supported for hybrid strategies: {strategy}"
                )
            handle = unit.handle
            if handle is not None and handle.comm_hook is not None:
                raise AssertionError("A communication hook is already registered")
            if not callable(hook):
                raise ValueError(f"The communication hook must be callable but got {hook}")
            if handle is not None:
                handle.comm_hook = (state, hook)

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
        return _state_dict.unit_state_dict(self._unit, destination, prefix, keep_vars)

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
                f"({self._unit.state_dict_type.name}):\n\t" + "\n\t".join(parts)
            )
        return type(result)(missing, unexpected)

    # -- public static methods ----------------------------------------------------------------

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        """Every FSDP unit in ``module`` (itself included), or only the top-level ones."""
        return [
            unit.fsdp_module
            for unit in units_in(module, root_only)
            if isinstance(unit.fsdp_module, FullyShardedDataParallel)
        ]

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``nn.Module.apply`` with full parameters visible (edits are written back).

        Each unit exposes only its own parameters while ``fn`` runs over its modules; nested
        units do the same in their own ``apply``, which ``nn.Module.apply`` reaches as it
        recurses (as in torch)."""
        self._assert_state(TrainingState.IDLE)
        with FullyShardedDataParallel.summon_full_params(self, recurse=False, writeback=True):
            super().apply(fn)
        return self

    def _assert_state(self, state: Any) -> None:
        """Raise ``ValueError`` unless the unit is in ``state`` (one or a list; fullshard's or
        torch's ``TrainingState``, compared by name), as torch's ``_assert_state``."""
        states = state if isinstance(state, (list, tuple)) else [state]
        if self.training_state.name not in {s.name for s in states}:
            raise ValueError(
                f"expected to be in states {list(states)} but current state is "
                f"{self.training_state} (FSDP unit '{self._unit.label}')"
            )

    @contextlib.contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """Accumulate unsharded gradients locally, with no communication, inside the block."""
        if not self.check_is_root():
            raise RuntimeError(
                "`no_sync()` on inner FSDP instances is not supported. Please call `no_sync()` "
                "on root FSDP module."
            )
        units = units_in(self)
        previous = [unit.runtime.sync_gradients for unit in units]
        for unit in units:
            unit.runtime.sync_gradients = False
        try:
            yield
        finally:
            for unit, value in zip(units, previous):
                unit.runtime.sync_gradients = value

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
        """Expose every unit's full parameters inside the block (see ``_features/summon``)."""
        with summon(module, recurse, writeback, rank0_only, offload_to_cpu, with_grads):
            yield


def _supersede_previous_wrapper(module: nn.Module) -> None:
    """Wrapping a module again (e.g. a trained model for inference, with its nested units)
    is allowed, as in torch, when its previous wrapper manages no parameters of its own: the
    nested units keep theirs and follow the new root. The previous wrapper then refuses to
    run. A previous wrapper holding parameters cannot be replaced (they live in its flat
    parameter), so that is an error; so is a previous wrapper that no longer exists, since
    what it held cannot be told any more (its flat parameter may still be registered)."""
    previous_ref = _WRAPPERS.get(module)
    if previous_ref is None:
        return
    previous = previous_ref()
    if previous is None or previous._unit.handle is not None:
        raise ValueError(
            f"this {type(module).__qualname__} is already wrapped by another "
            "FullyShardedDataParallel instance, which owns its parameters now; wrap each "
            "module once and use that wrapper"
        )
    previous._unit.superseded = True
