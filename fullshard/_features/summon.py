"""``summon_full_params``: expose full parameters outside forward/backward.

Built on the handle's own verbs (``unshard``, ``wait_unshard``, ``reshard``): it issues every
unit's all-gather first, then waits for each, so the gathers overlap one another.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

import torch.distributed as dist
from torch import nn

from .._engine.flat_param import FlatParamHandle, HandleState
from .._engine.names import FLAT_PARAM_NAMES, flat_param_owner
from .._engine.runtime import TrainingState
from .._engine.unit import Unit, units_in

__all__ = ["SummonStateError", "UnsupportedSummonError"]


class UnsupportedSummonError(ValueError, NotImplementedError):
    """An argument combination summon_full_params does not support. torch raises
    NotImplementedError for these; fullshard raised ValueError before, so it is both."""


class SummonStateError(RuntimeError, AssertionError):
    """summon_full_params called where it cannot run (inside forward/backward, or inside
    another summon of the same unit). torch raises AssertionError; also a RuntimeError."""


def _validate(
    units: list[Unit],
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> None:
    if writeback and rank0_only:
        raise UnsupportedSummonError(
            "writeback=True and rank0_only=True is not supported, as model parameter shapes "
            "will be different across ranks, and writing to them can lead to inconsistencies "
            "across ranks when the context is exited."
        )
    if with_grads and rank0_only:
        raise UnsupportedSummonError(
            "summon_full_params(with_grads=True, rank0_only=True) is not supported: gather "
            "gradients on every rank (rank0_only=False)"
        )
    for unit in units:
        if with_grads and (offload_to_cpu or not unit.settings.use_orig_params):
            raise UnsupportedSummonError(
                f"summon_full_params(with_grads=True) with use_orig_params="
                f"{unit.settings.use_orig_params}, offload_to_cpu={offload_to_cpu} is not supported: "
                "construct FullyShardedDataParallel with use_orig_params=True and leave "
                "offload_to_cpu=False"
            )
        runtime = unit.runtime
        if runtime.training_state == TrainingState.SUMMON_FULL_PARAMS:
            raise SummonStateError(
                "Cannot manually unshard parameters when already unsharding parameters: "
                f"summon_full_params is already active on FSDP unit '{unit.label}'"
            )
        if runtime.training_state != TrainingState.IDLE:
            raise SummonStateError(
                "Cannot manually unshard parameters during forward/backward: call "
                "summon_full_params outside the model's forward and backward"
            )
        handle = unit.handle
        if offload_to_cpu and handle is not None and not handle.uses_sharded_strategy:
            raise UnsupportedSummonError(
                f"offload_to_cpu=True and NO_SHARD is not supported (FSDP unit "
                f"'{unit.label}'): its parameters are already full on every rank; leave "
                "offload_to_cpu=False"
            )
        if offload_to_cpu and unit.compute_device.type != "cpu":
            raise NotImplementedError(
                "fullshard does not support summon_full_params(offload_to_cpu=True) for "
                "parameters on an accelerator yet"
            )


@contextlib.contextmanager
def summon(
    module: nn.Module,
    recurse: bool,
    writeback: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    with_grads: bool,
) -> Generator[None, None, None]:
    units = units_in(module, root_only=not recurse)
    _validate(units, writeback, rank0_only, offload_to_cpu, with_grads)
    handles = [unit.handle for unit in units if unit.handle is not None]
    expose = not rank0_only or dist.get_rank() == 0
    hidden: list[tuple[nn.Module, str, nn.Parameter]] = []
    entered = False
    try:
        _gather(handles)
        if not expose:  # rank0_only: the other ranks only took part in the all-gathers
            for handle in handles:
                handle.reshard()
        for unit in units:
            unit.runtime.begin_summon(expose)
        entered = True
        if expose:
            for handle in handles:
                handle.expose_unsharded_params()
                if with_grads:
                    handle.expose_unsharded_grads()
            for unit in units:
                hidden.extend(_deregister_flat_params(unit))
        yield
    finally:
        for owner, name, flat_param in hidden:
            owner.register_parameter(name, flat_param)
        _restore(units if entered else [], handles, writeback and expose)


def _deregister_flat_params(
    unit: Unit,
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """While the full parameters are exposed, the flat parameters are not registered, as in
    torch: ``model.parameters()`` over a model whose root is not a unit then lists each
    parameter once, at full size (registered again on exit)."""
    if unit.handle is None or unit.settings.use_orig_params:
        return []
    owner = flat_param_owner(unit.module)
    hidden = []
    for name in FLAT_PARAM_NAMES:
        flat_param = owner._parameters.get(name)
        if flat_param is not None:
            hidden.append((owner, name, flat_param))
            del owner._parameters[name]
    return hidden


def _gather(handles: list[FlatParamHandle]) -> None:
    """Issue every all-gather first, then wait for each, so they overlap one another."""
    for handle in handles:
        # Full parameters in their own dtype (not MixedPrecision.param_dtype): what users
        # inspect and what writeback must store into the shard.
        if handle.state != HandleState.SHARDED and not handle.unsharded_matches(True):
            handle.reshard()  # kept unsharded in low precision by a forward
        if handle.state == HandleState.SHARDED:
            handle.unshard(full_precision=True)
    for handle in handles:
        handle.wait_unshard()


def _restore(units: list[Unit], handles: list[FlatParamHandle], writeback: bool) -> None:
    """Leave every unit as it was before the summon, on every exit path (an error in the
    block, in a gather, or in one handle's restore included): the first error is raised
    once all units are restored, so a failed summon never leaves the model unusable.
    ``units``: those whose training state entered the summon (none if a gather failed)."""
    errors: list[BaseException] = []
    for handle in handles:
        try:
            if handle.exposes_unsharded_params:
                handle.hide_unsharded_params(writeback)
            elif handle.state != HandleState.SHARDED:
                handle.reshard()
        except BaseException as error:  # re-raised below, once every unit is restored
            errors.append(error)
    for unit in units:
        unit.runtime.end_summon()
    if errors:
        raise errors[0]
