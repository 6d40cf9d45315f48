"""A collective on the shared-memory transport, cut into pieces that fit a cell.

What a rank writes into its own cell for a piece, and reads out of every rank's cell once
all have posted it: plain tensor copies over the cells it is handed, with no file, flags or
process group (those are `shared_memory.Transport`'s; see [Note: shared-memory transport]
there). Pieces are numbered in issue order over the transport; an op's first piece is set
when it is issued.

All-gather of the shards ``[1, 2, 3, 4]`` (rank 0) and ``[5, 6, 7, 8]`` (rank 1) with
cells of 2 elements, in 2 pieces: in piece 0 rank 0 posts ``[1, 2]`` and rank 1 ``[5, 6]``,
and each copies the other's into that rank's chunk of its output; piece 1 moves ``[3, 4]``
and ``[7, 8]``; both outputs are then ``[1, 2, 3, 4, 5, 6, 7, 8]``. Reduce-scatter of
``[1, 2, 3, 4]`` (rank 0) and ``[5, 6, 7, 8]`` (rank 1) in one piece: rank 0 posts its chunk
1, ``[3, 4]``, rank 1 its chunk 0, ``[5, 6]``; rank 0 sums ``[1, 2] + [5, 6] = [6, 8]``,
rank 1 ``[7, 8] + [3, 4] = [10, 12]``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Protocol

import torch

__all__ = ["AllGather", "Op", "Places", "Receiver", "ReduceScatter", "Sink"]

Sink = Callable[[int, int, torch.Tensor], None]
"""Where an all-gather may deliver instead of its output: ``sink(rank, start, data)``
receives elements ``[start, start + len(data))`` of ``rank``'s shard (its own included)."""


Places = list[tuple[int, torch.Tensor]]
"""A tensor given by where its parts lie, not as one: (start in the tensor, 1-D data of its
dtype from there), in order and disjoint; the elements no place covers are zeros."""


class Receiver(Protocol):
    """What an all-gather delivers to instead of its output (``collectives.all_gather_into``):
    the shared-memory transport copies each range of a rank's shard in through ``receive``;
    the rings receive straight into ``places``."""

    def receive(self, rank: int, start: int, data: torch.Tensor) -> None:
        """A ``Sink``."""

    def places(self, rank: int) -> list[tuple[int, torch.Tensor]]:
        """Where ``rank``'s shard goes: (start in the shard, contiguous 1-D destination of
        the elements from there), in order, every rank's list alike for the same ``rank``;
        the elements no place covers (padding) are not delivered."""


class Op:
    """A collective's pieces: what this rank writes into its cell, and reads out of all."""

    cells_per_rank = 1
    """How many of a piece's ranges a rank writes into its cell."""

    def __init__(self, kind: str, numel: int, dtype: torch.dtype, piece_numel: int) -> None:
        self.kind, self.label, self.dtype = kind, "", dtype
        self.full_numel = 0
        """The unsharded tensor's element count (as `collectives` names collectives)."""
        self.numel, self.piece_numel = numel, max(1, piece_numel)
        self.num_pieces = -(-numel // self.piece_numel)
        self.signature = 0
        """What every rank's piece must agree on (kind, unit, size, dtype), set when issued."""
        self.first_piece = -1
        """Global number of this op's first piece, set when issued."""

    def bounds(self, piece: int) -> tuple[int, int]:
        start = (piece - self.first_piece) * self.piece_numel
        return start, min(start + self.piece_numel, self.numel)

    def piece_bytes(self, piece: int) -> int:
        """Bytes a rank writes into its cell for ``piece``."""
        start, end = self.bounds(piece)
        return (end - start) * self.dtype.itemsize * self.cells_per_rank

    def post(self, piece: int, cell: torch.Tensor) -> None:
        raise NotImplementedError

    def consume(self, piece: int, cells: list[torch.Tensor]) -> None:
        raise NotImplementedError


class AllGather(Op):
    def __init__(
        self,
        output: torch.Tensor,
        shard: torch.Tensor,
        rank: int,
        num_ranks: int,
        cell: int,
        sink: Sink | None = None,
    ) -> None:
        super().__init__("all_gather", shard.numel(), shard.dtype, cell // shard.element_size())
        self.shard, self.rank, self.full_numel = shard, rank, output.numel()
        numel = self.numel

        def into_output(peer: int, start: int, data: torch.Tensor) -> None:
            # No reference to ``self``: a cycle through the sink would keep the op, and the
            # shard it holds (a cast copy under mixed precision), alive until Python's cycle
            # collector runs.
            begin = peer * numel + start  # rank after rank, ``numel`` each
            output[begin : begin + data.numel()].copy_(data)

        self.sink: Sink = sink if sink is not None else into_output  # a sink: output unused
        self.sink(rank, 0, shard)

    def post(self, piece: int, cell: torch.Tensor) -> None:
        start, end = self.bounds(piece)
        cell.view(self.shard.dtype)[: end - start].copy_(self.shard[start:end])

    def consume(self, piece: int, cells: list[torch.Tensor]) -> None:
        start, end = self.bounds(piece)
        for peer, cell in enumerate(cells):
            if peer != self.rank:
                self.sink(peer, start, cell.view(self.shard.dtype)[: end - start])


class ReduceScatter(Op):
    """Rank q's cell holds, for every other rank d in order, a range of q's chunk d divided
    by ``predivide``: the division rides on the copy instead of a pass of its own.

    ``places``, where given, are ``full`` 's elements where they lie (a unit's gradients
    where autograd left them, [Note: gradients reduced where autograd left them] in
    left_grads.py): read there instead of out of ``full``, which then only gives sizes
    and is never read. The same elements in the same order give the same bits."""

    def __init__(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        predivide: float,
        rank: int,
        num_ranks: int,
        cell: int,
        places: Places | None = None,
    ) -> None:
        per_peer = cell // full.element_size() // (num_ranks - 1)
        super().__init__("reduce_scatter", output.numel(), full.dtype, per_peer)
        self.output, self.rank, self.num_ranks = output, rank, num_ranks
        self.cells_per_rank = num_ranks - 1
        self.predivide, self.full_numel = predivide, full.numel()
        self.divisor = torch.tensor(predivide, dtype=full.dtype)  # addcdiv's, made once
        self.places = places if places is not None else [(0, full.view(-1))]
        self._starts = [start for start, _ in self.places]
        self._zero = full.new_zeros(1)

    def _runs(self, chunk: int, start: int, end: int) -> list[tuple[int, torch.Tensor]]:
        """Elements ``[start, end)`` of chunk ``chunk`` of the full tensor, as (offset from
        ``start``, data) runs back to back: the places' parts, and zeros between them."""
        begin, stop = chunk * self.numel + start, chunk * self.numel + end
        runs, at = [], begin
        index = max(0, bisect.bisect_right(self._starts, begin) - 1)
        for first, data in self.places[index:]:
            if first >= stop:
                break
            lo, hi = max(first, at), min(first + data.numel(), stop)
            if lo >= hi:
                continue
            if lo > at:
                runs.append((at - begin, self._zero.expand(lo - at)))
            runs.append((lo - begin, data[lo - first : hi - first]))
            at = hi
        if at < stop:
            runs.append((at - begin, self._zero.expand(stop - at)))
        return runs

    def _sub_cell(self, cell: torch.Tensor, index: int, length: int) -> torch.Tensor:
        # Placed by this piece's length (every rank knows it), so a piece smaller than a
        # cell touches only (num_ranks - 1) * length elements of it.
        return cell.view(self.dtype)[index * length : (index + 1) * length]

    def _divided(self, source: torch.Tensor, out: torch.Tensor) -> None:
        if self.predivide == 1:
            out.copy_(source)
        else:
            torch.div(source, self.predivide, out=out)

    def post(self, piece: int, cell: torch.Tensor) -> None:
        start, end = self.bounds(piece)
        for dest in range(self.num_ranks):
            if dest != self.rank:
                sub_cell = self._sub_cell(cell, dest - (dest > self.rank), end - start)
                for at, data in self._runs(dest, start, end):
                    self._divided(data, sub_cell[at : at + data.numel()])

    def consume(self, piece: int, cells: list[torch.Tensor]) -> None:
        start, end = self.bounds(piece)
        terms = [
            self._sub_cell(cell, self.rank - (self.rank > source), end - start)
            for source, cell in enumerate(cells)
            if source != self.rank
        ]
        output = self.output[start:end]
        for at, own in self._runs(self.rank, start, end):
            run = slice(at, at + own.numel())
            self._sum(output[run], own, [term[run] for term in terms])

    def _sum(self, out: torch.Tensor, own: torch.Tensor, terms: list[torch.Tensor]) -> None:
        # This rank's own term first, then the others' in rank order: a fixed order, and on
        # 2 ranks the same bits as any other reduce-scatter (a + b == b + a).
        # The own term and the first peer's in one pass where that gives the same bits:
        # own + peer, or peer + own / p in float32 or float64 (addcdiv rounds the quotient,
        # then the sum, as the two passes do; in a lower precision it would add the
        # unrounded quotient).
        if out.dtype != own.dtype:
            self._divided(own, out)
        elif self.predivide == 1:
            torch.add(own, terms.pop(0), out=out)
        elif self.dtype in (torch.float32, torch.float64):
            torch.addcdiv(terms.pop(0), own, self.divisor, out=out)
        else:
            self._divided(own, out)
        for term in terms:
            out.add_(term)
