"""Gradient reduction of a unit's flat parameter: reduce-scatter (or all-reduce) of the
unsharded gradient, its accumulation into the sharded ``.grad``, and optimizers stepped in
backward. A part of ``FlatParamHandle`` (see ``flat_param``), which supplies the storage.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._comm import collectives as comm
from .._comm.groups import ShardingGroups, gradient_divide_factors
from .flat_segment import FlatParameter, FlatSegment

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


def assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set ``param.grad``, also to a gradient of another dtype (``keep_low_precision_grads``).

    The ``.grad`` setter refuses a dtype that differs from the parameter's, so such a gradient
    is installed through ``.data`` of a placeholder, as torch's FSDP does.
    """
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty((), dtype=param.dtype, device=grad.device).expand(param.shape)
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
        _post_backward_hook: Callable[[], None] | None

        @property
        def _shard_device(self) -> torch.device: ...
        @property
        def flat_params(self) -> list[FlatParameter]: ...
        def sync_orig_grads(self) -> None: ...
        def _use_sharded_grad_views(self) -> None: ...

    def _init_reduction_state(self) -> None:
        """The reduction's own state (called from ``FlatParamHandle.__init__``)."""
        self._pending_reduction = None
        self.all_reduce_replicas = True
        """HSDP: all-reduce each reduced gradient across replicas. False (FSDP2's
        ``set_requires_all_reduce``) sums them in ``_partial_replica_grad`` instead, out of
        ``.grad`` as in torch, until a reduction with True all-reduces the sum once."""
        self._partial_replica_grad = None

    def register_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` each time autograd has accumulated this unit's unsharded gradient."""
        assert self._post_backward_hook is None, "the post-backward hook is registered once"
        self._post_backward_hook = hook
        self._segments[0].set_post_backward_hook(hook)

    def has_unsharded_grad(self) -> bool:
        return any(u.leaf.grad is not None for u in self._segments[0].buffers())

    def reduce_grad(self) -> None:
        """Issue the reduction of the unsharded gradient (async); frees it once done."""
        for unsharded in self._segments[0].buffers():
            if unsharded.leaf.grad is not None:
                self._reduce_grad_of(unsharded.leaf)

    def _reduce_grad_of(self, leaf: torch.Tensor) -> None:
        grad = leaf.grad
        assert grad is not None
        if self._pending_reduction is not None:  # a second backward before the first finished
            self.finalize_grad()
        leaf.grad = None
        # A unit unsharded in full precision (eval) reduces in full precision too.
        computed_dtype = grad.dtype
        ran_in_param_dtype = grad.dtype == self._fwd_bwd_param_dtype
        reduce_dtype = self._reduce_dtype if ran_in_param_dtype else grad.dtype
        num_dp_ranks = self.gradient_divide_factor or self.groups.num_data_parallel_ranks
        if reduce_dtype.itemsize >= 4:
            # Full precision cannot overflow: divide before the sum, exactly as DDP does.
            predivide, postdivide = float(num_dp_ranks), 1.0
        else:
            predivide, postdivide = gradient_divide_factors(num_dp_ranks)
        grad = grad.to(reduce_dtype)
        if not self.uses_sharded_strategy:
            if predivide > 1:
                grad = grad.div_(predivide)
            work: comm.Pending = comm.all_reduce(grad, self.groups.shard, self.label)
            self._pending_reduction = _PendingReduction(
                work, grad, grad, postdivide, computed_dtype
            )
            return
        layout = self._segments[0].layout
        padding = layout.padded_numel - grad.numel()  # the flat layout's leaf stops at numel
        if padding:
            grad = torch.nn.functional.pad(grad, (0, padding))
        sharded = grad.new_empty(layout.shard_numel)
        work = comm.reduce_scatter_into(
            sharded, grad, self.groups.shard, self.label, predivide=predivide
        )
        self._pending_reduction = _PendingReduction(work, sharded, grad, postdivide, computed_dtype)

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
        reduced = pending.reduced_grad
        if self.groups.replicate is not None:
            if self._partial_replica_grad is not None:
                reduced.add_(self._partial_replica_grad)
                self._partial_replica_grad = None
            if not self.all_reduce_replicas:
                self._partial_replica_grad = reduced
                return
            comm.all_reduce(reduced, self.groups.replicate, self.label).wait()
        if pending.postdivide > 1:
            reduced.div_(pending.postdivide)
        dtype = pending.computed_dtype if self._keep_low_precision_grads else self._orig_param_dtype
        reduced = reduced.to(device=self._shard_device, dtype=dtype)
        self.sync_orig_grads()
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            assign_grad(self.flat_param, reduced)
        else:
            flat_grad.add_(reduced)
        if self._use_orig_params:
            self._use_sharded_grad_views()
        if self._has_optim_in_backward:
            self._step_optimizers_in_backward()

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
