"""``FSDPModule``: what ``fully_shard`` adds to a module's class, as torch's FSDP2 names it.

The methods act on the module's unit (``_engine.unit``) and its runtime: explicit unshard
and reshard, gradient synchronisation and division, prefetching, custom collectives and
hooks. A module's class becomes ``FSDP<Class>``, a subclass of ``FSDPModule`` and of its own
class; ``FSDPModule.__new__`` builds plain modules of the original class (containers index
themselves into new instances).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import nn

from .._comm.custom import check_comm
from .._engine import convert
from .._engine import forward as _forward
from .._engine.flat_param import HandleState
from .._engine.runtime import TrainingState, UnitRuntime
from .._engine.unit import Unit, units_in
from .state import TorchFSDPModule, state_of

__all__ = ["FSDPModule", "UnshardHandle", "fsdp_class", "share_comm_ctx"]

_FSDP_CLASSES: dict[tuple[type[nn.Module], type | None], type[nn.Module]] = {}
"""(original class, torch's ``FSDPModule`` or None) -> its ``FSDP<Class>`` subclass (made
once per class, and per state of the install switch)."""


def fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``FSDP<cls>``: fullshard's ``FSDPModule``, then ``cls``, and last (with the install
    switch on) torch's ``FSDPModule``, so ``isinstance`` against torch's class holds too (see
    [Note: the install switch] in ``_install``). Last, behind ``nn.Module``: no method of
    torch's (its ``_apply``, which asks for torch's FSDP state) runs on fullshard's modules
    through ``super()``."""
    torch_fsdp_module = TorchFSDPModule.cls
    key = (cls, torch_fsdp_module)
    if key not in _FSDP_CLASSES:
        bases = (
            (FSDPModule, cls) if torch_fsdp_module is None else (FSDPModule, cls, torch_fsdp_module)
        )
        _FSDP_CLASSES[key] = type(f"FSDP{cls.__name__}", bases, {"_orig_cls_mro_index": 2})
    return _FSDP_CLASSES[key]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` waits for the
    all-gathers (the engine's ``UnshardWork``, one per unit of the call) and gives the module
    its unsharded parameters."""

    def __init__(self, works: list[tuple[Unit, _forward.UnshardWork]]) -> None:
        self._works = works

    def wait(self) -> None:
        works, self._works = self._works, []
        for unit, work in works:
            work.wait()
            handle = unit.handle
            if handle is not None and handle.state == HandleState.UNSHARDED:
                handle.use_unsharded_views()


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (torch's ``FSDPModule`` methods)."""

    _orig_cls_mro_index: int = 2
    """Where the original class is in ``FSDP<Class>``'s MRO (torch's name)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of their own class when indexed (nn.Sequential
        # slices): those are plain modules of the original class.
        original: Any = cls.__mro__[cls._orig_cls_mro_index]
        instance = original.__new__(original)
        original.__init__(instance, *args, **kwargs)
        return instance

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization."
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to_empty`` (materialising a model sharded on the meta device), ``.to()``,
        ``.half()``...: convert, then give the unit a shard converted the same way and
        re-point the DTensor parameters into it (``_engine.convert``)."""
        units = self._units(recurse=False)
        for unit in units:
            convert.before_apply(unit)
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        for unit in units:
            convert.after_apply(unit, fn)
        return result

    @property
    def _unit(self) -> Unit:
        return state_of(self).unit  # type: ignore[arg-type]

    def _units(self, recurse: bool) -> list[Unit]:
        """This call's units (its siblings included), or every unit in the subtree."""
        if recurse:
            return units_in(self)  # type: ignore[arg-type]
        return list(state_of(self).units)  # type: ignore[arg-type]

    def _handles(self, recurse: bool) -> list[Any]:
        return [unit.handle for unit in self._units(recurse) if unit.handle is not None]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters now (e.g. to overlap with other work before forward);
        after ``wait()`` the module holds its unsharded parameters until ``reshard()`` or its
        forward's end."""
        units = self._units(recurse=False)
        for unit in units:
            if unit.runtime.training_state != TrainingState.IDLE:
                raise RuntimeError(f"unshard() of '{unit.label}' inside its forward or backward")
        work = UnshardHandle([(unit, _forward.unshard(unit)) for unit in units])
        if async_op:
            return work
        work.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its DTensor parameters again."""
        for unit in self._units(recurse=False):
            if unit.runtime.training_state != TrainingState.IDLE:
                raise RuntimeError(f"reshard() of '{unit.label}' inside its forward or backward")
            handle = unit.handle
            if handle is not None and handle.state != HandleState.SHARDED:
                handle.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward accumulates unsharded gradients locally, with no reduce-scatter
        (gradient accumulation); set True again before the last micro-batch's backward."""
        for unit in self._units(recurse):
            unit.runtime.sync_gradients = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether non-root units free their unsharded parameters after forward (and gather
        them again in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for unit in self._units(recurse):
            unit.runtime.reshard_after_forward = reshard_after_forward  # the root's too

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the number of data
        parallel ranks."""
        for handle in self._handles(recurse=False):
            handle.gradient_divide_factor = float(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False keeps each reduced gradient local to this replica's shard group
        (summed over micro-batches, not yet in ``.grad``); the next backward with True
        all-reduces the sum across replicas once and accumulates it into ``.grad``."""
        for unit in self._units(recurse):
            if unit.handle is not None:
                unit.handle.all_reduce_replicas = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False: keep the parameters unsharded after backward, so the next forward (e.g. the
        next micro-batch of gradient accumulation) needs no all-gather. If an optimizer step
        changes the shard meanwhile, the next forward gathers again instead of computing with
        stale parameters."""
        for unit in self._units(recurse):
            unit.runtime.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's backward does not read its parameters (an embedding: its
        gradient needs only the indices), so the pre-backward hook gathers nothing. Wrong
        if it does read them: they hold no storage then."""
        for unit in self._units(recurse=False):
            unit.runtime.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """At this module's forward, issue the all-gathers of ``modules`` too (after its own),
        so they overlap its compute; replaces the engine's own choice of the next module."""
        for unit in self._units(recurse=False):
            unit.runtime.forward_prefetch_targets = _runtimes(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """At this module's pre-backward, issue the all-gathers of ``modules`` too."""
        for unit in self._units(recurse=False):
            unit.runtime.backward_prefetch_targets = _runtimes(modules, "backward")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API. torch uses it to skip, on all but the last micro-batch's
        backward, waiting for the last reduce-scatter on its stream; fullshard's backward
        always ends with its gradients reduced (finalising them into ``.grad`` is part of
        the wait), so every backward is complete and the flag changes nothing."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"is_last_backward should be a bool, got {type(is_last_backward)}")

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """torch's switch (private, but called by its tests and by torchtitan's users) to
        issue the pre-forward and pre-backward all-gathers with ``async_op=True``, so that
        their buffers come from the default stream rather than a separate all-gather
        stream. fullshard has no all-gather stream: its buffers always come from the
        current stream, so both values give the same gradients and the same collectives;
        accepted, the value checked as torch's type."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op should be a bool, got {type(async_op)}")

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated in torch: use ``set_gradient_divide_factor``."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Sum gradients in the collectives and divide separately, before and after, as
        torch does (for backends or zero-copy paths with only a sum). fullshard's transports
        always sum; this moves the full- and bf16-precision division after the sum, as
        torch's does, which changes rounding only."""
        for handle in self._handles(recurse=False):
            handle.force_sum_reduction = bool(enable)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduced)`` on this module's reduced gradient shard: after the
        reduce-scatter (FSDP), or after the replicas' all-reduce (HSDP); before the division
        that finishes the average, if any is left, and before it reaches ``.grad``. On
        ``stream`` (an accelerator stream, FSDP only) if given."""
        for handle in self._handles(recurse=False):
            if stream is not None and handle.groups.replicate is not None:
                raise ValueError("stream cannot be set when using native HSDP")
            handle.all_reduce_hook = hook
            handle.all_reduce_hook_stream = stream

    def set_custom_all_gather(self, comm: Any) -> None:
        """All-gather this module's parameters with ``comm`` (torch's ``AllGather``
        interface: ``allocate`` gives the buffers, calling it issues the collective)."""
        check_comm(comm, "set_custom_all_gather")
        for handle in self._handles(recurse=False):
            for segment in handle.segments:
                segment.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Reduce-scatter this module's gradients with ``comm`` (torch's ``ReduceScatter``
        interface); it is called with ``op=ReduceOp.SUM`` (fullshard divides around it)."""
        check_comm(comm, "set_custom_reduce_scatter")
        for handle in self._handles(recurse=False):
            handle.custom_reduce_scatter = comm

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after the optimizer
        step) instead of everything before them. fullshard issues its collectives in the
        order of the current stream, so they follow the optimizer step anyway: the root
        waits for the event at its next forward, then discards it."""
        self._unit.runtime.post_optim_event = event

    def reset_iter_state(self) -> None:
        """After ``forward()`` or ``backward()`` raised: wait for the collectives in flight,
        discard the failed step's gradients not yet in ``.grad`` (``no_sync`` and HSDP
        partial sums included), reshard every unit and forget the step. Call it on the root;
        the next forward then runs normally."""
        unit = self._unit
        if unit.runtime.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        if unit.runtime.root_state is not None:
            unit.runtime.root_state.reset_step()
        else:
            for each in self._units(recurse=True):
                each.runtime.reset_step()
        for module in self.modules():  # type: ignore[attr-defined]
            if isinstance(module, FSDPModule):
                state_of(module).forget_forward()  # type: ignore[arg-type]

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether a parameter that got no gradient in backward gets a zero one, reduced
        with the others' (ranks using different parameters, e.g. mixture of experts)."""
        for handle in self._handles(recurse):
            handle.reduce_unused_params = bool(reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many gradient reductions may stay in flight (each holds its input buffer):
        the engine's ``reductions_in_flight`` dial, per unit."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for unit in self._units(recurse):
            unit.runtime.max_reductions_in_flight = max_input_buffers

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Not implemented: fullshard's reduce-scatter has its own transport per group
        already on one host (shared memory), and no second NCCL communicator yet."""
        raise NotImplementedError(
            "FSDPModule.set_separate_reduce_scatter_group is not implemented by fullshard; "
            "remove the call (reductions already run beside all-gathers on its transports)"
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """torch: allocate the collectives' staging buffers from the process group's own
        allocator (NCCL's zero-copy registration). fullshard's transports stage nothing that
        way (shared memory between CPU ranks; NCCL reads and writes the unit's own buffers),
        so it warns that the request changes nothing. As torch, refused once a custom
        all-gather or reduce-scatter is set (set after this, they replace it)."""
        for handle in self._handles(recurse=False):
            customised = handle.custom_reduce_scatter is not None or any(
                segment.custom_all_gather is not None for segment in handle.segments
            )
            if customised:
                raise AssertionError(
                    "set_allocate_memory_from_process_group_for_comm cannot be used with "
                    "set_custom_all_gather or set_custom_reduce_scatter"
                )
        if enable:
            warnings.warn(
                "fullshard ignores set_allocate_memory_from_process_group_for_comm(True): its "
                "transports allocate their own communication buffers (nothing is registered "
                "with the process group)",
                stacklevel=2,
            )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not implemented: symmetric-memory all-gathers are NCCL's."""
        raise NotImplementedError(
            "FSDPModule.set_symm_mem_for_comm is not implemented by fullshard; remove the "
            "call, or use set_custom_all_gather with a comm that allocates symmetric memory"
        )


def _runtimes(modules: list[FSDPModule], direction: str) -> list[UnitRuntime]:
    runtimes: list[UnitRuntime] = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects FSDPModule but got {type(module)}: {module}")
        runtimes.extend(unit.runtime for unit in module._units(recurse=False))
    return runtimes


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """torch: let several roots (pipeline stages) share one set of communication streams.
    fullshard's collectives run on per-group transports, not per-root streams, so roots
    share them already; the modules are checked as torch checks them."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
