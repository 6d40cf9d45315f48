"""The unsharded parameters of a unit laid out on dim 0 (FSDP2's ``fully_shard``).

Under ``layout.Dim0Layout`` the all-gathered buffer holds rank after rank, each rank's
chunk of every parameter back to back, so a parameter's rows are spread over the ranks'
blocks and its unsharded tensor cannot be a view of the buffer. Each parameter therefore
gets a tensor of its own (``Dim0Unsharded.tensors``), filled from the gathered buffer once
the all-gather lands (copy-out), after which the buffer itself is freed; backward copies
the parameters' gradients back into one flat gradient in the buffer's layout (copy-in), the
unit's leaf's gradient that the reduce-scatter reads. This is torch's FSDP2 design too.

[Note: per-parameter unsharded storage]
Modules compute with aliases of those tensors, outputs of ``_Unflatten`` (one autograd node
per unshard, whose input is the unit's leaf), so autograd saves the aliases for backward
(``F.linear`` saves its weight). Resharding frees the tensors' storage (resized to 0), and
the next unshard (the pre-backward hook's) refills the same storage: the saved aliases see
the parameters again, as FSDP1's views of the flat buffer do. Without this, every unit's
unsharded parameters stayed alive from its forward to its backward, in autograd's saved
tensors: no memory saved by resharding after forward. The aliases are separate tensors (not
``detach()`` views), so the copy-out's writes do not bump the version counter autograd
checks for them.

[Note: one block per unit]
The unit's parameters' tensors lie back to back in one storage (``_one_block``), each a
tensor of its own over its part: an unshard allocates one unit-sized block, a reshard frees
it, and both go through the pool of freed memory ([Note: reusing unsharded memory] in
storage_pool.py), as the flat layout's buffer does. One storage per parameter (torch's
FSDP2's layout) made every unshard a malloc per parameter and every reshard a free per
parameter, blocks of a few MiB that glibc keeps in its heap, fragmented, where the pool
could not reuse them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._comm import collectives as comm
from .._comm.pieces import Places
from .layout import Dim0Layout, make_dim0_layout
from .left_grads import LeftGrads
from .storage_pool import POOL

__all__: list[str] = []


def _alias(tensor: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``tensor``'s storage with a version counter of its own."""
    alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())
    return alias


def _free(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _one_block(
    shapes: list[torch.Size], dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Tensors of ``shapes``, contiguous, back to back in one storage (freed: 0 bytes, as the
    unit starts sharded), each a tensor of its own (not a view: no base, its own version
    counter)."""
    numels = [torch.Size(shape).numel() for shape in shapes]
    storage = torch.UntypedStorage(0, device=device)
    tensors, offset = [], 0
    for shape, numel in zip(shapes, numels):
        stride = torch.empty(shape, device="meta").stride()
        tensor = torch.empty(0, dtype=dtype, device=device)
        tensors.append(tensor.set_(storage, offset, torch.Size(shape), stride))
        offset += numel
    storage.resize_(0)  # ``set_`` grew it to fit each tensor
    return tensors


class Dim0Unsharded(LeftGrads):
    """Per parameter of one segment, its unsharded tensor (storage freed while sharded); as
    ``LeftGrads``, their gradients that backward may leave where autograd put them (see
    [Note: gradients reduced where autograd left them] in left_grads.py)."""

    def __init__(
        self,
        layout: Dim0Layout,
        dtype: torch.dtype,
        device: torch.device,
        dims: list[int] | None = None,
        tensors: list[torch.Tensor] | None = None,
        shapes: list[torch.Size] | None = None,
    ) -> None:
        self.layout = layout
        self.dims = dims if dims is not None else [0] * len(layout.slots)
        """Per slot, the dim its parameter is sharded on (see [Note: sharding on another dim]
        in dtensor_params.py): ``tensors`` hold it in its own shape, contiguous, and its
        ranks' pieces are copied to and from their places rank by rank."""
        if tensors is None:  # given: the same parameters gathered over another layout
            own = shapes if shapes is not None else [slot.shape for slot in layout.slots]
            tensors = _one_block(list(own), dtype, device)
        self.tensors = tensors
        self._storage = tensors[0].untyped_storage() if tensors else None
        """The one storage every parameter's tensor lies in, back to back (see [Note: one
        block per unit])."""
        self._nbytes = sum(t.numel() for t in tensors) * (
            tensors[0].element_size() if tensors else 0
        )
        self.overrides: dict[int, torch.Tensor] = {}
        """Slot -> the tensor modules compute with instead of the slot's own (built by its
        all-gather extension; see [Note: all-gather extensions] in extensions.py)."""
        self.grads_received = [False] * len(layout.slots)
        """Per slot, whether autograd gave it a gradient since the last reduction (the
        backwards of every forward in between: accumulation, recomputation)."""
        self._whole_rows = _whole_rows_split(layout, self.dims)
        """When every parameter splits into whole rows evenly over the ranks (no padding): per
        parameter, its chunk's elements in each rank's shard. The gathered buffer is then an
        (ranks, shard) matrix whose columns split, parameter by parameter, into each one's
        rows: one ``split_with_sizes_copy`` copies every parameter out and one ``cat`` copies
        the gradients in, as torch's FSDP2 does, not one copy per parameter (on CUDA, one
        kernel launch per parameter)."""
        self._flat: list[torch.Tensor] = []
        """Each parameter's flat view, shared by the ranks' parts."""
        self._rank_parts: dict[int, list[tuple[torch.Tensor, int, int, int]]] = {}
        """Per rank that delivered to ``receive``, per parameter it holds rows of: the
        parameter's flat view (on the same storage, so valid across free and allocate), its
        span in that rank's shard, where that rank's rows start. Made at a rank's first
        delivery: only the transports read it (the shared-memory sink, the rings' places)."""
        self._places: dict[int, list[tuple[int, torch.Tensor]]] = {}
        """``places``, per rank, made at its first call."""
        LeftGrads.__init__(self, layout.padded_numel)
        self.able = self.sinkable

    def allocate(self) -> None:
        if self._storage is not None:  # see [Note: reusing unsharded memory]
            POOL.fill(self._storage, self._nbytes)

    def receive(self, rank: int, start: int, data: torch.Tensor) -> None:
        """Elements ``[start, start + len(data))`` of ``rank``'s shard, as the shared-memory
        transport delivers them: each parameter's part into that rank's rows of it (the
        padding dropped). The all-gather's sink (``collectives.gathers_into_sink``): one copy
        instead of the gathered buffer's two (into it, then out of it)."""
        end = start + data.numel()
        parts = self._rank_parts.get(rank)
        if parts is None:
            parts = self._rank_parts[rank] = self._parts_of(rank)
        for flat, first, last, row_start in parts:
            lo, hi = max(first, start), min(last, end)
            if lo < hi:
                at = row_start + lo - first
                flat[at : at + hi - lo].copy_(data[lo - start : hi - start])

    def places(self, rank: int) -> list[tuple[int, torch.Tensor]]:
        """Where ``rank``'s shard goes (a ``Receiver``'s, for the rings): per parameter it
        holds rows of, its span's start in the shard and that rank's rows."""
        places = self._places.get(rank)
        if places is None:
            parts = self._rank_parts.get(rank)
            if parts is None:
                parts = self._rank_parts[rank] = self._parts_of(rank)
            places = [(first, flat[at : at + last - first]) for flat, first, last, at in parts]
            self._places[rank] = places  # views of the storage: valid across free and allocate
        return places

    def _parts_of(
        self, rank: int, flats: Sequence[torch.Tensor | None] | None = None
    ) -> list[tuple[torch.Tensor, int, int, int]]:
        """Per parameter ``rank`` holds rows of, in slot order: its tensor among ``flats``
        (1-D, one per slot, None to skip; default the parameters' flat views), its span in
        ``rank``'s shard, and where that rank's rows start in it."""
        if flats is None:
            if len(self._flat) != len(self.tensors):
                self._flat = [tensor.view(-1) for tensor in self.tensors]
            flats = self._flat
        layout, parts = self.layout, []
        for index, flat in enumerate(flats):
            first, last = layout.rank_span(index, rank)
            if first < last and flat is not None:
                parts.append((flat, first, last, layout.rank_row_start(index, rank)))
        return parts

    @property
    def sinkable(self) -> bool:
        """Whether ``receive`` can take deliveries: every parameter sharded on dim 0 (a
        rank's part of one on another dim is not a range of it)."""
        return not any(self.dims)

    def pairs(
        self, index: int, tensor: torch.Tensor, flat: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(part of ``tensor``, its place in the unsharded ``flat``) for slot ``index``: the
        layout's rows on dim 0; on another dim d, each rank's piece ``tensor.narrow(d, ...)``
        and its block, which holds that piece contiguous."""
        dim = self.dims[index]
        if not dim:
            return self.layout.rank_chunks(index, tensor, flat)
        layout = self.layout
        size = tensor.shape[dim] // layout.num_shards
        piece_shape = (*tensor.shape[:dim], size, *tensor.shape[dim + 1 :])
        offset, numel = layout.slots[index].offset, layout.slots[index].numel // layout.num_shards
        blocks = flat[: layout.padded_numel].view(layout.num_shards, layout.shard_numel)
        return [
            (
                tensor.narrow(dim, rank * size, size),
                blocks[rank, offset : offset + numel].view(piece_shape),
            )
            for rank in range(layout.num_shards)
        ]

    def fill(self, gathered: torch.Tensor) -> None:
        """Copy each parameter out of the all-gathered buffer (copy-out)."""
        self.allocate()
        with torch.no_grad():
            sizes, tensors = self._whole_rows, self.tensors
            if sizes is not None and all(t.dtype == gathered.dtype for t in tensors):
                rows = self.layout.num_shards
                outs = [tensor.view(rows, size) for tensor, size in zip(tensors, sizes)]
                blocks = gathered[: self.layout.padded_numel].view(rows, -1)
                torch.split_with_sizes_copy(blocks, sizes, dim=1, out=outs)
                return
            for index, tensor in enumerate(tensors):
                for part, place in self.pairs(index, tensor, gathered):
                    part.copy_(place)

    def grad_places(self, grads: tuple[torch.Tensor | None, ...]) -> Places:
        """Where each element of the flat gradient of ``grads`` lies: each rank's rows of each
        parameter's gradient, in the gathered buffer's layout (rank after rank, slot after
        slot: in order)."""
        rows = [None if grad is None else grad.reshape(-1) for grad in grads]
        return [
            (rank * self.layout.shard_numel + first, flat[at : at + last - first])
            for rank in range(self.layout.num_shards)
            for flat, first, last, at in self._parts_of(rank, rows)
        ]

    def copy_in(self, grads: tuple[torch.Tensor | None, ...], flat: torch.Tensor) -> None:
        """Write the parameters' gradients into ``flat`` (the unit's flat gradient, in the
        gathered buffer's layout); zeros where none arrived and in the padding."""
        sizes, rows = self._whole_rows, self.layout.num_shards
        if sizes is not None and all(g is not None and g.dtype == flat.dtype for g in grads):
            pieces = [g.reshape(rows, size) for g, size in zip(grads, sizes)]  # type: ignore[union-attr]
            torch.cat(pieces, dim=1, out=flat[: self.layout.padded_numel].view(rows, -1))
            return
        if not (self.layout.evenly_split and all(g is not None for g in grads)):
            flat.zero_()  # padding, or a parameter's places no gradient writes
        for index, grad in enumerate(grads):
            if grad is not None:
                for part, place in self.pairs(index, grad, flat):
                    place.copy_(part)

    def free(self) -> None:
        if self._storage is not None:
            POOL.free(self._storage)
        self.overrides = {}

    def nbytes(self) -> int:
        return self._storage.nbytes() if self._storage is not None else 0

    def views(self, leaf: torch.Tensor) -> list[torch.Tensor]:
        """The parameters as modules compute with them: aliases of ``tensors``, linked by
        autograd to ``leaf`` (see [Note: per-parameter unsharded storage])."""
        return list(_Unflatten.apply(leaf, self))


class _Unflatten(torch.autograd.Function):
    """leaf (the flat unsharded buffer) -> the unit's parameters; backward writes their
    gradients into a flat gradient in the buffer's layout (zeros where a parameter got
    none, and in the padding), or returns it unwritten where the reduce-scatter reads them
    where they are ([Note: gradients reduced where autograd left them] in left_grads.py)."""

    @staticmethod
    def forward(ctx: Any, leaf: torch.Tensor, unsharded: Dim0Unsharded) -> tuple[torch.Tensor, ...]:
        ctx.unsharded, ctx.leaf = unsharded, leaf
        ctx.set_materialize_grads(False)  # a parameter that got no gradient arrives as None
        overrides = unsharded.overrides
        return tuple(
            overrides[slot].detach() if slot in overrides else _alias(t)
            for slot, t in enumerate(unsharded.tensors)
        )

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        unsharded: Dim0Unsharded = ctx.unsharded
        flat = unsharded.flat_grad(grads, ctx.leaf)
        received = [g is not None for g in grads]  # see [Note: parameters without a gradient]
        unsharded.grads_received = [a or b for a, b in zip(unsharded.grads_received, received)]
        return flat, None


def _whole_rows_split(layout: Dim0Layout, dims: list[int]) -> list[int] | None:
    """See ``Dim0Unsharded._whole_rows``: None where a parameter is sharded on another dim
    or its rows do not split evenly (its chunks padded)."""
    if any(dims) or not layout.evenly_split:
        return None
    return [
        rows * (slot.numel // slot.shape[0] if slot.shape[0] else 0)
        for slot, rows in zip(layout.slots, layout.chunk_rows)
    ]


class PostForwardShard:
    """``reshard_after_forward=k`` (FSDP2): after forward a unit keeps, instead of nothing, its
    parameters sharded over a group of ``k`` ranks (``group``: consecutive ranks of the
    mesh), so backward's all-gather runs within that smaller group (one host's ranks, say).
    ``layout`` is the unit's dim-0 layout over ``k`` shards; ``shard`` this rank's, in the
    compute dtype, from its post-forward until the all-gather that consumes it."""

    def __init__(self, layout: Dim0Layout, group: dist.ProcessGroup) -> None:
        slots = layout.slots
        self.layout = make_dim0_layout(
            [s.fqn for s in slots],
            [s.shape for s in slots],
            [s.requires_grad for s in slots],
            dist.get_world_size(group),
        )
        self.group = group
        self.rank = dist.get_rank(group)
        self.shard: torch.Tensor | None = None
        self._receiver: Dim0Unsharded | None = None
        """``params`` seen through this group's layout (made at the first gather)."""

    def keep(self, params: Dim0Unsharded) -> None:
        """At post-forward, before ``params`` are freed: copy this rank's chunk of each."""
        first = params.tensors[0]
        shard = torch.zeros(self.layout.shard_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for piece in self.layout.shard_pieces(self.rank):
                if piece is not None:
                    source = params.tensors[piece.slot_index].view(-1)
                    target = shard[piece.shard_start : piece.shard_start + piece.numel]
                    target.copy_(source[piece.param_start : piece.param_start + piece.numel])
        self.shard = shard

    def drop(self) -> None:
        self.shard = None

    def gather(self, params: Dim0Unsharded, label: str) -> tuple[comm.Pending, Callable[[], None]]:
        """All-gather ``shard`` over the group into ``params``; returns the collective and
        what to run once it is done (fill the parameters, unless the transport did; free)."""
        shard = self.shard
        assert shard is not None
        receiver = self._receiver
        if receiver is None or receiver.tensors is not params.tensors:
            receiver = Dim0Unsharded(
                self.layout, shard.dtype, shard.device, params.dims, params.tensors
            )
            self._receiver = receiver
        gathered = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=shard.device)
        params.allocate()
        if receiver.sinkable and comm.gathers_into_sink(self.group, shard):
            _free(gathered)  # sizes only: the transport writes the parameters
            work = comm.all_gather_into(gathered, shard, self.group, label, receiver)
            return work, self.drop

        def finish() -> None:
            receiver.fill(gathered)
            _free(gathered)
            self.drop()

        return comm.all_gather_into(gathered, shard, self.group, label), finish
