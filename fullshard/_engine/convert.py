"""Module conversions after wrapping (``module.half()``, ``.to(dtype)``, ``.cuda()``, ...).

``nn.Module._apply`` converts the registered parameters (the flat parameters, or the
original parameters with ``use_orig_params``); the handle then adopts the converted shard
so the unsharded buffers, views and dtypes follow (pure fp16 after wrapping).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .flat_param import HandleState
from .names import FLAT_PARAM_NAMES, flat_param_owner
from .runtime import TrainingState
from .unit import Unit

__all__: list[str] = []


def before_apply(unit: Unit) -> None:
    """Leave the unit sharded, with the original parameters' gradients in the flat one."""
    handle = unit.handle
    if handle is None:
        return
    if handle.state != HandleState.SHARDED:
        if unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(
                f"cannot convert FSDP unit '{handle.label}' during forward/backward or inside "
                "summon_full_params"
            )
        handle.reshard()  # kept unsharded by a forward with no backward
    handle.sync_orig_grads()  # before `_apply` converts the original grads apart


def after_apply(unit: Unit, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Re-point the handle at the shards ``fn`` produced (nothing if they are unchanged)."""
    handle = unit.handle
    if handle is None:
        return
    flat_params = handle.flat_params
    if unit.settings.use_orig_params:
        new_shards = [fn(flat_param._local_shard) for flat_param in flat_params]
        grad = handle.flat_param.grad
        grad = fn(grad) if grad is not None else None
    else:
        parameters = flat_param_owner(unit.module)._parameters
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
