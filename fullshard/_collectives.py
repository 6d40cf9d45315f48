"""Asynchronous collectives over explicit tensors and a group, with byte counters.

Every function issues its collective with ``async_op=True`` and returns the c10d work
handle: callers issue early and wait where the data is needed. Each call is recorded in
``COUNTERS`` (one per process) with the bytes one rank sends, by the ring estimate:

- all-gather of a padded buffer of B bytes over N ranks: ``B * (N - 1) / N``
- reduce-scatter of B bytes over N ranks: ``B * (N - 1) / N``
- all-reduce of B bytes over N ranks: ``2 * B * (N - 1) / N``
- gather of shards of B bytes to one rank: ``B`` from every other rank, 0 from that rank

Reduce-scatter, worked example with 2 ranks and a 4-element input::

    before: rank0 [1, 2, 3, 4], rank1 [5, 6, 7, 8]
    after:  rank0 [6, 8],       rank1 [10, 12]
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

__all__: list[str] = []

# The ``*_tensor`` names are deprecated in newer torch in favour of ``*_single``.
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CollectiveCounters:
    """Calls and bytes sent per rank, by collective kind, since the last ``reset``."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes_sent: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    labels: list[tuple[str, str]] = field(default_factory=list)
    """``(kind, label)`` per call in issue order, e.g. ``("all_gather", "layers.3")``."""

    def record(self, kind: str, label: str, num_bytes: float) -> None:
        self.calls[kind] += 1
        self.bytes_sent[kind] += num_bytes
        self.labels.append((kind, label))

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.labels.clear()

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes_sent.values()))


COUNTERS = CollectiveCounters()


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather_into(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, label: str
) -> dist.Work:
    """All-gather equal ``shard`` s from every rank of ``group`` into ``output`` (rank order)."""
    num_ranks = dist.get_world_size(group)
    COUNTERS.record("all_gather", label, _tensor_bytes(output) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::all_gather({label})"):
        work = _all_gather_single(output, shard, group=group, async_op=True)
    assert work is not None
    return work


def gather_to_first_rank(
    outputs: list[torch.Tensor] | None, shard: torch.Tensor, group: dist.ProcessGroup, label: str
) -> dist.Work:
    """Gather equal ``shard`` s to the group's first rank, into ``outputs`` (one per rank, in
    rank order; None on the other ranks, which only send)."""
    first = dist.get_global_rank(group, 0)
    sent = 0 if dist.get_rank(group) == 0 else _tensor_bytes(shard)
    COUNTERS.record("gather", label, sent)
    with record_function(f"fullshard::gather({label})"):
        work = dist.gather(shard, outputs, dst=first, group=group, async_op=True)
    assert work is not None
    return work


def reduce_scatter_into(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, label: str
) -> dist.Work:
    """Sum ``full`` over ``group`` and leave this rank's equal slice of the sum in ``output``."""
    num_ranks = dist.get_world_size(group)
    COUNTERS.record("reduce_scatter", label, _tensor_bytes(full) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::reduce_scatter({label})"):
        work = _reduce_scatter_single(output, full, group=group, async_op=True)
    assert work is not None
    return work


def all_reduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup, label: str) -> dist.Work:
    """Sum ``tensor`` in place over ``group``."""
    num_ranks = dist.get_world_size(group)
    COUNTERS.record("all_reduce", label, 2 * _tensor_bytes(tensor) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::all_reduce({label})"):
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    assert work is not None
    return work
