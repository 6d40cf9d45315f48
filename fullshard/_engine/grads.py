"""Gradient reduction of a unit's flat parameter: reduce-scatter (or all-reduce) of the
unsharded gradient, its accumulation into the sharded ``.grad``, and optimizers stepped in
backward. A part of ``FlatParamHandle`` (see ``flat_param``), which supplies the storage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._comm import collectives as comm
from .._comm import custom
from .._comm.groups import ShardingGroups, gradient_divide_factors
from .._comm.pieces import Places
from .dtensor_params import DTensorParams
from .flat_segment import FlatParameter, FlatSegment
from .left_grads import LeftGrads
from .storage_pool import POOL

__all__: list[str] = []


@dataclass
class _PendingReduction:
    """A gradient reduction in flight; holds its buffers alive until it completes."""

    work: comm.Pending
    reduced_grad: torch.Tensor
    """Receives the result: this rank's shard (sharded) or the whole gradient (NO_SHARD)."""
    unsharded_grad: torch.Tensor
    """The input, which must not be freed while the collective reads it."""
    postdivide: float
    """What the reduced gradient is divided by once the reduction is done."""
    computed_dtype: torch.dtype
    """The dtype autograd computed the unsharded gradient in (the forward's parameter dtype):
    what ``keep_low_precision_grads`` keeps, as torch does."""
    received: list[bool] | None = None
    """FSDP2: per slot of the trainable segment, whether this rank's backward gave it a
    gradient (see [Note: parameters without a gradient])."""
    recycle_input: bool = False
    """``unsharded_grad`` is the engine's alone (taken off the leaf, or a padded or cast
    copy of it): once the reduction is done its memory goes to the next unit-sized buffer
    (see [Note: reusing unsharded memory])."""
    keeps_dtype: bool = False
    """A low-precision communication hook reduced it: the hook has cast the result back to
    its state's ``parameter_type``, which the gradient keeps, as in torch."""


# [Note: communication hooks]
# FSDP1's ``register_comm_hook(state, hook)`` replaces a unit's gradient reduction with the
# user's: ``hook(state, grad)`` reduces the whole gradient in place (NO_SHARD),
# ``hook(state, padded_grad, output)`` reduce-scatters it into ``output``, this rank's shard
# (sharded strategies), as torch's ``default_hooks`` do with ``dist`` collectives of their
# own, called synchronously in the post-backward. The hook divides (torch's
# ``DefaultState`` holds the factors), so the engine does not. The gradient reaches the hook
# in ``reduce_dtype``, except for torch's low-precision hooks (``fp16_compress_hook``,
# ``bf16_compress_hook``), which get it as computed, cast it themselves and cast the result
# to their state's ``parameter_type``, which the gradient then keeps (torch's rule). The
# result is accumulated into ``.grad`` like the engine's own, and the shared-memory
# transport is drained first, since the hook blocks in collectives fullshard does not see
# ([Note: draining] in ``collectives.py``).


def is_low_precision_hook(hook: Callable[..., None]) -> bool:
    """torch's ``fp16_compress_hook`` or ``bf16_compress_hook`` (its LOW_PRECISION_HOOKS)."""
    from torch.distributed.algorithms._comm_hooks import LOW_PRECISION_HOOKS

    return hook in LOW_PRECISION_HOOKS


def _owns_its_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is its storage's only view (no offset, every byte its own)."""
    nbytes = tensor.numel() * tensor.element_size()
    return tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == nbytes


# [Note: parameters without a gradient]
# A parameter a backward gives no gradient (a module the forward skipped: an unused pooler,
# an expert no token was routed to) gets no new ``.grad`` from torch's FSDP2: it leaves
# ``.grad`` as it was (None after zero_grad(set_to_none=True)), so the optimizer skips it
# (no weight decay, no moment update), unless `set_reduce_scatter_unused_params(True)` asks
# for zeros. torch reduce-scatters only the gradients its rank has, so ranks that disagree
# on which parameters got one mismatch the collective (a hang, or garbage).
# fullshard reduce-scatters a unit's whole flat gradient (zeros where a parameter got none),
# of torch's size, so ranks never disagree on the collective, and keeps torch's rule: a
# parameter this rank's backward gave no gradient keeps its `.grad`, unless its reduced
# piece here is not all zeros (another rank's backward did give it one: torch's result with
# the flag, rather than its hang, and never a piece of the parameter left unstepped on some
# ranks only). The check costs a device-to-host copy, only on a rank whose backward missed
# a trainable parameter.


def assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set ``param.grad``, also to a gradient of another dtype (``keep_low_precision_grads``)
    or size (the unsharded gradient of a sharded parameter inside ``no_sync()``).

    The ``.grad`` setter refuses a dtype, size or device that differs from the parameter's,
    so such a gradient is installed through ``.data`` of a placeholder, as torch's FSDP does.
    """
    if grad is None or (grad.dtype, grad.shape, grad.device) == (
        param.dtype,
        param.shape,
        param.device,
    ):
        param.grad = grad
        return
    param.grad = torch.empty((), dtype=param.dtype, device=param.device).expand(param.shape)
    param.grad.data = grad


class GradReduction:
    """``FlatParamHandle``'s gradient verbs."""

    if TYPE_CHECKING:  # supplied by FlatParamHandle
        label: str
        groups: ShardingGroups
        uses_sharded_strategy: bool
        flat_param: FlatParameter
        _segments: tuple[FlatSegment, ...]
        _orig_params: list[nn.Parameter]
        gradient_divide_factor: float | None
        _use_orig_params: bool
        _orig_param_dtype: torch.dtype
        _fwd_bwd_param_dtype: torch.dtype
        _reduce_dtype: torch.dtype
        _keep_low_precision_grads: bool
        _has_optim_in_backward: bool
        _pending_reduction: _PendingReduction | None
        all_reduce_replicas: bool
        _partial_replica_grad: torch.Tensor | None
        force_sum_reduction: bool
        all_reduce_hook: Callable[[torch.Tensor], None] | None
        all_reduce_hook_stream: Any
        custom_reduce_scatter: Any
        comm_hook: tuple[Any, Callable[..., None]] | None
        reduce_unused_params: bool
        _dtensor_params: DTensorParams | None
        _post_backward_hook: Callable[[], None] | None

        @property
        def _shard_device(self) -> torch.device: ...
        @property
        def flat_params(self) -> list[FlatParameter]: ...
        def sync_orig_grads(self) -> None: ...
        def adopt_exposed_grad(self) -> None: ...
        def drop_exposed_grad(self) -> None: ...
        def _use_sharded_grad_views(self, unused: set[int] | None = None) -> None: ...
        def run_post_accumulate_grad_hooks(self) -> None: ...

    def _init_reduction_state(self) -> None:
        """The reduction's own state (called from ``FlatParamHandle.__init__``)."""
        self._pending_reduction = None
        self.all_reduce_replicas = True
        """HSDP: all-reduce each reduced gradient across replicas. False (FSDP2's
        ``set_requires_all_reduce``) sums them in ``_partial_replica_grad`` instead, out of
        ``.grad`` as in torch, until a reduction with True all-reduces the sum once."""
        self._partial_replica_grad = None
        self.force_sum_reduction = False
        """FSDP2's ``set_force_sum_reduction_for_comms``: full- and bf16-precision gradients
        are summed, then divided (instead of divided, then summed), as torch does then."""
        self.all_reduce_hook = None
        """FSDP2's ``set_all_reduce_hook``: called on each reduced gradient shard."""
        self.all_reduce_hook_stream = None
        self.custom_reduce_scatter = None
        """FSDP2's ``set_custom_reduce_scatter``: the comm that replaces the transport's."""
        self.comm_hook = None
        """FSDP1's ``register_comm_hook``: ``(state, hook)``; see [Note: communication
        hooks]."""
        self.reduce_unused_params = False
        """FSDP2's ``set_reduce_scatter_unused_params``: see [Note: parameters without a
        gradient]."""

    def register_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` each time autograd has accumulated this unit's unsharded gradient."""
        assert self._post_backward_hook is None, "the post-backward hook is registered once"
        self._post_backward_hook = hook
        self._segments[0].set_post_backward_hook(hook)

    def has_unsharded_grad(self) -> bool:
        return any(
            u.leaf.grad is not None or u.accumulated_grad is not None
            for u in self._segments[0].buffers()
        )

    def accumulate_unsharded_grad(self) -> None:
        """After a backward that does not reduce (FSDP2's ``set_requires_gradient_sync(False)``):
        with a ``reduce_dtype`` wider than the gradient's, add the gradient to a sum kept in
        ``reduce_dtype``, as torch's FSDP2 does (a sum of bf16 micro-batch gradients kept in
        bf16 loses their low bits). Otherwise it stays on the leaf, where autograd adds the
        next one."""
        for unsharded in self._segments[0].buffers():
            unsharded.left.materialize()  # autograd adds the next backward's to it
        if self._dtensor_params is None:
            return  # FSDP1's no_sync accumulates in the compute dtype, as torch's FSDP1
        for unsharded in self._segments[0].buffers():
            grad = unsharded.leaf.grad
            if grad is None or self._reduce_dtype.itemsize <= grad.dtype.itemsize:
                continue
            unsharded.leaf.grad = None
            if unsharded.accumulated_grad is None:
                unsharded.accumulated_grad = grad.to(self._reduce_dtype)
            else:
                unsharded.accumulated_grad.add_(grad)

    def reduce_grad(self) -> None:
        """Issue the reduction of the unsharded gradient (async); frees it once done."""
        self.adopt_exposed_grad()  # see [Note: gradients accumulated under no_sync]
        for unsharded in self._segments[0].buffers():
            grad, unsharded.leaf.grad = unsharded.leaf.grad, None
            accumulated, unsharded.accumulated_grad = unsharded.accumulated_grad, None
            if accumulated is not None:
                if grad is not None:
                    unsharded.left.take(grad, reads_places=False)  # written: added below
                grad = accumulated if grad is None else accumulated.add_(grad)
            if grad is None:
                continue
            received = None
            if unsharded.params is not None:
                received = unsharded.params.grads_received
                unsharded.params.grads_received = [False] * len(received)
            self._reduce_grad_of(grad, received, unsharded.left)

    def _reduce_grad_of(
        self, grad: torch.Tensor, received: list[bool] | None, left: LeftGrads
    ) -> None:
        """Issue the reduction of ``grad``, an unsharded gradient (the leaf's, taken off it);
        ``left`` holds the gradients backward may have left where autograd put them instead
        of writing them into ``grad`` (see [Note: gradients reduced where autograd left them]
        in left_grads.py)."""
        if self._pending_reduction is not None:  # a second backward before the first finished
            self.finalize_grad()
        left.reads_places = self._reduces_from_places(grad, left)
        places = left.take(grad, left.reads_places)
        if self.comm_hook is not None:
            self._pending_reduction = self._reduce_with_hook(grad, *self.comm_hook)
            return
        # A unit unsharded in full precision (eval) reduces in full precision too.
        computed_dtype = grad.dtype
        ran_in_param_dtype = grad.dtype == self._fwd_bwd_param_dtype
        reduce_dtype = self._reduce_dtype if ran_in_param_dtype else grad.dtype
        predivide, postdivide = self._divide_factors(reduce_dtype)
        grad = grad.to(reduce_dtype)
        if not self.uses_sharded_strategy:
            if predivide > 1:
                grad = grad.div_(predivide)
            work: comm.Pending = comm.all_reduce(grad, self.groups.shard, self.label)
            self._pending_reduction = _PendingReduction(
                work, grad, grad, postdivide, computed_dtype
            )
            return
        work, sharded, grad = self._reduce_scatter(grad, places, predivide)
        self._pending_reduction = _PendingReduction(
            work,
            sharded,
            grad,
            postdivide,
            computed_dtype,
            received,
            recycle_input=self.custom_reduce_scatter is None and places is None,
        )

    def _reduce_scatter(
        self, grad: torch.Tensor, places: Places | None, predivide: float
    ) -> tuple[comm.Pending, torch.Tensor, torch.Tensor]:
        """Issue the reduce-scatter of the flat gradient ``grad`` (or of ``places``, where
        its elements lie: ``grad`` is unwritten); returns it, the sharded gradient it
        writes, and its input, which must outlive it."""
        layout = self._segments[0].layout
        if places is not None:  # sizes only, with the padding
            full = grad.new_empty(1).expand(layout.padded_numel)
            sharded = grad.new_empty(layout.shard_numel)
            work = comm.reduce_scatter_into(
                sharded, full, self.groups.shard, self.label, predivide=predivide, places=places
            )
            return work, sharded, full
        padding = layout.padded_numel - grad.numel()  # the flat layout's leaf stops at numel
        if padding:
            grad = torch.nn.functional.pad(grad, (0, padding))
        if self.custom_reduce_scatter is not None:
            custom_comm = self.custom_reduce_scatter
            full = custom_comm.allocate(grad.shape, dtype=grad.dtype, device=grad.device)
            full.copy_(grad)
            sharded = custom_comm.allocate(
                (layout.shard_numel,), dtype=grad.dtype, device=grad.device
            )
            work = custom.reduce_scatter(
                custom_comm, sharded, full, self.groups.shard, self.label, predivide
            )
            return work, sharded, full
        sharded = grad.new_empty(layout.shard_numel)
        work = comm.reduce_scatter_into(
            sharded, grad, self.groups.shard, self.label, predivide=predivide
        )
        return work, sharded, grad

    def _reduces_from_places(self, grad: torch.Tensor, left: LeftGrads) -> bool:
        """Whether this unit's reduce-scatter of ``grad`` can read the parameters' gradients
        where autograd left them: over the shared-memory transport, uncast, undivided by
        a hook of the user's, in a layout that allows it."""
        return (
            self.comm_hook is None
            and self.custom_reduce_scatter is None
            and self.uses_sharded_strategy
            and left.able
            and grad.dtype == self._reduce_dtype
            and comm.reduces_from_places(self.groups.shard, grad)
        )

    def _reduce_with_hook(
        self, grad: torch.Tensor, state: Any, hook: Callable[..., None]
    ) -> _PendingReduction:
        """Reduce ``grad`` with a communication hook (see [Note: communication hooks]):
        ``hook(state, grad)`` in place under NO_SHARD, else ``hook(state, padded_grad,
        shard)``; the hook divides, so nothing is divided here."""
        computed_dtype = grad.dtype
        low_precision = is_low_precision_hook(hook)
        if not low_precision and grad.dtype == self._fwd_bwd_param_dtype:
            grad = grad.to(self._reduce_dtype)
        comm.drain_transports()  # the hook blocks in collectives of its own
        kind = "reduce_scatter" if self.uses_sharded_strategy else "all_reduce"
        if not self.uses_sharded_strategy:
            hook(state, grad)
            reduced = grad
        else:
            layout = self._segments[0].layout
            padding = layout.padded_numel - grad.numel()
            if padding:
                grad = torch.nn.functional.pad(grad, (0, padding))
            reduced = grad.new_empty(layout.shard_numel)
            hook(state, grad, reduced)  # a low-precision hook replaces ``reduced.data``
        return _PendingReduction(
            comm.completed(kind, self.label, self.groups.shard),
            reduced,
            grad,
            1.0,
            computed_dtype,
            keeps_dtype=low_precision,
        )

    def _divide_factors(self, reduce_dtype: torch.dtype) -> tuple[float, float]:
        """How much of the 1/N of averaging to divide by before the sum, and how much after."""
        num_dp_ranks = self.gradient_divide_factor or self.groups.num_data_parallel_ranks
        if self.force_sum_reduction and reduce_dtype in (torch.float32, torch.bfloat16):
            return 1.0, float(num_dp_ranks)  # torch's, with force_sum_reduction_for_comms
        if reduce_dtype.itemsize >= 4:
            # Full precision cannot overflow: divide before the sum, exactly as DDP does.
            return float(num_dp_ranks), 1.0
        return gradient_divide_factors(num_dp_ranks)

    def discard_unreduced_grads(self) -> None:
        """Drop what a failed step left between autograd and ``.grad``: the unsharded
        gradients, a reduction in flight (waited for: its buffers must outlive it) and
        HSDP's sum not yet all-reduced. ``.grad`` keeps what earlier steps put there."""
        self.drop_exposed_grad()
        pending, self._pending_reduction = self._pending_reduction, None
        if pending is not None:
            pending.work.wait()
        self._partial_replica_grad = None
        for unsharded in self._segments[0].buffers():
            unsharded.leaf.grad = None
            unsharded.accumulated_grad = None
            unsharded.left.drop()

    def finalize_grad(self) -> None:
        """Wait for the reduction and accumulate it into the sharded gradient.

        The result is cast to the parameters' dtype (with ``keep_low_precision_grads``, to
        the dtype the forward computed in, ``param_dtype``, as torch does even when
        ``reduce_dtype`` differs) and moved to the shard's device (the CPU with offload).
        """
        pending = self._pending_reduction
        if pending is None:
            return
        self._pending_reduction = None
        pending.work.wait()
        if pending.recycle_input and _owns_its_storage(pending.unsharded_grad):
            POOL.free(pending.unsharded_grad.untyped_storage())
        reduced = pending.reduced_grad
        if self.groups.replicate is not None:
            if self._partial_replica_grad is not None:
                reduced.add_(self._partial_replica_grad)
                self._partial_replica_grad = None
            if not self.all_reduce_replicas:
                self._partial_replica_grad = reduced
                return
            comm.all_reduce(reduced, self.groups.replicate, self.label).wait()
        if self.all_reduce_hook is not None:
            custom.run_all_reduce_hook(self.all_reduce_hook, reduced, self.all_reduce_hook_stream)
        if pending.postdivide > 1:
            reduced.div_(pending.postdivide)
        dtype = pending.computed_dtype if self._keep_low_precision_grads else self._orig_param_dtype
        if pending.keeps_dtype:
            dtype = reduced.dtype
        reduced = reduced.to(device=self._shard_device, dtype=dtype)
        self.sync_orig_grads()
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            assign_grad(self.flat_param, reduced)
        else:
            flat_grad.add_(reduced)
        if self._use_orig_params:
            self._use_sharded_grad_views(self._unused_everywhere(pending))
        if self._dtensor_params is not None:
            self.run_post_accumulate_grad_hooks()
        if self._has_optim_in_backward:
            self._step_optimizers_in_backward()

    def _unused_everywhere(self, pending: _PendingReduction) -> set[int]:
        """The parameters (indices) this rank's backward gave no gradient to and whose
        reduced piece here is all zeros (see [Note: parameters without a gradient]); none
        with ``reduce_unused_params``."""
        received = pending.received
        if received is None or self.reduce_unused_params:
            return set()
        segment = self._segments[0]
        missing = [
            (index, piece)
            for index, got, piece in zip(
                segment.indices, received, segment.sharded_piece_views(pending.reduced_grad)
            )
            if not got and self._orig_params[index].requires_grad
        ]
        if not missing:
            return set()
        nonzero = torch.stack([piece.any() for _, piece in missing]).tolist()
        return {index for (index, _), used in zip(missing, nonzero) if not used}

    def init_optimizers_in_backward(self) -> None:
        """At lazy initialisation: find optimizers applied in backward (see the note)."""
        if any(hasattr(flat, "_in_backward_optimizers") for flat in self.flat_params):
            raise RuntimeError(
                "FSDP optimizer in backward only supported with use_orig_params=True! "
                f"_apply_optimizer_in_backward was given the flat parameter of FSDP unit "
                f"'{self.label}'; construct every unit with use_orig_params=True and apply it to "
                "model.parameters()"
            )
        self._has_optim_in_backward = self._use_orig_params and any(
            hasattr(param, "_in_backward_optimizers") for param in self._orig_params
        )

    def _step_optimizers_in_backward(self) -> None:
        for param in self._orig_params:
            if param.grad is None:  # frozen, or no piece of it on this rank
                continue
            for optim in getattr(param, "_in_backward_optimizers", ()):
                optim.step()
                optim.zero_grad(set_to_none=True)
        self.flat_param.grad = None
        for param in self._orig_params:
            param.grad = None
