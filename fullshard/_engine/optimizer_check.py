"""A process-wide check that no optimizer steps over parameters a unit took over.

An optimizer built before wrapping (use_orig_params=False) holds the original parameters,
which the unit emptied: its steps would silently do nothing, so its first step raises.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .orig_params import RELEASED, REPLACED_BY_DTENSOR

__all__: list[str] = []

_CHECKED_OPTIMIZERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = (
    weakref.WeakKeyDictionary()
)
"""Optimizer -> how many parameters it held when last checked (checked again if that changes)."""
_OPTIMIZER_HOOK: list[Any] = []


def watch_optimizers() -> None:
    """Once per process: check every optimizer's parameters before its first step."""
    if not _OPTIMIZER_HOOK:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_check_optimizer_params))


def _check_optimizer_params(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CHECKED_OPTIMIZERS.get(optimizer) == count:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            name = RELEASED.get(param)
            if name is not None:
                raise RuntimeError(_stale_optimizer_message(optimizer, param, name))
    _CHECKED_OPTIMIZERS[optimizer] = count


def _stale_optimizer_message(optimizer: torch.optim.Optimizer, param: Any, name: str) -> str:
    holds = f"{type(optimizer).__name__} holds parameters that"
    if param in REPLACED_BY_DTENSOR:
        return (
            f"{holds} fully_shard replaced (e.g. {name}): fully_shard gives each module it "
            "manages new DTensor parameters, and the old ones are empty now and never get "
            "gradients, so this step would change nothing. Build the optimizer after "
            "fully_shard, over model.parameters()"
        )
    return (
        f"{holds} FullyShardedDataParallel took over when it wrapped the model (e.g. {name}): "
        "they are empty now and never get gradients, so this step would change nothing. Build "
        "the optimizer after wrapping, over the wrapped model's parameters() (or wrap with "
        "use_orig_params=True, which keeps the original parameters)"
    )
