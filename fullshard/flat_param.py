"""One flat parameter per FSDP unit, and the handle that owns its storage and gradients.

The handle owns three buffers:

- ``flat_param._local_shard``: this rank's shard in the parameters' own dtype (the optimizer's
  master copy), the storage ``flat_param`` (what a ``use_orig_params=False`` optimizer steps
  on) always points at. With ``CPUOffload(offload_params=True)`` it lives on the CPU. With
  ``use_orig_params`` the original parameters are 1-D views of their pieces of it.
- ``flat_param._full_param_padded``: the padded unsharded buffer the all-gather writes into,
  on the compute device, in the compute dtype (``MixedPrecision.param_dtype``). Its storage
  is freed (resized to 0) whenever the handle is SHARDED.
- ``_unsharded_flat_param``: a separate autograd leaf over the first ``numel`` elements of
  that storage. During compute, modules see views of it; autograd accumulates the unsharded
  gradient into its ``.grad``, and its post-accumulate-grad hook is the unit's post-backward.
  With NO_SHARD, in the shard's dtype and on its device, the leaf aliases the shard itself.

See [Note: a separate unsharded leaf] for why ``flat_param`` itself never changes storage,
and [Note: mixed precision] for the dtypes.
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
from .api import MixedPrecision, ShardingStrategy

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

# [Note: mixed precision]
# Three dtypes per handle, named as torch's FSDP names them:
# - `_orig_param_dtype`: the parameters' own dtype, the dtype of the shard (the optimizer's
#   master copy). A model converted with `.half()` after wrapping changes it (see `adopt_shard`).
# - `_fwd_bwd_param_dtype`: `MixedPrecision.param_dtype`, else the original dtype. The shard is
#   cast to it *before* the all-gather, so the wire carries the low-precision bytes, and the
#   unsharded leaf (and so the unsharded gradient) is in it.
# - `_reduce_dtype`: `MixedPrecision.reduce_dtype`, else `param_dtype`, else the original dtype.
# After the reduction the sharded gradient is cast back to the original dtype (so the optimizer
# steps in full precision) unless `keep_low_precision_grads`. A unit unsharded in full precision
# (`summon_full_params`, eval under FSDP_USE_FULL_PREC_IN_EVAL=1) gathers and reduces in the
# original dtype, through a second buffer and leaf (`_full_prec_full_param_padded`), so the
# compute-dtype leaf that a pending backward's graph refers to is never replaced.


class FlatParameter(nn.Parameter):
    """The flattened, sharded parameters of one FSDP unit.

    Its data is always this rank's shard (``_local_shard``); it is what the optimizer sees
    with ``use_orig_params=False``. Its ``.grad`` is the sharded, averaged gradient.
    """

    _local_shard: torch.Tensor
    _full_param_padded: torch.Tensor
    """The unsharded buffer in the compute dtype (see ``FlatParamHandle``)."""
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

    work: comm.Pending
    reduced_grad: torch.Tensor
    """Receives the result: this rank's shard (sharded) or the whole gradient (NO_SHARD)."""
    unsharded_grad: torch.Tensor
    """The input, which must not be freed while the collective reads it."""
    postdivide: float
    """What the reduced gradient is divided by once the reduction is done."""


RELEASED_FROM = "_fullshard_released_from"
"""Set on an original parameter whose values moved into a flat parameter (to its name);
see `_check_optimizer_params` in fully_sharded_data_parallel.py."""


@dataclass
class _Unsharded:
    """An unsharded buffer and the autograd leaf over it (see [Note: a separate unsharded leaf])."""

    padded: torch.Tensor
    """What the all-gather writes into; its storage is freed while the handle is SHARDED."""
    leaf: torch.Tensor
    """The first ``numel`` elements of ``padded`` (or of the shard itself, when aliased)."""
    aliases_shard: bool
    """NO_SHARD with no cast and no offload: the leaf is the shard, nothing is copied."""
    hook: RemovableHandle | None


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


def _assign_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set ``param.grad``, also to a gradient of another dtype (``keep_low_precision_grads``).

    The ``.grad`` setter refuses a dtype that differs from the parameter's, so such a gradient
    is installed through ``.data`` of a placeholder, as torch's FSDP does.
    """
    if grad is None or grad.dtype == param.dtype:
        param.grad = grad
        return
    param.grad = torch.empty((), dtype=param.dtype, device=grad.device).expand(param.shape)
    param.grad.data = grad


class FlatParamHandle:
    """Owns a unit's flat parameter: its storage, its views and its gradient.

    Parameters are given in layout order; ``owners[i]`` lists every ``(module, attr)`` that
    refers to parameter ``i`` (more than one when a parameter is shared, e.g. tied weights).
    ``device`` is the compute device; with ``offload_params`` the shard and its gradient live
    on the CPU instead.
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
        mixed_precision: MixedPrecision | None = None,
        offload_params: bool = False,
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
        self._offload_params = offload_params
        self._mixed_precision = mixed_precision
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
        self._keep_low_precision_grads = bool(
            mixed_precision is not None and mixed_precision.keep_low_precision_grads
        )
        self._set_dtypes(params[0].dtype)
        self.flat_param: FlatParameter = self._make_flat_param(params)
        self._post_backward_hook: Callable[[], None] | None = None
        self._compute: _Unsharded = self._make_unsharded(self._fwd_bwd_param_dtype)
        """Unsharded buffer and leaf in the compute dtype; its identity never changes while
        a forward's graph may refer to it."""
        self._full_prec: _Unsharded | None = None
        """In the original dtype, built on first use when that differs from the compute dtype."""
        self._active: _Unsharded = self._compute
        """The one unsharded (or last unsharded): what modules' views and gradients refer to."""
        self.flat_param._full_param_padded = self._compute.padded
        self.state = HandleState.SHARDED
        self._unshard_work: comm.Pending | None = None
        self._unshard_input: torch.Tensor | None = None
        """The cast or copied shard an all-gather in flight reads from."""
        self._pending_reduction: _PendingReduction | None = None
        self._has_optim_in_backward = False
        """Original parameters step their own optimizers as gradients are reduced (see
        [Note: optimizer in backward]); set at lazy initialisation."""
        self.exposes_unsharded_params = False
        """Inside ``summon_full_params``: modules see the full parameters as Parameters."""
        self.has_detached_frozen_views = self.flat_param.requires_grad and not all(
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

    def _set_dtypes(self, orig_dtype: torch.dtype) -> None:
        """Resolve the three dtypes of [Note: mixed precision] from the parameters' dtype."""
        mp = self._mixed_precision
        self._orig_param_dtype = orig_dtype
        param_dtype = mp.param_dtype if mp is not None else None
        reduce_dtype = mp.reduce_dtype if mp is not None else None
        self._fwd_bwd_param_dtype = param_dtype or orig_dtype
        self._reduce_dtype = reduce_dtype or param_dtype or orig_dtype

    @property
    def _shard_device(self) -> torch.device:
        return torch.device("cpu") if self._offload_params else self.device

    def _make_flat_param(self, params: list[nn.Parameter]) -> FlatParameter:
        layout = self.layout
        with torch.no_grad():
            # On the parameters' device: a CPU module stays on the CPU until the user moves
            # it to the compute device (see [Note: devices] in _init_utils).
            flat = torch.empty(
                layout.padded_numel, dtype=self._orig_param_dtype, device=params[0].device
            )
            flat[layout.numel :].zero_()
            for slot, param in zip(layout.slots, params):
                flat[slot.offset : slot.offset + slot.numel].copy_(param.detach().reshape(-1))
            start, end = layout.shard_range(self._shard_rank)
            local_shard = flat[start:end].clone() if self.uses_sharded_strategy else flat
            local_shard = self._to_shard_device(local_shard)
        full_param_padded = torch.empty(0, dtype=local_shard.dtype, device=self.device)
        requires_grad = any(p.requires_grad for p in params)
        return FlatParameter.from_shard(local_shard, full_param_padded, requires_grad)

    def _to_shard_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._offload_params:
            return tensor
        tensor = tensor.to("cpu")
        return self._pinned(tensor)

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        """Offloaded CPU tensors are pinned when computing on CUDA, so copies are async."""
        if self.device.type == "cuda" and tensor.device.type == "cpu" and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def _make_unsharded(self, dtype: torch.dtype) -> _Unsharded:
        """Build an unsharded buffer in ``dtype`` and the leaf over it, hooked for backward.

        See [Note: a separate unsharded leaf].
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
        leaf.set_(source.untyped_storage(), source.storage_offset(), (self.layout.numel,), (1,))
        if not aliases_shard:
            padded.untyped_storage().resize_(0)
        leaf.requires_grad_(self.flat_param.requires_grad)
        hook = None
        if self._post_backward_hook is not None and leaf.requires_grad:
            callback = self._post_backward_hook
            hook = leaf.register_post_accumulate_grad_hook(lambda _: callback())
        return _Unsharded(padded, leaf, aliases_shard, hook)

    def _unsharded_buffers(self) -> list[_Unsharded]:
        if self._full_prec is None or self._full_prec is self._compute:
            return [self._compute]
        return [self._compute, self._full_prec]

    def _unsharded_for(self, full_precision: bool) -> _Unsharded:
        if not full_precision or self._orig_param_dtype == self._fwd_bwd_param_dtype:
            return self._compute
        if self._full_prec is None:
            self._full_prec = self._make_unsharded(self._orig_param_dtype)
            self.flat_param._full_prec_full_param_padded = self._full_prec.padded
        return self._full_prec

    def _release_orig_params(self) -> None:
        """Hand the original parameters' storage over to the flat parameter."""
        if self._use_orig_params:
            self._use_sharded_params()
            return
        for param, slot_owners, fqn in zip(self._orig_params, self._owners, self.param_fqns):
            for module, name in slot_owners:
                _remove_attr(module, name, self._unsafe_setattr)
            # The handle keeps the object only to recognise it; its values now live in the
            # flat parameter, so drop the original storage.
            param.data = param.data.new_empty(0)
            setattr(param, RELEASED_FROM, fqn)

    def check_adoptable(self, converted: torch.Tensor) -> None:
        """The flat parameter keeps its identity (optimizers hold it), so a conversion must
        give a tensor it can take in place (``.data``), which e.g. CPU <-> meta cannot."""
        if not torch._has_compatible_shallow_copy_type(self.flat_param, converted):
            raise RuntimeError(
                f"cannot convert FSDP unit '{self.label}' from {self.flat_param.device} to "
                f"{converted.device}: its flat parameter cannot take a tensor of that type in "
                "place. Move or cast the module before wrapping it in FSDP instead"
            )

    def adopt_shard(self, local_shard: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Make ``local_shard`` (and ``grad``) the shard after ``module.half()``, ``.to()``...

        ``nn.Module._apply`` converts registered parameters by replacing their data; this
        re-points the shard, the unsharded buffer, the leaf and the original parameters'
        views at the converted tensors. The compute device stays: a shard moved elsewhere is
        reported at the next forward (``_init_utils.check_on_compute_device``).
        """
        self._assert_state(HandleState.SHARDED, "adopt_shard")
        self.check_adoptable(local_shard)
        if self.has_unsharded_grad() or self._pending_reduction is not None:
            raise RuntimeError(
                f"cannot convert FSDP unit '{self.label}' while it holds an unreduced gradient "
                "(between backward and the end of a no_sync() block); convert before training "
                "or after the optimizer step"
            )
        if self._offload_params:
            local_shard = self._pinned(local_shard)
            grad = self._pinned(grad) if grad is not None else None
        self.flat_param.data = local_shard
        self.flat_param._local_shard = local_shard
        self._set_dtypes(local_shard.dtype)
        for unsharded in self._unsharded_buffers():
            if unsharded.hook is not None:
                unsharded.hook.remove()
        self._compute = self._active = self._make_unsharded(self._fwd_bwd_param_dtype)
        self._full_prec = None
        self.flat_param._full_param_padded = self._compute.padded
        self.flat_param._full_prec_full_param_padded = None
        if grad is not None and grad.dtype == local_shard.dtype:
            self.flat_param.grad = grad
        elif grad is not None:
            _assign_grad(self.flat_param, grad)
        if self._use_orig_params:
            self._use_sharded_params()
            self._use_sharded_grad_views()

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

    def full_param_views(self) -> list[torch.Tensor]:
        """Detached views of the unsharded parameters (the handle must be unsharded)."""
        self._assert_state(HandleState.UNSHARDED, "full_param_views")
        return [view.detach() for view in self._unsharded_views()]

    def load_full_param(self, index: int, value: torch.Tensor) -> None:
        """Copy this rank's piece of parameter ``index``'s full ``value`` into the shard."""
        self._assert_state(HandleState.SHARDED, "load_full_param")
        slot = self.layout.slots[index]
        if value.shape != slot.shape:
            raise ValueError(
                f"cannot load '{slot.fqn}' of FSDP unit '{self.label}': the state dict has shape "
                f"{tuple(value.shape)} but the parameter has shape {tuple(slot.shape)}"
            )
        piece = self._pieces[index]
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
        state dicts: no rank but the first allocates a unit-sized buffer."""
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

    def views_of_flat(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per parameter, its view (in its shape) of an unsharded flat tensor."""
        pieces = torch.split(flat[: self.layout.numel], self.layout.numels)
        return [piece.view(slot.shape) for piece, slot in zip(pieces, self.layout.slots)]

    @property
    def offload_params(self) -> bool:
        """The shard and its gradient live on the CPU (``CPUOffload(offload_params=True)``)."""
        return self._offload_params

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
        """Per parameter, its view of the unsharded leaf, linked to it by autograd.

        Made with grad enabled whatever the caller's mode: autograd runs the pre-backward hook
        with grad disabled, and a view made there would not lead back to the leaf, so a
        recomputation in backward (activation checkpointing) would build a graph that gives
        the parameters no gradient. See [Note: forward inside backward] in _runtime.py.
        """
        flat = self._active.leaf
        with torch.enable_grad():
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
        self._check_params_not_replaced()
        for view, slot_owners in zip(self._unsharded_views(), self._owners):
            for module, name in slot_owners:
                _assign_plain(module, name, view, self._unsafe_setattr)

    def _check_params_not_replaced(self) -> None:
        """Raise if the user registered another parameter where this unit manages one: FSDP
        would silently keep training the parameter it found at wrapping time."""
        for index, (param, slot_owners) in enumerate(zip(self._orig_params, self._owners)):
            for module, name in slot_owners:
                current = module._parameters.get(name)
                # Registered there: the original (use_orig_params, while sharded) or nothing
                # (our plain views, or flat parameters); any other Parameter is the user's.
                if current is not None and not (self._use_orig_params and current is param):
                    fqn = self.param_fqns[index]
                    raise RuntimeError(
                        f"the parameter {fqn} of FSDP unit '{self.label}' was replaced after "
                        "FullyShardedDataParallel wrapped the model; FSDP shards and trains the "
                        "parameters it found at wrapping time. Replace, resize or tie "
                        "parameters before wrapping (or load new values through load_state_dict"
                        " or summon_full_params(writeback=True))"
                    )

    # -- state transitions ------------------------------------------------------------------

    def _assert_state(self, expected: HandleState, verb: str) -> None:
        if self.state != expected:
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise AssertionError(
                f"[rank {rank}] fullshard internal error: {verb}() of unit '{self.label}' "
                f"expects state {expected.name}, found {self.state.name}"
            )

    def unsharded_matches(self, full_precision: bool) -> bool:
        """Whether the unsharded (or last unsharded) parameters are in the requested precision."""
        return self._active is self._unsharded_for(full_precision)

    @property
    def unsharded_leaf(self) -> torch.Tensor:
        """The leaf modules' views refer to while unsharded (the last one used otherwise)."""
        return self._active.leaf

    @property
    def _unsharded_flat_param(self) -> torch.Tensor:
        """torch's name for ``unsharded_leaf``."""
        return self._active.leaf

    def unshard(self, full_precision: bool = False) -> None:
        """Issue the all-gather of every rank's shard into `_full_param_padded` (async).

        The shard is cast to the compute dtype (``param_dtype``, or the original dtype with
        ``full_precision``) and moved to the compute device first, so the collective carries
        the compute dtype's bytes.
        """
        self._assert_state(HandleState.SHARDED, "unshard")
        self._active = unsharded = self._unsharded_for(full_precision)
        if unsharded.aliases_shard:
            self.state = HandleState.UNSHARDED
            return
        dtype = unsharded.leaf.dtype
        padded = unsharded.padded
        padded.untyped_storage().resize_(padded.numel() * padded.element_size())
        local_shard = self.flat_param._local_shard
        source = local_shard
        if self._offload_params or local_shard.dtype != dtype:
            source = torch.empty(local_shard.numel(), dtype=dtype, device=self.device)
            source.copy_(local_shard, non_blocking=True)
        if not self.uses_sharded_strategy:
            padded.copy_(source)
            self.state = HandleState.UNSHARDED
            return
        self._unshard_input = source
        self._unshard_work = comm.all_gather_into(padded, source, self.groups.shard, self.label)
        self.state = HandleState.UNSHARDING

    def wait_unshard(self) -> None:
        """Block until the unsharded parameter is ready."""
        if self.state == HandleState.UNSHARDING:
            assert self._unshard_work is not None
            self._unshard_work.wait()
            self._unshard_work = None
            self._unshard_input = None
            self.state = HandleState.UNSHARDED
        self._assert_state(HandleState.UNSHARDED, "wait_unshard")

    def reshard(self) -> None:
        """Free the unsharded storage and give modules back their sharded parameters."""
        if self.state == HandleState.UNSHARDING:
            self.wait_unshard()
        self._assert_state(HandleState.UNSHARDED, "reshard")
        if not self._active.aliases_shard:
            self._active.padded.untyped_storage().resize_(0)
        if self._use_orig_params:
            self._use_sharded_params()
        self.state = HandleState.SHARDED

    def unsharded_storage_size(self) -> int:
        """Bytes held by the unsharded buffers (0 when resharded)."""
        return sum(u.padded.untyped_storage().nbytes() for u in self._unsharded_buffers())

    # -- gradients --------------------------------------------------------------------------

    def register_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` each time autograd has accumulated this unit's unsharded gradient."""
        assert self._post_backward_hook is None, "the post-backward hook is registered once"
        self._post_backward_hook = hook
        for unsharded in self._unsharded_buffers():
            leaf = unsharded.leaf
            if leaf.requires_grad:
                unsharded.hook = leaf.register_post_accumulate_grad_hook(lambda _: hook())

    def has_unsharded_grad(self) -> bool:
        return any(u.leaf.grad is not None for u in self._unsharded_buffers())

    def reduce_grad(self) -> None:
        """Issue the reduction of the unsharded gradient (async); frees it once done."""
        for unsharded in self._unsharded_buffers():
            if unsharded.leaf.grad is not None:
                self._reduce_grad_of(unsharded.leaf)

    def _reduce_grad_of(self, leaf: torch.Tensor) -> None:
        grad = leaf.grad
        assert grad is not None
        if self._pending_reduction is not None:  # a second backward before the first finished
            self.finalize_grad()
        leaf.grad = None
        # A unit unsharded in full precision (eval) reduces in full precision too.
        ran_in_param_dtype = grad.dtype == self._fwd_bwd_param_dtype
        reduce_dtype = self._reduce_dtype if ran_in_param_dtype else grad.dtype
        num_dp_ranks = self.groups.num_data_parallel_ranks
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
            self._pending_reduction = _PendingReduction(work, grad, grad, postdivide)
            return
        padding = self.layout.padded_numel - self.layout.numel
        if padding:
            grad = torch.nn.functional.pad(grad, (0, padding))
        sharded = grad.new_empty(self.layout.shard_numel)
        work = comm.reduce_scatter_into(
            sharded, grad, self.groups.shard, self.label, predivide=predivide
        )
        self._pending_reduction = _PendingReduction(work, sharded, grad, postdivide)

    def finalize_grad(self) -> None:
        """Wait for the reduction and accumulate it into the sharded gradient.

        The result is cast to the parameters' dtype (unless ``keep_low_precision_grads``) and
        moved to the shard's device (the CPU with parameter offload).
        """
        pending = self._pending_reduction
        if pending is None:
            return
        self._pending_reduction = None
        pending.work.wait()
        reduced = pending.reduced_grad
        if self.groups.replicate is not None:
            comm.all_reduce(reduced, self.groups.replicate, self.label).wait()
        if pending.postdivide > 1:
            reduced.div_(pending.postdivide)
        dtype = reduced.dtype if self._keep_low_precision_grads else self._orig_param_dtype
        reduced = reduced.to(device=self._shard_device, dtype=dtype)
        self.sync_orig_grads()
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            _assign_grad(self.flat_param, reduced)
        else:
            flat_grad.add_(reduced)
        if self._use_orig_params:
            self._use_sharded_grad_views()
        if self._has_optim_in_backward:
            self._step_optimizers_in_backward()

    # [Note: optimizer in backward]
    # `torch.distributed.optim._apply_optimizer_in_backward(..., register_hook=False)` gives
    # each parameter its own optimizers (`param._in_backward_optimizers`) and leaves running
    # them to FSDP: as soon as a unit's sharded gradient is final, each original parameter
    # with a gradient steps and its gradient is freed, so no sharded gradient outlives the
    # backward. Only `use_orig_params=True` exposes the original parameters to optimizers.

    def init_optimizers_in_backward(self) -> None:
        """At lazy initialisation: find optimizers applied in backward (see the note)."""
        if hasattr(self.flat_param, "_in_backward_optimizers"):
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

    def sync_orig_grads(self) -> None:
        """Make the sharded gradient reflect the original parameters' ``.grad`` (after e.g.
        ``optim.zero_grad()``), before anything re-derives their grads from it."""
        if self._use_orig_params:
            self._pull_orig_grads()

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
        """``use_orig_params``: each original ``.grad`` views its piece of the sharded grad.

        Parameters with no piece on this rank (or frozen ones) have no gradient, as in torch.
        """
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            for param in self._orig_params:
                param.grad = None
            return
        for param, view, slot in zip(
            self._orig_params, self._sharded_piece_views(flat_grad), self.layout.slots
        ):
            has_piece = view.numel() > 0 or slot.numel == 0
            _assign_grad(param, view if slot.requires_grad and has_piece else None)

    # -- summon_full_params -----------------------------------------------------------------

    def expose_unsharded_params(self) -> None:
        """Make the full parameters visible as registered ``nn.Parameter`` s (for summon)."""
        self._assert_state(HandleState.UNSHARDED, "expose_unsharded_params")
        self.exposes_unsharded_params = True
        self.sync_orig_grads()  # leaving re-attaches grads from the sharded gradient
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
        comm.all_reduce(has_grad, self.groups.shard, self.label, dist.ReduceOp.MAX).wait()
        if not has_grad.item():
            return
        if flat_grad is None:
            flat_grad = torch.zeros_like(self.flat_param)
        full_grad = flat_grad.to(self.device)
        if self.uses_sharded_strategy:
            full_grad = full_grad.new_empty(self.layout.padded_numel)
            source = flat_grad.to(self.device)
            comm.all_gather_into(full_grad, source, self.groups.shard, self.label).wait()
        pieces = torch.split(full_grad[: self.layout.numel], self.layout.numels)
        for param, piece, slot in zip(self._orig_params, pieces, self.layout.slots):
            _assign_grad(param, piece.view(slot.shape) if slot.requires_grad else None)

    def hide_unsharded_params(self, writeback: bool) -> None:
        """Undo ``expose_unsharded_params``; with ``writeback`` keep edits made to them.

        Where the handle was resharded inside the summon (an internal error, then reported),
        modules still lose the exposed parameters, so the model stays usable."""
        self.exposes_unsharded_params = False
        if self.state != HandleState.UNSHARDED:
            self._drop_exposed_params()
            self._assert_state(HandleState.UNSHARDED, "hide_unsharded_params")
        if writeback and not self._active.aliases_shard:
            start, end = self.layout.shard_range(self._shard_rank)
            with torch.no_grad():
                self.flat_param._local_shard.copy_(self._active.padded[start:end])
        if not self._use_orig_params:
            for view, slot_owners in zip(self._unsharded_views(), self._owners):
                for module, name in slot_owners:
                    _assign_plain(module, name, view.detach(), self._unsafe_setattr)
        self.reshard()
        if self._use_orig_params:
            self._use_sharded_grad_views()

    def _drop_exposed_params(self) -> None:
        """Sharded already: the original parameters back on their shard pieces, or (flat
        parameters) no attribute until the next forward sets its views."""
        if self._use_orig_params:
            self._use_sharded_params()
            self._use_sharded_grad_views()
            return
        for slot_owners in self._owners:
            for module, name in slot_owners:
                _remove_attr(module, name, self._unsafe_setattr)
