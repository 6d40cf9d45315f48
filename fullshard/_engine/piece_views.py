"""Each original parameter's piece of a rank's shard, as views of a shard-shaped flat tensor
(the flat parameter's shard, or a gradient's), and the addresses those views would have.

A unit's ``use_orig_params`` / ``fully_shard`` parameters live on these pieces between steps,
and every unshard, reshard and backward looks at them: a per-parameter cost in the host's
step, which matters wherever the host, not the device, sets the pace (small models, one
GPU). One ``split_with_sizes`` over the pieces and the padding between them makes every view
at once; ``places`` gives their addresses and shapes by arithmetic, so a reshard that finds
every parameter already on its piece makes no view at all.
"""

from __future__ import annotations

import itertools

import torch

from .layout import FlatLayout, ShardPiece

__all__: list[str] = []

_EMPTY = torch.Size((0,))


class PieceViews:
    """The pieces of one segment's shard, per slot of its layout: this rank's ``pieces``
    when ``sharded`` (flat, empty where it has none), else each whole parameter in its
    shape (NO_SHARD, one rank)."""

    def __init__(self, layout: FlatLayout, pieces: tuple[ShardPiece | None, ...], sharded: bool):
        self._layout, self._pieces, self._sharded = layout, pieces, sharded
        if sharded:
            spans = [None if p is None else (p.shard_start, p.numel) for p in pieces]
            total = layout.shard_numel
        else:
            spans = [(slot.offset, slot.numel) for slot in layout.slots]
            total = layout.padded_numel
        self._sizes, self._places = _split(spans, total)
        self._starts = list(itertools.accumulate(self._sizes, initial=0))
        self._shapes = [
            _EMPTY if place is None else torch.Size((self._sizes[place],)) if sharded else s.shape
            for place, s in zip(self._places, layout.slots)
        ]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per slot, its piece of the shard-shaped ``flat``, detached (what every caller
        wants: views to read, to write under ``no_grad`` or to show as ``.grad``)."""
        if flat.numel() != self._starts[-1]:  # not shard-shaped, or pieces overlap
            return self._sliced(flat)
        chunks = flat.detach().split_with_sizes(self._sizes)
        if not self._sharded:  # whole parameters, in their shapes
            return [chunks[p].view(s) for p, s in zip(self._places, self._shapes)]  # type: ignore[index]
        return [flat.new_empty(0) if p is None else chunks[p] for p in self._places]

    def places(self, flat: torch.Tensor) -> list[tuple[int, torch.Size] | None]:
        """Per slot, the address and shape of its view in ``views(flat)``, without making
        it (an empty piece: address 0); all None where ``flat`` is not a plain contiguous
        tensor (an extensions-only segment's expanded zero)."""
        if not flat.is_contiguous() or flat.numel() != self._starts[-1]:
            return [None] * len(self._places)
        base, itemsize = flat.data_ptr(), flat.element_size()
        return [
            (0 if place is None else base + self._starts[place] * itemsize, shape)
            for place, shape in zip(self._places, self._shapes)
        ]

    def _sliced(self, flat: torch.Tensor) -> list[torch.Tensor]:
        views: list[torch.Tensor] = []
        for slot, piece in zip(self._layout.slots, self._pieces):
            if not self._sharded:
                views.append(flat[slot.offset : slot.offset + slot.numel].view(slot.shape))
            elif piece is None:
                views.append(flat.new_empty(0))
            else:
                views.append(flat[piece.shard_start : piece.shard_start + piece.numel])
        return [view.detach() for view in views]


def _split(spans: list[tuple[int, int] | None], total: int) -> tuple[list[int], list[int | None]]:
    """The sizes that split a flat tensor of ``total`` elements into the ``spans`` (start,
    numel) and the gaps between them, and per span its position among them (None for no
    span); sizes ``[-1]`` where spans overlap (no split gives them: slices do)."""
    sizes: list[int] = []
    places: dict[int, int] = {}
    end = 0
    for start, slot in sorted((span[0], slot) for slot, span in enumerate(spans) if span):
        if start < end:
            return [-1], [None] * len(spans)
        if start > end:  # a gap: padding
            sizes.append(start - end)
        places[slot] = len(sizes)
        sizes.append(spans[slot][1])  # type: ignore[index]
        end = sizes[-1] + start
    if total > end:
        sizes.append(total - end)
    return sizes, [places.get(slot) for slot in range(len(spans))]
