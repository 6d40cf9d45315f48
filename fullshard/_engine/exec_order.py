"""torch's forward execution-order validation, under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

[Note: execution-order validation]
Ranks must unshard units in the same order, or their all-gathers pair the wrong units. With
the distributed debug level at DETAIL (``TORCH_DISTRIBUTED_DEBUG=DETAIL`` or
``dist.set_debug_level``), torch's FSDP1 checks this in training forwards, and fullshard does
the same with torch's texts:

- first iteration: before each unit's all-gather, the ranks all-gather the unit's index and
  raise ``RuntimeError("Forward order differs across ranks: ...")`` naming what every rank
  was about to unshard;
- later iterations: each rank compares its order with its own first iteration's and warns
  once, ``"Forward order differs from that of the first iteration on rank R. ..."``. torch
  then lets the mismatched all-gathers run (a wrong result, or a hang); fullshard's own
  mismatch detection (see [Note: mismatch detection] in _comm/collectives.py, and the shared-
  memory transport's signatures) raises at the first collective that pairs different units.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .._comm.collectives import named

if TYPE_CHECKING:
    from .flat_param import FlatParamHandle

__all__ = ["ExecOrderValidator", "validation_enabled"]


def validation_enabled() -> bool:
    return dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL


class ExecOrderValidator:
    """Records the units' forward order per training iteration and checks it (see the Note)."""

    def __init__(self, handles: list[FlatParamHandle | None]) -> None:
        """``handles``: the root's units' handles, in unit order (None: a unit with no
        parameters, which never all-gathers)."""
        self._index = {id(handle): i for i, handle in enumerate(handles) if handle is not None}
        self._names = [_label(handle) for handle in handles]
        self._first: list[int] | None = None
        """The first iteration's order (unit indices), once it is over."""
        self._current: list[int] = []
        self._warned = False

    def begin_iteration(self) -> None:
        if self._current and self._first is None:
            self._first = self._current
        self._current = []

    def record(self, handle: FlatParamHandle) -> None:
        """Before ``handle``'s all-gather in a training forward."""
        index = self._index[id(handle)]
        position = len(self._current)
        self._current.append(index)
        if self._first is None:
            self._check_across_ranks(handle, index)
        elif not self._warned and (position >= len(self._first) or self._first[position] != index):
            self._warned = True
            expected = self._first[position] if position < len(self._first) else None
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank "
                f"{dist.get_rank()}. Collectives are checked by fullshard, which raises if "
                f"ranks pair different units. Unit {position} of the forward is unit index "
                f"{index} ({self._names[index]}), was unit index {expected} in the first iteration",
                stacklevel=2,
            )

    def _check_across_ranks(self, handle: FlatParamHandle, index: int) -> None:
        mine = torch.tensor([index], dtype=torch.int64, device=handle.device)  # NCCL: on GPU
        gathered = [torch.empty_like(mine) for _ in range(handle.groups.shard_size)]
        with named("the check of the forward order across ranks", handle.groups.shard):
            dist.all_gather(gathered, mine, group=handle.groups.shard)
        indices = [int(t.item()) for t in gathered]
        if len(set(indices)) > 1:
            names = dict(enumerate(self._names))
            each = ", ".join(
                f"rank {rank}: unit index {i} ({names.get(i, '?')})"
                for rank, i in enumerate(indices)
            )
            raise RuntimeError(
                f"Forward order differs across ranks: at unshard {len(self._current)} of "
                f"the first iteration, {each}. Every rank must run the same FSDP units "
                "in the same order (no rank-dependent control flow around wrapped modules)"
            )


def _label(handle: FlatParamHandle | None) -> str:
    return handle.label if handle is not None else "(no params)"
