"""Flat-parameter layout: where each original parameter lives in one flat 1-D buffer.

Pure functions over shapes and sizes; no process group, no device. A unit's original
parameters are laid out back to back in registration order, then the buffer is padded at
the end so that ``padded_numel % num_shards == 0`` and every rank holds an equal shard.

Worked example: parameters of 3 and 4 elements on 3 ranks::

    flat (numel 7, padded_numel 9):  [a0 a1 a2 | b0 b1 b2 b3 | pad pad]
    rank 0 shard [0, 3):             [a0 a1 a2]        -> a[0:3]
    rank 1 shard [3, 6):             [b0 b1 b2]        -> b[0:3]
    rank 2 shard [6, 9):             [b3 pad pad]      -> b[3:4]

A unit whose parameters differ in ``requires_grad`` is laid out as two such buffers
("segments", see ``UnitLayout``), each padded and sharded on its own: the trainable
parameters first, then the frozen ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__: list[str] = []


@dataclass(frozen=True)
class ParamSlot:
    """One original parameter's place in the unpadded flat buffer."""

    fqn: str
    """Name relative to the unit's wrapped module, without wrapper prefixes."""
    shape: torch.Size
    numel: int
    offset: int
    """First element of this parameter in the flat buffer."""
    requires_grad: bool


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard."""

    slot_index: int
    param_start: int
    """Offset of the piece within the parameter's flattened elements."""
    shard_start: int
    """Offset of the piece within the rank's shard."""
    numel: int


@dataclass(frozen=True)
class FlatLayout:
    """How a unit's parameters map into its flat buffer and onto ``num_shards`` shards."""

    slots: tuple[ParamSlot, ...]
    numel: int
    """Number of real elements (sum of the parameters' numels)."""
    padded_numel: int
    """``numel`` rounded up to a multiple of ``num_shards``."""
    num_shards: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    @property
    def numels(self) -> list[int]:
        return [slot.numel for slot in self.slots]

    def shard_range(self, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` of ``shard_rank``'s shard in the padded buffer."""
        if not 0 <= shard_rank < self.num_shards:
            raise ValueError(f"shard rank {shard_rank} out of range [0, {self.num_shards})")
        start = shard_rank * self.shard_numel
        return start, start + self.shard_numel

    def shard_pieces(self, shard_rank: int) -> tuple[ShardPiece | None, ...]:
        """For each parameter, its piece in ``shard_rank``'s shard, or None if it has none."""
        shard_start, shard_end = self.shard_range(shard_rank)
        pieces: list[ShardPiece | None] = []
        for index, slot in enumerate(self.slots):
            start = max(slot.offset, shard_start)
            end = min(slot.offset + slot.numel, shard_end)
            if start >= end:
                pieces.append(None)
                continue
            pieces.append(
                ShardPiece(
                    slot_index=index,
                    param_start=start - slot.offset,
                    shard_start=start - shard_start,
                    numel=end - start,
                )
            )
        return tuple(pieces)

    @property
    def leaf_numel(self) -> int:
        """Elements of the unsharded buffer that modules' views cover (the padding at the end
        is not part of any parameter)."""
        return self.numel

    def unsharded_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per slot, its view (in its shape) of an unsharded flat tensor of this layout (of
        ``leaf_numel`` elements or more)."""
        pieces = torch.split(flat[: self.numel], self.numels)
        return [piece.view(slot.shape) for piece, slot in zip(pieces, self.slots)]


@dataclass(frozen=True)
class Dim0Layout(FlatLayout):
    """FSDP2's layout: every parameter split on dim 0 as ``torch.chunk`` splits it.

    Each rank's shard holds, back to back, its chunk of each parameter, every chunk padded
    to ``ceil(rows / num_shards)`` rows, so shards are equal and the all-gather of the
    shards (rank after rank) is the unsharded buffer. A slot's ``offset`` is its place in
    every rank's shard. Worked example: ``a`` (5 x 2) and ``b`` (3,) on 2 ranks::

        rank 0 shard (9): [a0 a1 a2 a3 a4 a5 | b0 b1 | pad]    a rows 0-2, b[0:2]
        rank 1 shard (9): [a6 a7 a8 a9 pad pad | b2 | pad pad]  a rows 3-4, b[2:3]

    A rank's chunk of a parameter is a whole number of rows, so it is that parameter's
    local tensor (``DTensor`` with ``Shard(0)``) as a view of the shard. Unsharded, a
    parameter's rows are spread over the ranks' blocks, so its unsharded tensor is a copy
    (autograd links it to the buffer; one rank, it is a view).

    """

    chunk_rows: tuple[int, ...] = ()
    """Per slot, the rows of each rank's (padded) chunk: ``ceil(rows / num_shards)``."""

    @property
    def leaf_numel(self) -> int:
        return self.padded_numel  # the padding sits between the chunks

    def _row_numel(self, index: int) -> int:
        slot = self.slots[index]
        return slot.numel // slot.shape[0] if slot.shape[0] else 0

    def local_rows(self, index: int, shard_rank: int) -> int:
        """Rows of parameter slot ``index`` that ``shard_rank`` holds (torch.chunk's split)."""
        rows, chunk = self.slots[index].shape[0], self.chunk_rows[index]
        return max(0, min(chunk, rows - shard_rank * chunk))

    def shard_pieces(self, shard_rank: int) -> tuple[ShardPiece | None, ...]:
        pieces: list[ShardPiece | None] = []
        for index, slot in enumerate(self.slots):
            rows = self.local_rows(index, shard_rank)
            row_numel = self._row_numel(index)
            if rows * row_numel == 0:
                pieces.append(None)
                continue
            first_row = shard_rank * self.chunk_rows[index]
            pieces.append(ShardPiece(index, first_row * row_numel, slot.offset, rows * row_numel))
        return tuple(pieces)

    def rank_span(self, index: int, shard_rank: int) -> tuple[int, int]:
        """``[start, end)`` of slot ``index``'s real elements in ``shard_rank``'s shard."""
        offset = self.slots[index].offset
        return offset, offset + self.local_rows(index, shard_rank) * self._row_numel(index)

    def rank_row_start(self, index: int, shard_rank: int) -> int:
        """Where ``shard_rank``'s rows of slot ``index`` start in the flattened parameter."""
        return shard_rank * self.chunk_rows[index] * self._row_numel(index)

    @property
    def evenly_split(self) -> bool:
        """Every parameter's rows split evenly over the shards: the buffer has no padding."""
        return self.padded_numel == self.numel

    def rank_chunks(
        self, index: int, param: torch.Tensor, flat: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Pairs (rows of ``param``, where they sit in the unsharded ``flat``), both flat,
        covering parameter slot ``index``: one pair when its rows split evenly over the
        ranks, else one per rank holding rows. Views where ``param`` is contiguous."""
        row_numel = self._row_numel(index)
        if row_numel == 0:
            return []
        num_shards, chunk, offset = (
            self.num_shards,
            self.chunk_rows[index],
            self.slots[index].offset,
        )
        blocks = flat[: self.padded_numel].view(num_shards, self.shard_numel)
        if param.shape[0] == chunk * num_shards:
            places = blocks[:, offset : offset + chunk * row_numel]
            return [(param.reshape(num_shards, chunk * row_numel), places)]
        pairs = []
        for shard_rank in range(num_shards):
            rows = self.local_rows(index, shard_rank)
            if rows:
                start = shard_rank * chunk
                param_rows = param[start : start + rows].reshape(-1)
                pairs.append((param_rows, blocks[shard_rank, offset : offset + rows * row_numel]))
        return pairs

    def unsharded_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        blocks = flat[: self.padded_numel].view(self.num_shards, self.shard_numel)
        views = []
        for index, slot in enumerate(self.slots):
            chunk = self.chunk_rows[index] * self._row_numel(index)
            rows = blocks[:, slot.offset : slot.offset + chunk]
            full = rows.reshape(self.num_shards * self.chunk_rows[index], *slot.shape[1:])
            views.append(full[: slot.shape[0]])
        return views


def make_dim0_layout(
    fqns: list[str],
    shapes: list[torch.Size],
    requires_grads: list[bool],
    num_shards: int,
) -> Dim0Layout:
    """Lay out parameters split on dim 0 over ``num_shards`` shards (see ``Dim0Layout``)."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    slots: list[ParamSlot] = []
    chunk_rows: list[int] = []
    offset = 0
    for fqn, shape, requires_grad in zip(fqns, shapes, requires_grads):
        shape = torch.Size(shape)
        if len(shape) == 0:
            raise ValueError(f"parameter {fqn} is 0-dimensional: it cannot be split on dim 0")
        rows = -(-shape[0] // num_shards)
        slots.append(ParamSlot(fqn, shape, shape.numel(), offset, requires_grad))
        chunk_rows.append(rows)
        offset += rows * (shape.numel() // shape[0] if shape[0] else 0)
    numel = sum(slot.numel for slot in slots)
    return Dim0Layout(tuple(slots), numel, offset * num_shards, num_shards, tuple(chunk_rows))


def padded_numel(numel: int, num_shards: int) -> int:
    """Smallest multiple of ``num_shards`` that is >= ``numel``."""
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    return -(-numel // num_shards) * num_shards


def make_layout(
    fqns: list[str],
    shapes: list[torch.Size],
    requires_grads: list[bool],
    num_shards: int,
) -> FlatLayout:
    """Lay out parameters of ``shapes`` back to back, padded for ``num_shards`` shards."""
    if not len(fqns) == len(shapes) == len(requires_grads):
        raise ValueError("fqns, shapes and requires_grads must have the same length")
    slots: list[ParamSlot] = []
    offset = 0
    for fqn, shape, requires_grad in zip(fqns, shapes, requires_grads):
        numel = torch.Size(shape).numel()
        slots.append(ParamSlot(fqn, torch.Size(shape), numel, offset, requires_grad))
        offset += numel
    return FlatLayout(tuple(slots), offset, padded_numel(offset, num_shards), num_shards)


@dataclass(frozen=True)
class UnitLayout:
    """A unit's parameters in one flat segment, or two when they differ in ``requires_grad``.

    A unit whose parameters all train (or are all frozen) is one segment, the ``FlatLayout``
    it has always been. A unit mixing them gets a trainable segment (index 0: what the
    unit's ``flat_param`` holds, so gradients, their reduction and optimizer state cover the
    trainable parameters only) and a frozen segment (index 1), each in registration order
    and each padded and sharded on its own. Worked example: ``a`` (3 elements, trainable),
    ``b`` (4, frozen) and ``c`` (2, trainable) on 2 ranks::

        segment 0 (trainable, padded 6): [a0 a1 a2 | c0 c1 pad]
            rank 0: [a0 a1 a2]    rank 1: [c0 c1 pad]
        segment 1 (frozen, padded 4):    [b0 b1 b2 b3]
            rank 0: [b0 b1]       rank 1: [b2 b3]
    """

    segments: tuple[FlatLayout, ...]
    locations: tuple[tuple[int, int], ...]
    """Per parameter, in registration order: its (segment, slot) indices."""

    @property
    def num_params(self) -> int:
        return len(self.locations)

    def slot(self, index: int) -> ParamSlot:
        """Parameter ``index`` (registration order)'s slot in its segment."""
        segment, slot = self.locations[index]
        return self.segments[segment].slots[slot]

    def param_indices(self, segment: int) -> list[int]:
        """The parameters of ``segment``, in its slot order."""
        return [i for i, (seg, _) in enumerate(self.locations) if seg == segment]


def make_unit_layout(
    fqns: list[str],
    shapes: list[torch.Size],
    requires_grads: list[bool],
    num_shards: int,
    dim0: bool = False,
) -> UnitLayout:
    """Lay out a unit's parameters: one segment, or trainable then frozen (see ``UnitLayout``);
    flat (FSDP1) or split on dim 0 (``dim0``, FSDP2: see ``Dim0Layout``)."""
    make = make_dim0_layout if dim0 else make_layout
    if not len(fqns) == len(shapes) == len(requires_grads):
        raise ValueError("fqns, shapes and requires_grads must have the same length")
    if len(set(requires_grads)) <= 1:
        groups = [list(range(len(fqns)))]
    else:
        groups = [
            [i for i, trains in enumerate(requires_grads) if trains],
            [i for i, trains in enumerate(requires_grads) if not trains],
        ]
    segments: list[FlatLayout] = []
    locations: list[tuple[int, int]] = [(-1, -1)] * len(fqns)
    for segment, indices in enumerate(groups):
        segments.append(
            make(
                [fqns[i] for i in indices],
                [shapes[i] for i in indices],
                [requires_grads[i] for i in indices],
                num_shards,
            )
        )
        for slot, index in enumerate(indices):
            locations[index] = (segment, slot)
    return UnitLayout(tuple(segments), tuple(locations))
