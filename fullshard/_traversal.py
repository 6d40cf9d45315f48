"""Walking a model's FSDP units and their handles."""

from __future__ import annotations

from torch import nn

from .flat_param import FlatParamHandle

__all__: list[str] = []


def _get_fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
    """The flat-parameter handles of every FSDP unit in ``module``, in module order."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    return [
        unit._handle
        for unit in FullyShardedDataParallel.fsdp_modules(module)
        if unit._handle is not None
    ]
