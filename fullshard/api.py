"""Public configuration types, with the names and fields of ``torch.distributed.fsdp``."""

from __future__ import annotations

import dataclasses
import enum
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "from_torch",
]


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


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns and ``load_state_dict()`` expects (set with
    ``FullyShardedDataParallel.state_dict_type``)."""

    FULL_STATE_DICT = enum.auto()
    """The unwrapped model's keys and full tensors: loads into the plain model."""
    LOCAL_STATE_DICT = enum.auto()
    """Each unit's flat shard (``<unit path>._flat_param``, and ``._frozen_flat_param`` for
    a unit mixing frozen and trainable parameters), as a DTensor over the unit's ranks: only
    loads back at the same world size and wrapping."""
    SHARDED_STATE_DICT = enum.auto()
    """The unwrapped model's keys, each parameter a DTensor sharded on dim 0 over the
    unit's ranks: save and load with ``torch.distributed.checkpoint``, at any world size."""


@dataclass
class StateDictConfig:
    """Options shared by every state dict type."""

    offload_to_cpu: bool = False
    """Return tensors on the CPU (saves accelerator memory while saving)."""


@dataclass
class FullStateDictConfig(StateDictConfig):
    """FULL_STATE_DICT options."""

    rank0_only: bool = False
    """Only rank 0 returns the state dict (the others return an empty dict); units are
    gathered one at a time, so no rank holds more than one unsharded unit at once."""


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """LOCAL_STATE_DICT options."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """SHARDED_STATE_DICT options."""

    _use_dtensor: bool = True
    """Kept for torch's API; fullshard's sharded values are always DTensors."""


@dataclass
class OptimStateDictConfig:
    """Options shared by every optimizer state dict type."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = True


@dataclass
class StateDictSettings:
    """A module's state dict type and configs (what ``get_state_dict_type`` returns)."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


# -- FSDP2 (``fully_shard``) ---------------------------------------------------------------


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """``fully_shard``'s mixed precision, as torch's FSDP2 names it."""

    param_dtype: torch.dtype | None = None
    """Dtype of the unsharded parameters in forward and backward (and of the all-gather)."""
    reduce_dtype: torch.dtype | None = None
    """Dtype of the gradient reduce-scatter; defaults to ``param_dtype``."""
    output_dtype: torch.dtype | None = None
    """Dtype the module's floating-point outputs are cast to (None: left as computed)."""
    cast_forward_inputs: bool = True
    """Cast the module's floating-point forward inputs to ``param_dtype``."""


@dataclass
class DataParallelMeshDims:
    """Which named dims of a whole SPMD mesh are data parallel, for ``fully_shard`` on
    parameters that are already DTensors over that mesh (torch's ``dp_mesh_dims``)."""

    shard: str | tuple[str, ...] | None = None
    """The dim (or dims, flattened into one) parameters are sharded over."""
    replicate: str | tuple[str, ...] | None = None
    """The dim (or dims, flattened into one) parameters are replicated over (HSDP, DDP)."""

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError(
                "At least one of shard or replicate must be set in DataParallelMeshDims"
            )

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(dims: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if dims is None:
        return ()
    return (dims,) if isinstance(dims, str) else tuple(dims)


@dataclass
class OffloadPolicy:
    """No offloading (the base class of ``fully_shard``'s offload policies)."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters, gradients and so optimizer states on the CPU; parameters are
    copied to the device for forward and backward."""

    pin_memory: bool = True
    """Pin the CPU copies (used when computing on CUDA)."""


# -- torch's own configuration objects ----------------------------------------------------

# [Note: torch's configuration objects]
# Scripts mix imports: `from torch.distributed.fsdp import MixedPrecision` beside fullshard's
# `FullyShardedDataParallel`, or torch's `CPUOffloadPolicy()` passed to fullshard's
# `fully_shard`; stacks (accelerate, Lightning) build torch's objects themselves. Each front
# door passes what it is given through `from_torch`, which turns an object of torch's FSDP
# config types (recognised by module and class name: the engine never imports torch's FSDP)
# into fullshard's class of the same name, field for field. A field fullshard's class lacks
# is refused rather than dropped: ignoring an option is a silent difference.

_TORCH_FSDP_MODULE = "torch.distributed.fsdp"


def _is_torch_fsdp_type(cls: type) -> bool:
    module = getattr(cls, "__module__", "") or ""
    return module == _TORCH_FSDP_MODULE or module.startswith(_TORCH_FSDP_MODULE + ".")


def from_torch(value: Any, counterpart: type | None = None) -> Any:
    """``value`` as fullshard's config object if it is one of torch's FSDP config objects (an
    enum member or a dataclass of ``torch.distributed.fsdp``, e.g. its ``MixedPrecision`` or
    ``CPUOffloadPolicy``); anything else unchanged (the caller validates it). fullshard's
    class is the one of this module with the same name, or ``counterpart`` for a type
    defined elsewhere."""
    cls = type(value)
    if not _is_torch_fsdp_type(cls):
        return value
    ours: Any = counterpart or getattr(sys.modules[__name__], cls.__name__, None)
    if ours is not None and ours.__name__ != cls.__name__:
        return value
    if ours is None or ours is cls:  # no counterpart here, or already ours
        return value
    if isinstance(value, enum.Enum) and issubclass(ours, enum.Enum):
        if value.name not in ours.__members__:
            raise ValueError(f"{cls.__name__}.{value.name} has no counterpart in fullshard")
        return ours[value.name]
    if not dataclasses.is_dataclass(value):
        return value
    names = {f.name for f in dataclasses.fields(ours)}
    values = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise TypeError(
            f"torch's {cls.__name__} has fields {unknown} that fullshard's {cls.__name__} does "
            f"not support; pass fullshard.{cls.__name__} without them"
        )
    return ours(**{name: from_torch(field_value) for name, field_value in values.items()})
