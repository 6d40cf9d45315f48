"""Resolve the shard and replicate groups of a unit from the user's arguments."""

from __future__ import annotations

import os
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..api import ShardingStrategy

__all__: list[str] = []

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)

# Default hybrid groups, created once per (default group, local world size): building them
# calls `new_group` on every rank, and the units one auto_wrap_policy builds (each resolving
# process_group=None) must share one set of groups. Tests that wrap hybrid units by hand pass
# these explicitly (tests/support/models.py).
# Keyed weakly by the default group itself (not its id), so a re-initialised default group
# never finds the groups of a destroyed one, and a destroyed one's groups (their gloo
# threads, their shared-memory files) go with it.
_DEFAULT_HYBRID_GROUPS: weakref.WeakKeyDictionary[
    dist.ProcessGroup, dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]]
] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class ShardingGroups:
    """The groups a unit communicates over, resolved once at construction."""

    shard: dist.ProcessGroup
    """Parameters are sharded over (and gradients reduce-scattered within) this group."""
    replicate: dist.ProcessGroup | None
    """Hybrid strategies all-reduce the sharded gradient over this group; else None."""

    # The groups' own rank() and size(), not dist.get_rank(group): torch accepts any object
    # with those two methods (its tests pass such stand-ins for wrapping without collectives).

    @property
    def shard_size(self) -> int:
        return self.shard.size()

    @property
    def shard_rank(self) -> int:
        return self.shard.rank()

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate is None else self.replicate.size()

    @property
    def num_data_parallel_ranks(self) -> int:
        """How many ranks see different data: gradients are averaged over this many."""
        return self.shard_size * self.replicate_size


def _local_world_size() -> int:
    env = os.environ.get("LOCAL_WORLD_SIZE")
    if env is not None:
        return int(env)
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        return torch.cuda.device_count()
    return dist.get_world_size()


def _default_hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """Shard within a node (``LOCAL_WORLD_SIZE`` ranks), replicate across nodes."""
    world_size = dist.get_world_size()
    local_size = _local_world_size()
    if local_size < 1 or world_size % local_size != 0:
        raise ValueError(
            f"HYBRID_SHARD needs the world size ({world_size}) to be a multiple of the "
            f"local world size ({local_size}); pass process_group=(shard_group, "
            "replicate_group) or a 2-D device_mesh instead"
        )
    world = dist.group.WORLD
    assert world is not None
    made = _DEFAULT_HYBRID_GROUPS.setdefault(world, {})
    if local_size in made:
        return made[local_size]
    rank = dist.get_rank()
    num_nodes = world_size // local_size
    shard_group = replicate_group = None
    for node in range(num_nodes):  # every rank must create every group, in the same order
        ranks = list(range(node * local_size, (node + 1) * local_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            shard_group = group
    for local_rank in range(local_size):
        ranks = list(range(local_rank, world_size, local_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            replicate_group = group
    assert shard_group is not None and replicate_group is not None
    made[local_size] = (shard_group, replicate_group)
    return shard_group, replicate_group


def _groups_from_mesh(device_mesh: Any, hybrid: bool) -> ShardingGroups:
    if device_mesh.ndim == 1:
        if hybrid:
            raise ValueError("HYBRID_SHARD with a device_mesh needs a 2-D mesh (replicate, shard)")
        return ShardingGroups(device_mesh.get_group(), None)
    if device_mesh.ndim == 2:
        if not hybrid:
            raise ValueError(
                "a 2-D device_mesh is only valid with HYBRID_SHARD or _HYBRID_SHARD_ZERO2; "
                "pass a 1-D mesh for other strategies"
            )
        return ShardingGroups(device_mesh.get_group(1), device_mesh.get_group(0))
    raise ValueError(f"device_mesh must be 1-D or 2-D, got {device_mesh.ndim}-D")


def resolve_groups(
    strategy: ShardingStrategy, process_group: Any, device_mesh: Any, *, manual: bool = False
) -> ShardingGroups:
    """Turn ``process_group`` / ``device_mesh`` into the unit's shard and replicate groups.

    ``manual``: the unit is wrapped by hand (no ``auto_wrap_policy``), where torch refuses a
    hybrid strategy without groups; auto-wrapped units get the root's default groups.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "fullshard needs torch.distributed initialised: call "
            "torch.distributed.init_process_group() (e.g. under torchrun) before wrapping"
        )
    hybrid = strategy in HYBRID_STRATEGIES
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError(
                "Cannot pass both process_group and device_mesh at the same time. Please just "
                "pass only one of them."
            )
        return _groups_from_mesh(device_mesh, hybrid)
    if hybrid:
        if process_group is None and manual:
            raise ValueError(
                f"Manual wrapping with {strategy} requires explicit specification of process "
                "group or device_mesh. Pass process_group=(shard_group, replicate_group) or a "
                "2-D device_mesh (replicate, shard) to every unit, or wrap with an "
                "auto_wrap_policy, which shards each unit within the node"
            )
        if process_group is None:
            return ShardingGroups(*_default_hybrid_groups())
        if not (isinstance(process_group, tuple) and len(process_group) == 2):
            raise ValueError(
                "Expected process_group to be passed in as either None or "
                "Tuple[dist.ProcessGroup, dist.ProcessGroup] but got "
                f"{type(process_group)}: {strategy} shards over the first group and "
                "replicates over the second (None, with an auto_wrap_policy: shard within "
                "each node)"
            )
        return ShardingGroups(process_group[0], process_group[1])
    if isinstance(process_group, tuple):
        raise ValueError(
            f"a (shard_group, replicate_group) tuple is only valid with hybrid strategies, "
            f"not {strategy}"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    assert group is not None
    return ShardingGroups(group, None)


def effective_strategy(strategy: ShardingStrategy, groups: ShardingGroups) -> ShardingStrategy:
    """A sharded strategy over one rank is NO_SHARD; say so once, as torch FSDP does."""
    if (
        strategy != ShardingStrategy.NO_SHARD
        and groups.shard_size == 1
        and groups.replicate_size == 1
    ):
        warnings.warn(
            f"FSDP is switching to use `NO_SHARD` instead of {strategy} since the world size is 1.",
            stacklevel=4,
        )
        return ShardingStrategy.NO_SHARD
    return strategy


def gradient_divide_factors(num_ranks: float) -> tuple[float, float]:
    """Split the 1/N of gradient averaging into a pre- and post-reduction division.

    Dividing partly before the sum keeps low-precision sums in range, partly after keeps
    small gradients from underflowing; the product of the two factors is ``num_ranks``.
    """
    factor = 1
    while num_ranks % factor == 0 and num_ranks / factor > factor:
        factor *= 2
    return float(factor), num_ranks / factor
