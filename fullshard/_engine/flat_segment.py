"""One flat segment of an FSDP unit: a ``FlatParameter`` (the shard) and its unsharded buffers.

A unit's parameters live in one segment, or in two when they differ in ``requires_grad``
(see [Note: frozen parameters] in flat_param.py and ``layout.UnitLayout``). Each segment
owns three buffers:

- ``flat_param._local_shard``: this rank's shard in the parameters' own dtype (the optimizer's
  master copy), the storage ``flat_param`` always points at. With
  ``CPUOffload(offload_params=True)`` it lives on the CPU.
- ``flat_param._full_param_padded``: the padded unsharded buffer the all-gather writes into,
  on the compute device, in the compute dtype. Its storage is freed (resized to 0) whenever
  the unit is resharded.
- the leaf: a separate autograd leaf over the first ``leaf_numel`` elements of that storage. During
  compute, modules see views of it; autograd accumulates the unsharded gradient into its
  ``.grad`` (trainable segments only). With NO_SHARD, in the shard's dtype and on its device,
  the leaf aliases the shard itself.

A segment has no state machine of its own: the handle's verbs (``unshard``, ``reshard``...)
assert the unit's state and drive every segment of the unit through the same steps.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import _foreach_supported_types
from torch.utils.hooks import RemovableHandle

from .._comm import collectives as comm
from .._comm import custom
from .._comm.groups import ShardingGroups
from .compile import eager
from .dim0_unsharded import Dim0Unsharded, PostForwardShard
from .layout import Dim0Layout, FlatLayout, ShardPiece
from .left_grads import FlatLeftGrads, LeftGrads
from .names import FSDP_FLATTENED
from .piece_views import PieceViews
from .storage_pool import POOL

__all__ = ["FlatParameter", "FlatSegment"]


class FlatParameter(nn.Parameter):
    """The flattened, sharded parameters of one flat segment of an FSDP unit.

    Its data is always this rank's shard (``_local_shard``); it is what the optimizer sees
    with ``use_orig_params=False``. Its ``.grad`` is the sharded, averaged gradient.
    """

    _local_shard: torch.Tensor
    _full_param_padded: torch.Tensor
    """The unsharded buffer in the compute dtype (see ``FlatSegment``)."""
    _full_prec_full_param_padded: torch.Tensor | None
    """With mixed precision, the unsharded buffer in the original dtype (summon, eval)."""

    @classmethod
    def from_shard(
        cls, local_shard: torch.Tensor, full_param_padded: torch.Tensor, requires_grad: bool
    ) -> FlatParameter:
        flat_param = cls(local_shard, requires_grad=requires_grad)
        flat_param._local_shard = local_shard
        flat_param._full_param_padded = full_param_padded
        flat_param._full_prec_full_param_padded = None
        return flat_param

    def describe(self, layout: FlatLayout) -> None:
        """torch's metadata that stacks read from a FlatParameter: the names (relative to
        the wrapped module), shapes and sizes of the parameters it flattens, and the
        ``_fsdp_flattened`` mark (see [Note: the marks torch leaves on managed modules and
        flat parameters] in names.py). accelerate logs ``_fqns`` when it upcasts a unit."""
        self._fqns = [slot.fqn for slot in layout.slots]
        self._shapes = [slot.shape for slot in layout.slots]
        self._numels = tuple(slot.numel for slot in layout.slots)
        setattr(self, FSDP_FLATTENED, True)


# torch's optimizers take their ``foreach`` step (a few kernels per step on CUDA, not a few per
# tensor) only for the tensor types they list; torch's own FSDP1 flat parameters are plain
# ``nn.Parameter`` objects, so they get it, and DTensor lists itself. This class is listed
# too, so ``FullyShardedDataParallel``'s flat parameters step as torch's do.
if FlatParameter not in _foreach_supported_types:
    _foreach_supported_types.append(FlatParameter)


@dataclass
class Unsharded:
    """An unsharded buffer and the autograd leaf over it (see [Note: a separate unsharded leaf]
    in flat_param.py)."""

    padded: torch.Tensor
    """What the all-gather writes into; its storage is freed while the unit is sharded."""
    leaf: torch.Tensor
    """The first ``numel`` elements of ``padded`` (or of the shard itself, when aliased)."""
    aliases_shard: bool
    """NO_SHARD with no cast and no offload: the leaf is the shard, nothing is copied."""
    hook: RemovableHandle | None
    left: LeftGrads
    """The gradients backward may leave where autograd put them (see [Note: gradients
    reduced where autograd left them] in left_grads.py)."""
    params: Dim0Unsharded | None = None
    """Dim-0 layouts (``fully_shard``): the parameters' own unsharded tensors, filled from
    ``padded``, which is freed once they are (see ``dim0_unsharded``)."""
    params_gathered: bool = False
    """The last all-gather wrote ``params`` directly (shared-memory transport): ``padded``
    was never allocated."""
    accumulated_grad: torch.Tensor | None = None
    """FSDP2, gradients accumulated without reduction (``set_requires_gradient_sync(False)``)
    where ``reduce_dtype`` is wider than the compute dtype: their sum in ``reduce_dtype``
    (torch's ``unsharded_accumulated_grad``), taken off the leaf after each backward."""


class _SplitLeaf(torch.autograd.Function):
    """leaf (a flat layout's unsharded buffer, exactly its parameters) -> its parameters'
    pieces, views of it as ``torch.split`` gives; backward writes their gradients into one
    flat gradient drawn from the pool (see [Note: reusing unsharded memory]), where
    ``split``'s backward concatenates them into fresh memory each time, or returns it
    unwritten where the reduce-scatter reads them where they are ([Note: gradients reduced
    where autograd left them] in left_grads.py)."""

    @staticmethod
    def forward(
        ctx: Any, leaf: torch.Tensor, left: LeftGrads, numels: list[int]
    ) -> tuple[torch.Tensor, ...]:
        ctx.left, ctx.leaf, ctx.numels = left, leaf, numels
        ctx.set_materialize_grads(False)  # a parameter that got no gradient arrives as None
        return tuple(leaf.split(numels))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor, None, None]:
        if torch.is_grad_enabled():  # create_graph: a backward that is itself differentiable
            given = next(g for g in grads if g is not None)  # autograd calls with at least one
            return (
                torch.cat(
                    [given.new_zeros(n) if g is None else g for g, n in zip(grads, ctx.numels)]
                ),
                None,
                None,
            )
        return ctx.left.flat_grad(grads, ctx.leaf), None, None


def _post_forward_shard(
    layout: FlatLayout,
    group: dist.ProcessGroup | None,
    shard_dims: list[int] | None,
    from_extensions: bool,
) -> PostForwardShard | None:
    """What keeps a dim-0 segment's parameters over ``group``'s ``k`` ranks between forward
    and backward (None: nothing, or extensions that gather on their own)."""
    if group is None or not isinstance(layout, Dim0Layout) or from_extensions:
        return None
    if any(shard_dims or ()):
        raise NotImplementedError(
            "reshard_after_forward as an int is not implemented by fullshard for "
            "parameters sharded on another dim than 0 (shard_placement_fn); use True "
            "or False, or shard them on dim 0"
        )
    return PostForwardShard(layout, group)


class FlatSegment:
    """The storage of one flat segment: its shard, its unsharded buffers, its all-gather.

    ``indices`` are the unit's parameter indices (registration order) this segment holds, in
    its slot order; ``layout`` places them. ``device`` is the compute device; with
    ``offload_params`` the shard lives on the CPU instead.
    """

    def __init__(
        self,
        layout: FlatLayout,
        indices: list[int],
        params: list[torch.Tensor],
        groups: ShardingGroups,
        uses_sharded_strategy: bool,
        device: torch.device,
        offload_params: bool,
        compute_dtype: torch.dtype,
        shard_dims: list[int] | None = None,
        post_forward_group: dist.ProcessGroup | None = None,
        unsharded_shapes: list[torch.Size] | None = None,
        from_extensions: bool = False,
    ) -> None:
        assert len(params) == len(indices) == len(layout.slots)
        self.from_extensions = from_extensions
        """Every parameter's unsharded tensor comes from its all-gather extension: the flat
        shard holds no values (one zero, expanded), so it is not all-gathered (see [Note:
        all-gather extensions])."""
        self._shard_dims = shard_dims
        """Dim-0 layouts: per slot, the dim its parameter is sharded on (the layout holds it
        moved to dim 0; see [Note: sharding on another dim] in dtensor_params.py)."""
        self._unsharded_shapes = unsharded_shapes
        """Dim-0 layouts: per slot, its parameter's unsharded shape (None: the slot's)."""
        self._post_forward = _post_forward_shard(
            layout, post_forward_group, shard_dims, from_extensions
        )
        """``reshard_after_forward=k``: the parameters kept over ``k`` ranks after forward."""
        self._after_gather: Callable[[], None] | None = None
        self.layout = layout
        self.indices = indices
        self.groups = groups
        self.uses_sharded_strategy = uses_sharded_strategy
        self.device = device
        self._offload_params = offload_params
        self._shard_rank = groups.shard_rank if uses_sharded_strategy else 0
        self.pieces: tuple[ShardPiece | None, ...] = layout.shard_pieces(self._shard_rank)
        """Per slot, its piece of this rank's shard (None where it has none)."""
        self._piece_views = PieceViews(layout, self.pieces, uses_sharded_strategy)
        self.requires_grad = all(slot.requires_grad for slot in layout.slots)
        """Whether the segment trains: its parameters' flag at wrapping, then whatever
        ``set_requires_grad`` adopted."""
        self.flat_param: FlatParameter = self._make_flat_param(params)
        self._post_backward_hook: Callable[[], None] | None = None
        self._compute: Unsharded = self._make_unsharded(compute_dtype)
        """Unsharded buffer and leaf in the compute dtype; its identity never changes while
        a forward's graph may refer to it."""
        self._full_prec: Unsharded | None = None
        """In the original dtype, built on first use when that differs from the compute dtype."""
        self.active: Unsharded = self._compute
        """The one unsharded (or last unsharded): what modules' views and gradients refer to."""
        self.flat_param._full_param_padded = self._compute.padded
        self.custom_all_gather: Any = None
        """FSDP2's ``set_custom_all_gather``: the comm that replaces the transport's (it
        allocates what it gathers into; the parameters are filled from that)."""
        self._unshard_work: comm.Pending | None = None
        self._unshard_input: torch.Tensor | None = None
        """The cast or copied shard an all-gather in flight reads from."""

    # -- construction -------------------------------------------------------------------

    @property
    def shard_device(self) -> torch.device:
        return torch.device("cpu") if self._offload_params else self.device

    def _make_flat_param(self, params: list[torch.Tensor]) -> FlatParameter:
        layout = self.layout
        # On the parameters' device: a CPU module stays on the CPU until the user moves it to
        # the compute device (see [Note: devices] in init.py).
        dtype, device = params[0].dtype, params[0].device
        with torch.no_grad():
            if self.uses_sharded_strategy and self.from_extensions:
                # no values: they live in the extensions' own local tensors; one zero, seen
                # wherever the shard is read (writing into it raises)
                local_shard = torch.zeros((), dtype=dtype, device=device)
                local_shard = local_shard.expand(layout.shard_numel)
            elif self.uses_sharded_strategy:  # this rank's pieces; zeros where padding
                local_shard = torch.zeros(layout.shard_numel, dtype=dtype, device=device)
                for param, piece in zip(params, self.pieces):
                    if piece is not None:
                        source = param.detach().reshape(-1)
                        local_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                            source[piece.param_start : piece.param_start + piece.numel]
                        )
            else:
                local_shard = torch.cat([p.detach().reshape(-1) for p in params])
            local_shard = self._to_shard_device(local_shard)
        full_param_padded = torch.empty(0, dtype=local_shard.dtype, device=self.device)
        flat_param = FlatParameter.from_shard(local_shard, full_param_padded, self.requires_grad)
        flat_param.describe(layout)
        return flat_param

    def _to_shard_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._offload_params or tensor.is_meta:
            return tensor  # a meta shard moves when the model is materialised (``adopt``)
        tensor = tensor.to("cpu")
        return self.pinned(tensor)

    def pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """Offloaded CPU tensors are pinned when computing on CUDA, so copies are async."""
        if self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def _make_unsharded(self, dtype: torch.dtype) -> Unsharded:
        """Build an unsharded buffer in ``dtype`` and the leaf over it, hooked for backward.

        See [Note: a separate unsharded leaf] in flat_param.py.
        """
        local_shard = self.flat_param._local_shard
        aliases_shard = (
            not self.uses_sharded_strategy
            and not self._offload_params
            and dtype == local_shard.dtype
            and local_shard.device == self.device
        )
        if aliases_shard:
            padded = local_shard.new_empty(0)
            source = local_shard
        else:
            padded = torch.empty(self.layout.padded_numel, dtype=dtype, device=self.device)
            source = padded
        leaf = torch.empty(0, dtype=dtype, device=self.device)
        # `set_` grows a storage too small for the sizes, so the storage must still be
        # allocated here; it is freed right after.
        numel = self.layout.leaf_numel
        leaf.set_(source.untyped_storage(), source.storage_offset(), (numel,), (1,))
        if not aliases_shard:
            padded.untyped_storage().resize_(0)
        leaf.requires_grad_(self.requires_grad)
        params = None
        if isinstance(self.layout, Dim0Layout):
            params = Dim0Unsharded(
                self.layout, dtype, self.device, self._shard_dims, shapes=self._unsharded_shapes
            )
        left = params if params is not None else FlatLeftGrads(self.layout.numels)
        unsharded = Unsharded(padded, leaf, aliases_shard, None, left, params)
        self._hook_leaf(unsharded)
        return unsharded

    def _hook_leaf(self, unsharded: Unsharded) -> None:
        """Register the post-backward hook on a leaf that requires grad and has none yet."""
        hook = self._post_backward_hook
        if hook is not None and unsharded.leaf.requires_grad and unsharded.hook is None:
            unsharded.hook = unsharded.leaf.register_post_accumulate_grad_hook(
                _weak_post_backward_hook(hook, list(self.flat_param._fqns))
            )

    def buffers(self) -> list[Unsharded]:
        """The unsharded buffers built so far (compute dtype, then full precision)."""
        if self._full_prec is None or self._full_prec is self._compute:
            return [self._compute]
        return [self._compute, self._full_prec]

    def unsharded_for(self, dtype: torch.dtype) -> Unsharded:
        """The unsharded buffer in ``dtype``: the compute one, else the full-precision one."""
        if dtype == self._compute.leaf.dtype:
            return self._compute
        if self._full_prec is None:
            self._full_prec = self._make_unsharded(dtype)
            self.flat_param._full_prec_full_param_padded = self._full_prec.padded
        return self._full_prec

    def set_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` each time autograd has accumulated a trainable leaf's gradient."""
        self._post_backward_hook = hook
        for unsharded in self.buffers():
            self._hook_leaf(unsharded)

    def set_requires_grad(self, requires_grad: bool) -> None:
        """Train (or freeze) the whole segment from the next forward on: its flat parameter
        and leaves follow, and a leaf that starts to require grad gets the post-backward
        hook (see [Note: requires_grad changed after wrapping] in flat_param.py)."""
        self.requires_grad = requires_grad
        self.flat_param.requires_grad_(requires_grad)
        for unsharded in self.buffers():
            unsharded.leaf.requires_grad_(requires_grad)
            self._hook_leaf(unsharded)

    def check_adoptable(self, converted: torch.Tensor, label: str) -> None:
        """The flat parameter keeps its identity (optimizers hold it), so a conversion must
        give a tensor it can take in place (``.data``), which e.g. CPU <-> meta cannot; a
        shard still on the meta device (``fully_shard`` on a meta model, then ``to_empty``)
        is swapped instead (``adopt``)."""
        if not self.flat_param.is_meta and not torch._has_compatible_shallow_copy_type(
            self.flat_param, converted
        ):
            raise RuntimeError(
                f"cannot convert FSDP unit '{label}' from {self.flat_param.device} to "
                f"{converted.device}: its flat parameter cannot take a tensor of that type in "
                "place. Move or cast the module before wrapping it in FSDP instead"
            )

    def adopt(self, local_shard: torch.Tensor, compute_dtype: torch.dtype) -> None:
        """Make ``local_shard`` (converted by ``module.half()``, ``.to()``...) the shard, and
        rebuild the unsharded buffers and leaves for it in ``compute_dtype``."""
        if self._offload_params:
            local_shard = self.pinned(local_shard)
        # The one place the flat parameter changes storage: a conversion of the whole module.
        if torch._has_compatible_shallow_copy_type(self.flat_param, local_shard):
            self.flat_param.data = local_shard
        else:  # materialised from meta: same object (its holders keep it), new tensor
            requires_grad = self.flat_param.requires_grad
            new = FlatParameter(local_shard, requires_grad=requires_grad)
            torch.utils.swap_tensors(self.flat_param, new)  # attributes too: describe again
            self.flat_param.describe(self.layout)
        self.flat_param._local_shard = local_shard
        for unsharded in self.buffers():
            if unsharded.hook is not None:
                unsharded.hook.remove()
        self._compute = self.active = self._make_unsharded(compute_dtype)
        self._full_prec = None
        self.flat_param._full_param_padded = self._compute.padded
        self.flat_param._full_prec_full_param_padded = None

    # -- unshard and reshard (driven by the handle's verbs) ---------------------------------

    def unshard(self, dtype: torch.dtype, label: str) -> bool:
        """Fill the unsharded buffer in ``dtype``; True if an all-gather is now in flight.

        The shard is cast to ``dtype`` and moved to the compute device first, so the
        collective carries that dtype's bytes.
        """
        self.active = unsharded = self.unsharded_for(dtype)
        if unsharded.aliases_shard:
            self._copy_out()
            return False
        if self.from_extensions and unsharded.params is not None:
            unsharded.params_gathered = True  # nothing to gather: the extensions deliver
            return False
        post_forward = self._post_forward
        if post_forward is not None and post_forward.shard is not None:
            if post_forward.shard.dtype == dtype and unsharded.params is not None:
                unsharded.params_gathered = True  # over the smaller group, into the parameters
                work, self._after_gather = post_forward.gather(unsharded.params, label)
                self._unshard_work = work
                return True
            post_forward.drop()
        if self.custom_all_gather is not None and unsharded.params is not None:
            return self._custom_unshard(unsharded.params, dtype, label)
        padded = unsharded.padded
        receiver = None
        params = unsharded.params
        if (
            params is not None
            and self.uses_sharded_strategy
            and params.sinkable
            and comm.gathers_into_sink(self.groups.shard, padded)
        ):
            params.allocate()  # each peer's rows copied or received straight in
            receiver = params
        if receiver is None:  # see [Note: reusing unsharded memory]
            POOL.fill(padded.untyped_storage(), padded.numel() * padded.element_size())
        unsharded.params_gathered = receiver is not None
        local_shard = self.flat_param._local_shard
        source = local_shard
        if self._offload_params or local_shard.dtype != dtype:
            source = torch.empty(local_shard.numel(), dtype=dtype, device=self.device)
            source.copy_(local_shard, non_blocking=True)
        if not self.uses_sharded_strategy:
            padded.copy_(source)
            self._copy_out()
            return False
        self._unshard_input = source
        self._unshard_work = comm.all_gather_into(
            padded, source, self.groups.shard, label, receiver
        )
        return True

    def _custom_unshard(self, params: Dim0Unsharded, dtype: torch.dtype, label: str) -> bool:
        """The all-gather through the user's comm, into the buffer it allocates; the
        parameters are filled from it once it is done."""
        comm_ = self.custom_all_gather
        local_shard = self.flat_param._local_shard
        source = comm_.allocate((local_shard.numel(),), dtype=dtype, device=self.device)
        source.copy_(local_shard)
        gathered = comm_.allocate((self.layout.padded_numel,), dtype=dtype, device=self.device)
        self.active.params_gathered = True

        def fill() -> None:
            params.fill(gathered)

        self._unshard_input = source
        self._after_gather = fill
        self._unshard_work = custom.all_gather(comm_, gathered, source, self.groups.shard, label)
        return True

    def wait_unshard(self) -> None:
        if self._unshard_work is not None:
            self._unshard_work.wait()
            self._unshard_work = None
            self._unshard_input = None
            if self._after_gather is not None:
                self._after_gather()
                self._after_gather = None
            self._copy_out()

    def _copy_out(self) -> None:
        """Dim-0 layouts: fill the parameters' own tensors from the gathered buffer, then
        free the buffer (see [Note: per-parameter unsharded storage])."""
        unsharded = self.active
        if unsharded.params is None or unsharded.params_gathered:
            return  # not dim-0, or the all-gather delivered into the parameters
        unsharded.params.fill(unsharded.leaf.detach())
        if not unsharded.aliases_shard:
            POOL.free(unsharded.padded.untyped_storage())

    def drop_post_forward(self) -> None:
        if self._post_forward is not None:
            self._post_forward.drop()

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded storage (the shard stays); ``after_forward``, with
        ``reshard_after_forward=k``, keep the parameters over ``k`` ranks first."""
        post_forward = self._post_forward
        if post_forward is not None:
            active = self.active
            if after_forward and active is self._compute and active.params is not None:
                post_forward.keep(active.params)
            else:
                post_forward.drop()
        if not self.active.aliases_shard:
            POOL.free(self.active.padded.untyped_storage())
        if self.active.params is not None:
            self.active.params.free()

    def write_back(self) -> None:
        """Copy this rank's part of the unsharded buffer into the shard (summon's writeback)."""
        if self.active.aliases_shard:
            return
        assert self.active.params is None, "dim-0 layouts free the buffer once copied out"
        start, end = self.layout.shard_range(self._shard_rank)
        with torch.no_grad():
            self.flat_param._local_shard.copy_(self.active.padded[start:end])

    def storage_size(self) -> int:
        """Bytes held by the unsharded buffers (0 when resharded)."""
        return sum(
            u.padded.untyped_storage().nbytes() + (u.params.nbytes() if u.params else 0)
            for u in self.buffers()
        )

    # -- views ------------------------------------------------------------------------------

    def leaf_views(self) -> list[torch.Tensor]:
        """Per slot, its view (in its shape) of the active leaf (dim-0 layouts: its own
        tensor, linked to the leaf by autograd)."""
        leaf = self.active.leaf
        if self.active.params is not None:
            return self.active.params.views(leaf)
        if not (leaf.requires_grad and torch.is_grad_enabled()):
            return self.views_of_flat(leaf)
        pieces = _SplitLeaf.apply(leaf, self.active.left, self.layout.numels)
        return [piece.view(slot.shape) for piece, slot in zip(pieces, self.layout.slots)]

    def views_of_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per slot, its view (in its shape) of an unsharded flat tensor of this segment."""
        return self.layout.unsharded_views(flat)

    def sharded_piece_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per slot, its piece of the shard-shaped ``flat`` (empty if it has none), detached."""
        return self._piece_views.views(flat)

    def piece_places(self) -> list[tuple[int, torch.Size] | None]:
        """Per slot, the address and shape of its view in
        ``sharded_piece_views(self.flat_param)``, without making the views."""
        return self._piece_views.places(self.flat_param)

    def load_piece(self, slot_index: int, value: torch.Tensor) -> None:
        """Copy this rank's piece of slot ``slot_index``'s full ``value`` into the shard."""
        piece = self.pieces[slot_index]
        if piece is None:
            return
        source = value.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
        with torch.no_grad():
            self.flat_param._local_shard[piece.shard_start : piece.shard_start + piece.numel].copy_(
                source
            )

    def gather_flat_to_first_rank(self, shard: torch.Tensor, label: str) -> torch.Tensor | None:
        """The unsharded flat form (``(padded_numel,)``) of the shard-shaped ``shard`` (this
        rank's shard of the parameters or of an optimizer state), in fresh memory on the
        shard group's first rank; the other ranks only send and get None. For ``rank0_only``
        state dicts: no rank but the first allocates a segment-sized buffer."""
        if not self.uses_sharded_strategy or self.groups.shard_size == 1:
            return shard.to(self.device, copy=True) if self.groups.shard_rank == 0 else None
        source = shard.to(self.device)
        if self.groups.shard_rank != 0:
            comm.gather_to_first_rank(None, source, self.groups.shard, label).wait()
            return None
        full = torch.empty(self.layout.padded_numel, dtype=shard.dtype, device=self.device)
        outputs = list(full.chunk(self.groups.shard_size))  # shard_numel each
        comm.gather_to_first_rank(outputs, source, self.groups.shard, label).wait()
        return full


def _weak_post_backward_hook(
    hook: Callable[[], None], fqns: list[str]
) -> Callable[[torch.Tensor], None]:
    """The leaf's hook: ``hook`` (the unit's post-backward, a bound method) called through a
    weak reference to its unit. The leaf is held from C++ (the base of the views that the
    modules compute with), where Python's cycle collector cannot see, so a strong reference
    from its hook back to the unit kept every model, its parameters and its groups alive
    for the rest of the process once its user dropped it. A backward that reaches the leaf
    after the unit was freed (the model dropped, one of its activations kept and backward
    run from it) raises: its gradients could not be reduced, and the optimizer may still
    hold the parameters."""
    assert isinstance(hook, types.MethodType), hook
    function, unit = hook.__func__, weakref.ref(hook.__self__)

    @eager
    def call(_: torch.Tensor) -> None:
        runtime = unit()
        if runtime is None:
            raise RuntimeError(
                f"fullshard: the FSDP unit of {', '.join(fqns[:3])}"
                f"{', ...' if len(fqns) > 3 else ''} was freed while autograd was computing "
                "its gradient: the model was dropped before backward() reached its "
                "parameters. Keep the model alive until backward() returns"
            )
        function(runtime)

    return call
