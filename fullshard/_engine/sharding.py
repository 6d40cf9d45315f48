"""How a unit shards, in neither front door's words.

[Note: neutral settings]
torch's two FSDP APIs describe one thing two ways. FSDP1 names a ``ShardingStrategy`` and
gives process groups (one, or a (shard, replicate) pair, or a 1-D/2-D ``device_mesh``);
FSDP2 gives a mesh (1-D: shard; 2-D: (replicate, shard)), ``reshard_after_forward`` (a bool,
or ``k`` ranks) and, per parameter, ``shard_placement_fn``. The engine reads neither: each
front door translates its options into one ``Sharding``, which says

- over which ranks the parameters are split (``groups.shard``) and which ranks hold the same
  split (``groups.replicate``: their reduced gradients are all-reduced), or that they are not
  split at all (``split`` False: whole on every rank, gradients all-reduced);
- when the unsharded parameters are freed: after forward (``reshard_after_forward``: yes, no,
  or None for "yes except the root's"), over ``k`` ranks between forward and backward
  (``post_forward_group``), and after a forward no backward follows
  (``reshard_without_backward``);
- how the original parameters look: FSDP1's flat parameters and views (``mesh`` None), or
  FSDP2's DTensors on ``mesh``, each split on ``shard_dim(param)``.

FSDP1's strategies map onto it as (split, reshard_after_forward, replicate group):
FULL_SHARD (yes, None, none), SHARD_GRAD_OP (yes, False, none), HYBRID_SHARD (yes, None,
given), _HYBRID_SHARD_ZERO2 (yes, False, given), NO_SHARD (no, False, none); any strategy
over one rank is NO_SHARD, as torch's. FSDP2's ``fully_shard(mesh=m, reshard_after_forward=r)``
maps to (split over ``m``'s last dim unless it has one rank, ``r``, ``m``'s dim 0 for a 2-D
mesh), with ``post_forward_group`` for an int ``r``, ``reshard_without_backward`` False and
``mesh`` ``m``. One ``fully_shard`` call over several meshes is several units, one
``Sharding`` each ([Note: sibling units] in ``unit.py``). ``strategy`` names a ``Sharding``
back in FSDP1's words, for FSDP1's ``sharding_strategy`` attribute and checkpoint metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .._comm.groups import ShardingGroups
from ..api import ShardingStrategy

__all__: list[str] = []

RESHARD_AFTER_FORWARD = (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
"""FSDP1's strategies that free the unsharded parameters after forward."""


@dataclass(frozen=True)
class Sharding:
    """How a unit shards its parameters (see [Note: neutral settings])."""

    groups: ShardingGroups
    """The ranks parameters are split over (``shard``) and the ranks that hold the same
    split (``replicate``; None: none)."""
    split: bool
    """Parameters split over ``groups.shard``. False: whole on every rank, gradients
    all-reduced over ``groups.shard`` (DDP's schedule)."""
    reshard_after_forward: bool | None
    """Free the unsharded parameters after forward; None: yes, except the root's (see
    [Note: the root keeps its parameters] in ``runtime.py``)."""
    post_forward_group: dist.ProcessGroup | None = None
    """Between forward and backward, keep the parameters split over these ``k`` ranks
    instead of ``groups.shard`` (FSDP2's ``reshard_after_forward=k``)."""
    reshard_without_backward: bool = True
    """A forward no backward can follow (grad disabled) frees the unsharded parameters
    whatever ``reshard_after_forward`` says (FSDP1's rule); False: it follows it (FSDP2's)."""
    mesh: DeviceMesh | None = None
    """The original parameters are DTensors on this mesh (FSDP2); None: FSDP1's flat
    parameters, whose original parameters are views."""
    shard_dim: Callable[[nn.Parameter], int] | None = None
    """With ``mesh``: the dim each parameter is split on (None: dim 0 for every one)."""

    @property
    def hybrid(self) -> bool:
        """Split within a group and replicated across groups (HSDP)."""
        return self.split and self.groups.replicate is not None

    @property
    def strategy(self) -> ShardingStrategy:
        """FSDP1's name for this sharding."""
        if not self.split:
            return ShardingStrategy.NO_SHARD
        keeps = self.reshard_after_forward is False
        if self.hybrid:
            return ShardingStrategy._HYBRID_SHARD_ZERO2 if keeps else ShardingStrategy.HYBRID_SHARD
        return ShardingStrategy.SHARD_GRAD_OP if keeps else ShardingStrategy.FULL_SHARD


def for_strategy(strategy: ShardingStrategy, groups: ShardingGroups) -> Sharding:
    """FSDP1's ``strategy`` over ``groups`` (one already made NO_SHARD over one rank)."""
    return Sharding(
        groups=groups,
        split=strategy != ShardingStrategy.NO_SHARD,
        reshard_after_forward=None if strategy in RESHARD_AFTER_FORWARD else False,
    )


def for_mesh(
    mesh: DeviceMesh,
    reshard_after_forward: bool | None,
    post_forward_group: dist.ProcessGroup | None,
    shard_dim: Callable[[nn.Parameter], int] | None,
) -> Sharding:
    """FSDP2's ``fully_shard(mesh=mesh, reshard_after_forward=...)`` (an int ``k`` already
    resolved into ``post_forward_group``)."""
    groups = ShardingGroups(
        mesh.get_group(mesh.ndim - 1), mesh.get_group(0) if mesh.ndim == 2 else None
    )
    return Sharding(
        groups=groups,
        split=groups.shard_size > 1 or groups.replicate_size > 1,
        reshard_after_forward=reshard_after_forward,
        post_forward_group=post_forward_group,
        reshard_without_backward=False,
        mesh=mesh,
        shard_dim=shard_dim,
    )
