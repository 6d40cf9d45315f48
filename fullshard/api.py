"""Public configuration types, with the names and fields of ``torch.distributed.fsdp``."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["BackwardPrefetch", "CPUOffload", "MixedPrecision", "ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """How parameters, gradients and optimizer state are split across ranks."""

    FULL_SHARD = enum.auto()
    """Shard parameters, gradients and optimizer state. Parameters are all-gathered before
    forward, freed after it, all-gathered again before backward and freed after it."""
    SHARD_GRAD_OP = enum.auto()
    """Shard gradients and optimizer state; parameters stay unsharded from forward until the
    end of backward (no second all-gather)."""
    NO_SHARD = enum.auto()
    """Replicate everything, all-reduce gradients: DDP semantics."""
    HYBRID_SHARD = enum.auto()
    """FULL_SHARD inside a shard group (by default one node), replicated across groups."""
    _HYBRID_SHARD_ZERO2 = enum.auto()
    """SHARD_GRAD_OP inside a shard group, replicated across groups."""


class BackwardPrefetch(enum.Enum):
    """When the next unit's all-gather is issued during backward."""

    BACKWARD_PRE = enum.auto()
    """Before the current unit's gradient computation: most overlap, one extra unit in memory."""
    BACKWARD_POST = enum.auto()
    """After the current unit's gradient computation, before its reduce-scatter."""


@dataclass
class CPUOffload:
    """Keep sharded parameters and gradients on the CPU between uses."""

    offload_params: bool = False
    """Offload sharded parameters (and so gradients) to the CPU; the optimizer steps there."""


@dataclass
class MixedPrecision:
    """Dtypes for compute, communication and buffers; the sharded fp32 copy stays the master."""

    param_dtype: torch.dtype | None = None
    """Dtype of the unsharded parameters used in forward and backward (and on the wire)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of gradient reduction; defaults to ``param_dtype`` when only that is set."""
    buffer_dtype: torch.dtype | None = None
    """Dtype buffers are cast to for compute."""
    keep_low_precision_grads: bool = False
    """Leave ``.grad`` in the reduced dtype instead of casting back to the parameter dtype."""
    cast_forward_inputs: bool = False
    """Cast floating-point forward inputs of every unit to ``param_dtype``."""
    cast_root_forward_inputs: bool = True
    """Cast floating-point forward inputs of the root to ``param_dtype``."""
    _module_classes_to_ignore: tuple[type[nn.Module], ...] = field(
        default=(nn.modules.batchnorm._BatchNorm,)
    )
    """Module classes that run in full precision (each wrapped in its own unit)."""
