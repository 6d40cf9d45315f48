"""fullshard: Fully Sharded Data Parallel for PyTorch, with torch FSDP's public API.

Switch from torch by changing one import::

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy

The names below load on first use (PEP 562), so ``fullshard plan`` and ``fullshard --help``
answer without importing torch (about a second and a half on a small machine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from . import wrap
    from ._comm.collectives import CollectiveError, CollectiveMismatchError
    from ._fsdp2 import (
        FSDPModule,
        UnshardHandle,
        fully_shard,
        register_fsdp_forward_method,
        share_comm_ctx,
    )
    from ._install import install
    from .api import (
        BackwardPrefetch,
        CPUOffload,
        CPUOffloadPolicy,
        DataParallelMeshDims,
        FullOptimStateDictConfig,
        FullStateDictConfig,
        LocalOptimStateDictConfig,
        LocalStateDictConfig,
        MixedPrecision,
        MixedPrecisionPolicy,
        OffloadPolicy,
        OptimStateDictConfig,
        ShardedOptimStateDictConfig,
        ShardedStateDictConfig,
        ShardingStrategy,
        StateDictConfig,
        StateDictSettings,
        StateDictType,
    )
    from .flat_param import FlatParameter
    from .fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
    from .sharded_grad_scaler import ShardedGradScaler

_HOMES = {
    "BackwardPrefetch": "api",
    "CollectiveError": "_comm.collectives",
    "CollectiveMismatchError": "_comm.collectives",
    "CPUOffload": "api",
    "CPUOffloadPolicy": "api",
    "DataParallelMeshDims": "api",
    "FSDPModule": "_fsdp2",
    "MixedPrecisionPolicy": "api",
    "OffloadPolicy": "api",
    "UnshardHandle": "_fsdp2",
    "fully_shard": "_fsdp2",
    "register_fsdp_forward_method": "_fsdp2",
    "share_comm_ctx": "_fsdp2",
    "FullOptimStateDictConfig": "api",
    "FullStateDictConfig": "api",
    "LocalOptimStateDictConfig": "api",
    "LocalStateDictConfig": "api",
    "MixedPrecision": "api",
    "OptimStateDictConfig": "api",
    "ShardedOptimStateDictConfig": "api",
    "ShardedStateDictConfig": "api",
    "ShardingStrategy": "api",
    "StateDictConfig": "api",
    "StateDictSettings": "api",
    "StateDictType": "api",
    "FlatParameter": "flat_param",
    "install": "_install",
    "FullyShardedDataParallel": "fully_sharded_data_parallel",
    "OptimStateKeyType": "fully_sharded_data_parallel",
    "ShardedGradScaler": "sharded_grad_scaler",
}
"""Public name -> the submodule that defines it."""

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "CollectiveError",
    "CollectiveMismatchError",
    "DataParallelMeshDims",
    "FSDPModule",
    "FlatParameter",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "fully_shard",
    "install",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "wrap",
]


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    elif name == "wrap":
        value = importlib.import_module(".wrap", __name__)
    else:
        raise AttributeError(f"module 'fullshard' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
