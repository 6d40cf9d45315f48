"""fullshard: Fully Sharded Data Parallel for PyTorch, with torch FSDP's public API.

Switch from torch by changing one import::

    from fullshard import FullyShardedDataParallel as FSDP, ShardingStrategy
"""

from __future__ import annotations

from . import wrap
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
from .flat_param import FlatParameter
from .fully_sharded_data_parallel import FullyShardedDataParallel, OptimStateKeyType
from .sharded_grad_scaler import ShardedGradScaler

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "FlatParameter",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "wrap",
]
