"""The attributes torch's FSDP1 exposes on a wrapper, as read-only views of its unit.

What torch's test harness (``common_fsdp``) and users' code read from a
``FullyShardedDataParallel``: ``sharding_strategy``, ``cpu_offload``, ``mixed_precision``,
``_handle``, ``params``, ... The unit owns the state; the wrapper only shows it under torch's
names.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ._engine.flat_param import FlatParameter, FlatParamHandle
from ._engine.runtime import TrainingState, UnitRuntime
from ._engine.settings import Settings
from ._engine.unit import Unit
from .api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType

__all__: list[str] = []


class TorchAttributes:
    """torch's attribute names on a wrapper, read from its unit."""

    _unit: Unit

    @property
    def _handle(self) -> FlatParamHandle | None:
        return self._unit.handle

    @property
    def _has_params(self) -> bool:
        """Whether the unit manages parameters (accelerate skips units without)."""
        return self._unit.handle is not None

    @property
    def _flat_param(self) -> FlatParameter | None:
        """The unit's (trainable) flat parameter, None for a unit without parameters."""
        handle = self._unit.handle
        return handle.flat_param if handle is not None else None

    @property
    def _runtime(self) -> UnitRuntime:
        return self._unit.runtime

    @property
    def _settings(self) -> Settings:
        return self._unit.settings

    @property
    def compute_device(self) -> torch.device:
        return self._unit.compute_device

    @compute_device.setter
    def compute_device(self, device: torch.device) -> None:
        """torch's tests move a unit's compute device by hand to check the device errors."""
        self._unit.compute_device = device

    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._unit.settings.sharding.strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._unit.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._unit.settings.offload_params)

    @property
    def backward_prefetch(self) -> BackwardPrefetch | None:
        return self._unit.settings.backward_prefetch

    @property
    def forward_prefetch(self) -> bool:
        return self._unit.settings.forward_prefetch

    @property
    def limit_all_gathers(self) -> bool:
        """Accepted and ignored: fullshard prefetches one unit ahead (README)."""
        return self._unit.settings.limit_all_gathers

    @property
    def _use_orig_params(self) -> bool:
        return self._unit.settings.use_orig_params

    @property
    def _use_full_prec_in_eval(self) -> bool:
        return self._unit.settings.use_full_prec_in_eval

    @property
    def rank(self) -> int:
        return self._unit.settings.sharding.groups.shard_rank

    @property
    def world_size(self) -> int:
        return self._unit.settings.sharding.groups.shard_size

    @property
    def process_group(self) -> Any:
        return self._unit.settings.sharding.groups.shard

    @property
    def _inter_node_pg(self) -> Any:
        """Hybrid strategies: the group the sharded gradient is all-reduced over (torch's
        name); None otherwise."""
        return self._unit.settings.sharding.groups.replicate

    @property
    def _ignored_modules(self) -> set[nn.Module]:
        return self._unit.ignored_modules

    @property
    def _ignored_params(self) -> set[nn.Parameter]:
        return self._unit.ignored_params

    @property
    def _state_dict_type(self) -> StateDictType:
        return self._unit.state_dict_type

    @property
    def params(self) -> list[FlatParameter]:
        """torch's list of this unit's flat parameters (empty for a unit with none)."""
        return self._unit.handle.flat_params if self._unit.handle is not None else []

    @property
    def training_state(self) -> TrainingState:
        return self._unit.runtime.training_state
