"""A process-wide check that no optimizer steps over parameters a unit took over.

An optimizer built before wrapping (use_orig_params=False) holds the original parameters,
which the unit emptied: its steps would silently do nothing, so its first step raises.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .orig_params import RELEASED

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
                raise RuntimeError(
                    f"{type(optimizer).__name__} holds parameters that FullyShardedDataParallel "
                    f"took over when it wrapped the model (e.g. {name}): they are empty "
                    "now and never get gradients, so this step would change nothing. Build the "
                    "optimizer after wrapping, over the wrapped model's parameters() (or wrap "
                    "with use_orig_params=True, which keeps the original parameters; with "
                    "fully_shard, build it after fully_shard, over model.parameters(): its "
                    "parameters are new DTensor ones)"
                )
    _CHECKED_OPTIMIZERS[optimizer] = count
