"""One flat parameter per FSDP unit, and the handle that owns its storage and gradients.

The handle owns three buffers:

- ``flat_param._local_shard``: this rank's fp32 shard, the storage ``flat_param`` (what a
  ``use_orig_params=False`` optimizer steps on) always points at. With ``use_orig_params``
  the original parameters are 1-D views of their pieces of it.
- ``flat_param._full_param_padded``: the padded unsharded buffer the all-gather writes into.
  Its storage is freed (resized to 0) whenever the handle is SHARDED.
- ``_unsharded_flat_param``: a separate autograd leaf over the first ``numel`` elements of
  that storage. During compute, modules see views of it; autograd accumulates the unsharded
  gradient into its ``.grad``, and its post-accumulate-grad hook is the unit's post-backward.

See [Note: a separate unsharded leaf] for why ``flat_param`` itself never changes storage.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import _collectives as comm
from ._layout import FlatLayout, ShardPiece, make_layout
from ._process_groups import ShardingGroups, gradient_divide_factors
from .api import ShardingStrategy

__all__ = ["FlatParamHandle", "FlatParameter", "HandleState"]

_FSDP_USE_UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"
"""When "1", module attributes are swapped without calling the module's ``__setattr__``."""

# [Note: a separate unsharded leaf]
# torch FSDP1 swaps `flat_param.data` between the shard and the unsharded buffer, so one
# tensor has two identities and its `.grad` must be shuffled aside before each backward.
# Here `flat_param` is the shard, always. Compute uses `_unsharded_flat_param`, a leaf that
# shares the storage of `_full_param_padded` but has its own version counter (it is made with
# `set_`, not as a view), so refilling the storage by all-gather before backward does not trip
# autograd's saved-tensor checks. Its `.grad` is the unsharded gradient, which accumulates
# naturally under `no_sync()`; the sharded gradient lives on `flat_param.grad`.


class FlatParameter(nn.Parameter):
    """The flattened, sharded parameters of one FSDP unit.

    Its data is always this rank's shard (``_local_shard``); it is what the optimizer sees
    with ``use_orig_params=False``. Its ``.grad`` is the sharded, averaged gradient.
    """

    _local_shard: torch.Tensor
    _full_param_padded: torch.Tensor

    @classmethod
    def from_shard(
        cls, local_shard: torch.Tensor, full_param_padded: torch.Tensor, requires_grad: bool
    ) -> FlatParameter:
        flat_param = cls(local_shard, requires_grad=requires_grad)
        flat_param._local_shard = local_shard
        flat_param._full_param_padded = full_param_padded
        return flat_param


class HandleState(enum.Enum):
    """Where a unit's parameters are materialised."""

    SHARDED = enum.auto()
    """Only the local shard exists; `_full_param_padded` has no storage. It is the only
    contributor to this unit's parameter memory."""
    UNSHARDING = enum.auto()
    """An all-gather into `_full_param_padded` is in flight; wait before reading it."""
    UNSHARDED = enum.auto()
    """`_full_param_padded` holds every rank's shard; modules may use views of it."""


@dataclass
class _PendingReduction:
    """A gradient reduction in flight; holds its buffers alive until it completes."""

    work: dist.Work
    reduced_grad: torch.Tensor
    """Receives the result: this rank's shard (sharded) or the whole gradient (NO_SHARD)."""
    unsharded_grad: torch.Tensor
    """The input, which must not be freed while the collective reads it."""


def _assign_plain(module: nn.Module, name: str, tensor: torch.Tensor, unsafe: bool) -> None:
    """Make ``module.<name>`` a plain tensor attribute (not a registered parameter)."""
    if unsafe:
        module._parameters.pop(name, None)
        module.__dict__[name] = tensor
        return
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, tensor)


def _assign_param(module: nn.Module, name: str, param: nn.Parameter, unsafe: bool) -> None:
    """Register ``param`` as ``module.<name>``."""
    if unsafe:
        module.__dict__.pop(name, None)
        module._parameters[name] = param
        return
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, param)


def _remove_attr(module: nn.Module, name: str, unsafe: bool) -> None:
    if unsafe:
        module._parameters.pop(name, None)
        module.__dict__.pop(name, None)
    elif hasattr(module, name):
        delattr(module, name)


class FlatParamHandle:
    """Owns a unit's flat parameter: its storage, its views and its gradient.

    Parameters are given in layout order; ``owners[i]`` lists every ``(module, attr)`` that
    refers to parameter ``i`` (more than one when a parameter is shared, e.g. tied weights).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        owners: list[list[tuple[nn.Module, str]]],
        fqns: list[str],
        groups: ShardingGroups,
        strategy: ShardingStrategy,
        use_orig_params: bool,
        device: torch.device,
        label: str,
    ) -> None:
        if not params:
            raise ValueError("a FlatParamHandle needs at least one parameter")
        self._check_uniform(params, fqns, use_orig_params)
        self.label = label
        self.groups = groups
        self.sharding_strategy = strategy
        self.uses_sharded_strategy = strategy != ShardingStrategy.NO_SHARD
        self._use_orig_params = use_orig_params
        self._unsafe_setattr = os.environ.get(_FSDP_USE_UNSAFE_SETATTR, "") == "1"
        self.device = device
        self._orig_params: list[nn.Parameter] = list(params)
        self._owners = owners
        num_shards = groups.shard_size if self.uses_sharded_strategy else 1
        self.layout: FlatLayout = make_layout(
            fqns, [p.shape for p in params], [p.requires_grad for p in params], num_shards
        )
        self._shard_rank = groups.shard_rank if self.uses_sharded_strategy else 0
        self._pieces: tuple[ShardPiece | None, ...] = self.layout.shard_pieces(self._shard_rank)
        self._orig_param_dtype: torch.dtype = params[0].dtype
        self._fwd_bwd_param_dtype: torch.dtype = params[0].dtype
        self._reduce_dtype: torch.dtype = params[0].dtype
        num_dp_ranks = groups.num_data_parallel_ranks
        if self._reduce_dtype.itemsize >= 4:
            # Full precision cannot overflow: divide before the sum, exactly as DDP does.
            self._predivide, self._postdivide = float(num_dp_ranks), 1.0
        else:
            self._predivide, self._postdivide = gradient_divide_factors(num_dp_ranks)
        self.flat_param: FlatParameter = self._make_flat_param(params)
        self._unsharded_flat_param: torch.Tensor = self._make_unsharded_leaf()
        self.state = HandleState.SHARDED
        self._unshard_work: dist.Work | None = None
        self._pending_reduction: _PendingReduction | None = None
        self.has_detached_frozen_views = self._unsharded_flat_param.requires_grad and not all(
            slot.requires_grad for slot in self.layout.slots
        )
        self._release_orig_params()

    # -- construction -------------------------------------------------------------------

    @staticmethod
    def _check_uniform(params: list[nn.Parameter], fqns: list[str], use_orig_params: bool) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            found = ", ".join(f"{fqn}: {p.dtype}" for fqn, p in zip(fqns, params))
            raise ValueError(
                f"FSDP expects every parameter of one unit to have the same dtype, got {found}; "
                "cast the module to one dtype or wrap the differing modules in their own units"
            )
        if not use_orig_params and len({p.requires_grad for p in params}) > 1:
            frozen = [fqn for fqn, p in zip(fqns, params) if not p.requires_grad]
            raise ValueError(
                "Must flatten tensors with uniform `requires_grad` when `use_orig_params=False`; "
                f"frozen parameters {frozen} share a unit with trainable ones. Pass "
                "use_orig_params=True, or wrap the frozen modules in their own units"
            )

    def _make_flat_param(self, params: list[nn.Parameter]) -> FlatParameter:
        layout = self.layout
        with torch.no_grad():
            flat = torch.empty(
                layout.padded_numel, dtype=self._orig_param_dtype, device=self.device
            )
            flat[layout.numel :].zero_()
            for slot, param in zip(layout.slots, params):
                flat[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            start, end = layout.shard_range(self._shard_rank)
            local_shard = flat[start:end].clone() if self.uses_sharded_strategy else flat
        full_param_padded = torch.empty(0, dtype=local_shard.dtype, device=self.device)
        if self.uses_sharded_strategy:
            full_param_padded = torch.empty_like(flat)  # freed once the leaf is made over it
        requires_grad = any(p.requires_grad for p in params)
        return FlatParameter.from_shard(local_shard, full_param_padded, requires_grad)

    def _make_unsharded_leaf(self) -> torch.Tensor:
        # See [Note: a separate unsharded leaf].
        source = (
            self.flat_param._full_param_padded
            if self.uses_sharded_strategy
            else self.flat_param._local_shard
        )
        leaf = torch.empty(0, dtype=source.dtype, device=source.device)
        # `set_` grows a storage too small for the sizes, so the storage must still be
        # allocated here; it is freed right after.
        leaf.set_(source.untyped_storage(), 0, (self.layout.numel,), (1,))
        if self.uses_sharded_strategy:
            source.untyped_storage().resize_(0)
        return leaf.requires_grad_(self.flat_param.requires_grad)

    def _release_orig_params(self) -> None:
        """Hand the original parameters' storage over to the flat parameter."""
        if self._use_orig_params:
            self._use_sharded_params()
            return
        for param, slot_owners in zip(self._orig_params, self._owners):
            for module, name in slot_owners:
                _remove_attr(module, name, self._unsafe_setattr)
            # The handle keeps the object only to recognise it; its values now live in the
            # flat parameter, so drop the original storage.
            param.data = param.data.new_empty(0)

    # -- parameters -----------------------------------------------------------------------

    @property
    def orig_params(self) -> list[nn.Parameter]:
        return list(self._orig_params)

    @property
    def owners(self) -> list[list[tuple[nn.Module, str]]]:
        """Per parameter, every ``(module, attr)`` that refers to it."""
        return [list(slot_owners) for slot_owners in self._owners]

    @property
    def param_fqns(self) -> list[str]:
        return [slot.fqn for slot in self.layout.slots]

    def _sharded_piece_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its piece of the shard-shaped ``flat`` (empty if it has none)."""
        views: list[torch.Tensor] = []
        for slot, piece in zip(self.layout.slots, self._pieces):
            if not self.uses_sharded_strategy:
                views.append(flat[slot.offset : slot.offset + slot.numel].view(slot.shape))
            elif piece is None:
                views.append(flat.new_empty(0))
            else:
                views.append(flat[piece.shard_start : piece.shard_start + piece.numel])
        return views

    def _use_sharded_params(self) -> None:
        """``use_orig_params``: original parameters registered, data = their shard pieces."""
        for param, view in zip(self._orig_params, self._sharded_piece_views(self.flat_param)):
            param.data = view.detach()
        for param, slot_owners in zip(self._orig_params, self._owners):
            for module, name in slot_owners:
                _assign_param(module, name, param, self._unsafe_setattr)

    def _unsharded_views(self) -> list[torch.Tensor]:
        flat = self._unsharded_flat_param
        views = [
            piece.view(slot.shape)
            for piece, slot in zip(torch.split(flat, self.layout.numels), self.layout.slots)
        ]
        if self.has_detached_frozen_views:
            views = [v if s.requires_grad else v.detach() for v, s in zip(views, self.layout.slots)]
        return views

    def use_unsharded_views(self) -> None:
        """Point every owner module's attribute at its view of the unsharded parameter."""
        self._assert_state(HandleState.UNSHARDED, "use_unsharded_views")
        for view, slot_owners in zip(self._unsharded_views(), self._owners):
            for module, name in slot_owners:
                _assign_plain(module, name, view, self._unsafe_setattr)

    # -- state transitions ------------------------------------------------------------------

    def _assert_state(self, expected: HandleState, verb: str) -> None:
        if self.state != expected:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise AssertionError(
                f"[rank {rank}] fullshard internal error: {verb}() of unit '{self.label}' "
                f"expects state {expected.name}, found {self.state.name}"
            )

    def unshard(self) -> None:
        """Issue the all-gather of every rank's shard into `_full_param_padded` (async)."""
        self._assert_state(HandleState.SHARDED, "unshard")
        if not self.uses_sharded_strategy:
            self.state = HandleState.UNSHARDED
            return
        padded = self.flat_param._full_param_padded
        padded.untyped_storage().resize_(padded.numel() * padded.element_size())
        self._unshard_work = comm.all_gather_into(
            padded, self.flat_param._local_shard, self.groups.shard, self.label
        )
        self.state = HandleState.UNSHARDING

    def wait_unshard(self) -> None:
        """Block until the unsharded parameter is ready."""
        if self.state == HandleState.UNSHARDING:
            assert self._unshard_work is not None
            self._unshard_work.wait()
            self._unshard_work = None
            self.state = HandleState.UNSHARDED
        self._assert_state(HandleState.UNSHARDED, "wait_unshard")

    def reshard(self) -> None:
        """Free the unsharded storage and give modules back their sharded parameters."""
        if self.state == HandleState.UNSHARDING:
            self.wait_unshard()
        self._assert_state(HandleState.UNSHARDED, "reshard")
        if self.uses_sharded_strategy:
            self.flat_param._full_param_padded.untyped_storage().resize_(0)
        if self._use_orig_params:
            self._use_sharded_params()
        self.state = HandleState.SHARDED

    def unsharded_storage_size(self) -> int:
        """Bytes held by the unsharded buffer (0 when resharded)."""
        return self.flat_param._full_param_padded.untyped_storage().nbytes()

    # -- gradients --------------------------------------------------------------------------

    def register_post_backward_hook(self, hook: Callable[[], None]) -> RemovableHandle | None:
        """Call ``hook`` each time autograd has accumulated this unit's unsharded gradient."""
        if not self._unsharded_flat_param.requires_grad:
            return None
        return self._unsharded_flat_param.register_post_accumulate_grad_hook(lambda _: hook())

    def has_unsharded_grad(self) -> bool:
        return self._unsharded_flat_param.grad is not None

    def reduce_grad(self) -> None:
        """Issue the reduction of the unsharded gradient (async); frees it once done."""
        grad = self._unsharded_flat_param.grad
        if grad is None:
            return
        if self._pending_reduction is not None:  # a second backward before the first finished
            self.finalize_grad()
        self._unsharded_flat_param.grad = None
        grad = grad.to(self._reduce_dtype)
        if self._predivide > 1:
            grad = grad.div_(self._predivide)
        if not self.uses_sharded_strategy:
            work = comm.all_reduce_sum(grad, self.groups.shard, self.label)
            self._pending_reduction = _PendingReduction(work, grad, grad)
            return
        padding = self.layout.padded_numel - self.layout.numel
        if padding:
            grad = torch.nn.functional.pad(grad, (0, padding))
        sharded = grad.new_empty(self.layout.shard_numel)
        work = comm.reduce_scatter_into(sharded, grad, self.groups.shard, self.label)
        self._pending_reduction = _PendingReduction(work, sharded, grad)

    def finalize_grad(self) -> None:
        """Wait for the reduction and accumulate it into the sharded gradient."""
        pending = self._pending_reduction
        if pending is None:
            return
        self._pending_reduction = None
        pending.work.wait()
        reduced = pending.reduced_grad
        if self.groups.replicate is not None:
            comm.all_reduce_sum(reduced, self.groups.replicate, self.label).wait()
        if self._postdivide > 1:
            reduced.div_(self._postdivide)
        reduced = reduced.to(self.flat_param.dtype)
        if self._use_orig_params:
            self._pull_orig_grads()
        if self.flat_param.grad is None:
            self.flat_param.grad = reduced
        else:
            self.flat_param.grad += reduced
        if self._use_orig_params:
            self._use_sharded_grad_views()

    def _pull_orig_grads(self) -> None:
        """``use_orig_params``: adopt what the user did to the original parameters' grads.

        The optimizer sees the original parameters, so ``zero_grad()`` sets their ``.grad``
        to None (or zeroes our views in place); a user may also assign new tensors.
        """
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            return
        any_kept = False
        for param, view, slot in zip(
            self._orig_params, self._sharded_piece_views(flat_grad), self.layout.slots
        ):
            if not slot.requires_grad or view.numel() == 0:
                continue
            grad = param.grad
            if grad is None:
                view.zero_()
                continue
            any_kept = True
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad.reshape(view.shape))
        if not any_kept:
            self.flat_param.grad = None

    def _use_sharded_grad_views(self) -> None:
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            for param in self._orig_params:
                param.grad = None
            return
        for param, view, slot in zip(
            self._orig_params, self._sharded_piece_views(flat_grad), self.layout.slots
        ):
            param.grad = view if slot.requires_grad else None

    # -- summon_full_params -----------------------------------------------------------------

    def expose_unsharded_params(self) -> None:
        """Make the full parameters visible as registered ``nn.Parameter`` s (for summon)."""
        self._assert_state(HandleState.UNSHARDED, "expose_unsharded_params")
        views = [v.detach() for v in self._unsharded_views()]
        for param, view, slot_owners in zip(self._orig_params, views, self._owners):
            exposed = param
            if self._use_orig_params:
                param.data = view
            else:
                exposed = nn.Parameter(view, requires_grad=param.requires_grad)
            for module, name in slot_owners:
                _assign_param(module, name, exposed, self._unsafe_setattr)

    def expose_unsharded_grads(self) -> None:
        """``use_orig_params``: point each original ``.grad`` at its full gradient.

        Collective: every rank all-gathers its sharded gradient (zeros where it has none);
        if no rank has a gradient, the gradients stay None.
        """
        self._assert_state(HandleState.UNSHARDED, "expose_unsharded_grads")
        assert self._use_orig_params, "summon_full_params(with_grads=True) needs use_orig_params"
        flat_grad = self.flat_param.grad
        has_grad = torch.tensor([float(flat_grad is not None)], device=self.device)
        dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=self.groups.shard)
        if not has_grad.item():
            return
        if flat_grad is None:
            flat_grad = torch.zeros_like(self.flat_param)
        full_grad = flat_grad
        if self.uses_sharded_strategy:
            full_grad = flat_grad.new_empty(self.layout.padded_numel)
            comm.all_gather_into(full_grad, flat_grad, self.groups.shard, self.label).wait()
        pieces = torch.split(full_grad[: self.layout.numel], self.layout.numels)
        for param, piece, slot in zip(self._orig_params, pieces, self.layout.slots):
            param.grad = piece.view(slot.shape) if slot.requires_grad else None

    def hide_unsharded_params(self, writeback: bool) -> None:
        """Undo ``expose_unsharded_params``; with ``writeback`` keep edits made to them."""
        self._assert_state(HandleState.UNSHARDED, "hide_unsharded_params")
        if writeback and self.uses_sharded_strategy:
            start, end = self.layout.shard_range(self._shard_rank)
            with torch.no_grad():
                self.flat_param._local_shard.copy_(self.flat_param._full_param_padded[start:end])
        if not self._use_orig_params:
            for view, slot_owners in zip(self._unsharded_views(), self._owners):
                for module, name in slot_owners:
                    _assign_plain(module, name, view.detach(), self._unsafe_setattr)
        self.reshard()
        if self._use_orig_params:
            self._use_sharded_grad_views()
