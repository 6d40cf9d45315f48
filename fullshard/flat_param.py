"""The handle that owns an FSDP unit's flat parameters, their views and their gradients.

A unit's parameters are flattened into one flat segment, or two when they differ in
``requires_grad`` (see [Note: frozen parameters]); each segment (``_flat_segment``) owns its
``FlatParameter`` (this rank's shard, the optimizer's master copy), the padded unsharded
buffer the all-gather writes into, and the autograd leaf modules compute with. The handle
owns what spans segments: the unit's state (``HandleState``), the dtypes, which module
attributes refer to which parameter's view, and the gradient: the trainable segment's leaf
accumulates the unsharded gradient, its post-accumulate-grad hook is the unit's post-backward,
and the reduced, sharded gradient lives on ``flat_param.grad``.

``flat_param`` is the first segment's flat parameter: the only one of a uniform unit, the
trainable one of a mixed unit. With ``use_orig_params`` the original parameters are 1-D views
of their pieces of their segment's shard.

See [Note: a separate unsharded leaf] for why ``flat_param`` itself never changes storage,
and [Note: mixed precision] for the dtypes.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ._comm import collectives as comm
from ._comm.groups import ShardingGroups, gradient_divide_factors
from ._flat_segment import FlatParameter, FlatSegment
from ._layout import ParamSlot, ShardPiece, UnitLayout, make_unit_layout
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
#   master copy). A model converted with `.half()` after wrapping changes it (see `adopt_shards`).
# - `_fwd_bwd_param_dtype`: `MixedPrecision.param_dtype`, else the original dtype. The shard is
#   cast to it *before* the all-gather, so the wire carries the low-precision bytes, and the
#   unsharded leaf (and so the unsharded gradient) is in it.
# - `_reduce_dtype`: `MixedPrecision.reduce_dtype`, else `param_dtype`, else the original dtype.
# After the reduction the sharded gradient is cast back to the original dtype (so the optimizer
# steps in full precision) unless `keep_low_precision_grads`. A unit unsharded in full precision
# (`summon_full_params`, eval under FSDP_USE_FULL_PREC_IN_EVAL=1) gathers and reduces in the
# original dtype, through a second buffer and leaf (`_full_prec_full_param_padded`), so the
# compute-dtype leaf that a pending backward's graph refers to is never replaced.


# [Note: frozen parameters]
# A unit whose parameters differ in `requires_grad` (a frozen base with trainable adapters:
# LoRA, PEFT) keeps them in two flat segments, each padded and sharded on its own (see
# `_layout.UnitLayout`): the trainable segment, whose flat parameter is `flat_param`, and the
# frozen one, a second `FlatParameter` with requires_grad=False. Only the trainable segment's
# leaf requires grad, so autograd allocates the unsharded gradient for the trainable
# parameters only, the reduce-scatter sends only it, `flat_param.grad` is only its shard and,
# with use_orig_params=False, the optimizer's state covers only trainable elements. torch's
# FSDP1 refuses such units with use_orig_params=False and, with True, computes and reduces a
# gradient for the whole unit, frozen elements included. The price is a second all-gather
# per unshard (one per segment). Frozen views do not require grad, yet autograd may still
# read them (to compute input gradients) after the trainable leaf's post-backward hook, so
# the runtime reshards such a unit once its forward inputs' gradients are computed too
# (`has_frozen_segment`; see [Note: resharding units with frozen parameters] in _runtime.py).


# [Note: requires_grad changed after wrapping]
# Users freeze parts of a wrapped model (`for p in model.trunk.parameters(): p.requires_grad =
# False`, on the FlatParameter or, with use_orig_params, on the original parameters) and
# unfreeze them later (staged fine-tuning). As torch does, the root's pre-forward re-reads the
# flags of every unit (`sync_requires_grad`): a segment trains iff its flat parameter requires
# grad (use_orig_params=False) or any of its original parameters does (True); its leaves
# follow, so a frozen segment's views carry no autograd history and it gets no gradient, no
# reduce-scatter and no `.grad`. With use_orig_params, an original parameter that does not
# require grad gets no `.grad` even when the rest of its segment trains (its elements are
# still computed and reduced with the segment's, as in torch). The one change that cannot be
# honoured is unfreezing the frozen segment of a unit that was mixed at wrapping (see [Note:
# frozen parameters]): it has no gradient path, so the forward raises instead of silently
# never training it. A change made between a forward and its backward applies from the next
# forward, as in torch.

# [Note: original parameters changed after wrapping]
# With use_orig_params=True, outside forward each original parameter is registered on its
# module holding this rank's piece of its unit's shard (flattened; whole under NO_SHARD), and
# an optimizer over it updates the shard in place. Users also change them otherwise, as
# torch's FSDP lets them: `param.data = t`, or `module.weight = nn.Parameter(t)`, with `t` of
# the piece's shape. Before its shards are gathered (`unshard`: forward, backward, summon,
# state dicts) a unit writes such a change back into its shard, as torch's does, and a new
# Parameter becomes the unit's from then on (its `.grad` is not kept, as in torch); silently
# training the old storage would lose the change. A tensor of another shape cannot be written
# back (torch's "Cannot writeback when the parameter shape changes"), and a tie made or undone
# after wrapping cannot be honoured: both raise. A unit kept unsharded from its forward to its
# backward (the root, SHARD_GRAD_OP) checks at its pre-backward instead, and raises torch's
# "FSDP does not support changing the parameters between forward and backward": the step's
# graph holds views of the unsharded parameters, which the change would bypass. In-place
# changes (`param.mul_(2)`, `param.data.copy_(t)`) write the shard directly and need nothing.
# With use_orig_params=False modules hold no Parameters between steps; one registered there
# is reported by `_check_params_not_replaced` at the next forward.


class OrigParamChangedError(RuntimeError, AssertionError):
    """An original parameter replaced between a forward and its backward (torch raises an
    AssertionError; a RuntimeError too, as it is the user's doing)."""


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
    computed_dtype: torch.dtype
    """The dtype autograd computed the unsharded gradient in (the forward's parameter dtype):
    what ``keep_low_precision_grads`` keeps, as torch does."""


RELEASED_FROM = "_fullshard_released_from"
"""Set on an original parameter whose values moved into a flat parameter (to its name);
see `_check_optimizer_params` in fully_sharded_data_parallel.py."""


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
    """Owns a unit's flat parameters: their storage (one or two segments), views and gradient.

    Parameters are given in registration order; ``owners[i]`` lists every ``(module, attr)``
    that refers to parameter ``i`` (more than one when a parameter is shared, e.g. tied
    weights). ``device`` is the compute device; with ``offload_params`` the shards and the
    gradient live on the CPU instead.
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
        self._check_uniform_dtype(params, fqns)
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
        self.layout: UnitLayout = make_unit_layout(
            fqns, [p.shape for p in params], [p.requires_grad for p in params], num_shards
        )
        self._orig_param_dtype: torch.dtype = params[0].dtype
        self._fwd_bwd_param_dtype: torch.dtype = params[0].dtype
        self._reduce_dtype: torch.dtype = params[0].dtype
        self._keep_low_precision_grads = bool(
            mixed_precision is not None and mixed_precision.keep_low_precision_grads
        )
        self._set_dtypes(params[0].dtype)
        self._segments: tuple[FlatSegment, ...] = self._make_segments(params)
        """The trainable segment first (see [Note: frozen parameters])."""
        self.flat_param: FlatParameter = self._segments[0].flat_param
        self._post_backward_hook: Callable[[], None] | None = None
        self.state = HandleState.SHARDED
        self._pending_reduction: _PendingReduction | None = None
        self._has_optim_in_backward = False
        """Original parameters step their own optimizers as gradients are reduced (see
        [Note: optimizer in backward]); set at lazy initialisation."""
        self.exposes_unsharded_params = False
        """Inside ``summon_full_params``: modules see the full parameters as Parameters."""
        self._exposes_unsharded_grads = False
        """Inside ``summon_full_params(with_grads=True)``: original ``.grad`` s are full."""
        self._release_orig_params()

    # -- construction -------------------------------------------------------------------

    @staticmethod
    def _check_uniform_dtype(params: list[nn.Parameter], fqns: list[str]) -> None:
        dtypes = {p.dtype for p in params}
        if len(dtypes) > 1:
            found = ", ".join(f"{fqn}: {p.dtype}" for fqn, p in zip(fqns, params))
            raise ValueError(
                f"FSDP expects every parameter of one unit to have the same dtype, got {found}; "
                "cast the module to one dtype or wrap the differing modules in their own units"
            )

    def _make_segments(self, params: list[nn.Parameter]) -> tuple[FlatSegment, ...]:
        segments = []
        for index, segment_layout in enumerate(self.layout.segments):
            indices = self.layout.param_indices(index)
            segment = FlatSegment(
                segment_layout,
                indices,
                [params[i] for i in indices],
                self.groups,
                self.uses_sharded_strategy,
                self.device,
                self._offload_params,
                self._fwd_bwd_param_dtype,
            )
            segments.append(segment)
        return tuple(segments)

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

    @property
    def segments(self) -> tuple[FlatSegment, ...]:
        """The unit's flat segments: trainable (or the only one) first, then frozen."""
        return self._segments

    @property
    def flat_params(self) -> list[FlatParameter]:
        """Each segment's flat parameter, ``flat_param`` first."""
        return [segment.flat_param for segment in self._segments]

    @property
    def has_frozen_segment(self) -> bool:
        """Some parameters are frozen: autograd reads their views to compute input gradients
        with no post-backward hook of theirs telling when it is done (see [Note: frozen
        parameters])."""
        return any(not segment.requires_grad for segment in self._segments)

    def segment_of(self, index: int) -> FlatSegment:
        """The segment holding parameter ``index`` (registration order)."""
        return self._segments[self.layout.locations[index][0]]

    def slot(self, index: int) -> ParamSlot:
        """Parameter ``index``'s slot in its segment's layout."""
        return self.layout.slot(index)

    def piece(self, index: int) -> ShardPiece | None:
        """Parameter ``index``'s piece of this rank's shard of its segment (None if none)."""
        segment, slot = self.layout.locations[index]
        return self._segments[segment].pieces[slot]

    def _segment_label(self, segment_index: int) -> str:
        """Names a segment's collectives: the unit's label, marked for the frozen segment."""
        return self.label if segment_index == 0 else f"{self.label} (frozen)"

    def _dtype_for(self, full_precision: bool) -> torch.dtype:
        return self._orig_param_dtype if full_precision else self._fwd_bwd_param_dtype

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

    def check_adoptable(self, converted: torch.Tensor, segment: int = 0) -> None:
        """Whether segment ``segment``'s flat parameter can take ``converted`` in place."""
        self._segments[segment].check_adoptable(converted, self.label)

    def adopt_shards(self, local_shards: list[torch.Tensor], grad: torch.Tensor | None) -> None:
        """Make ``local_shards`` (one per segment) and ``grad`` (``flat_param``'s) the shards
        after ``module.half()``, ``.to()``...

        ``nn.Module._apply`` converts registered parameters by replacing their data; this
        re-points the shards, the unsharded buffers, the leaves and the original parameters'
        views at the converted tensors. The compute device stays: a shard moved elsewhere is
        reported at the next forward (``_init_utils.check_on_compute_device``).
        """
        self._assert_state(HandleState.SHARDED, "adopt_shards")
        assert len(local_shards) == len(self._segments)
        for index, local_shard in enumerate(local_shards):
            self.check_adoptable(local_shard, index)
        if self.has_unsharded_grad() or self._pending_reduction is not None:
            raise RuntimeError(
                f"cannot convert FSDP unit '{self.label}' while it holds an unreduced gradient "
                "(between backward and the end of a no_sync() block); convert before training "
                "or after the optimizer step"
            )
        self._set_dtypes(local_shards[0].dtype)
        for segment, local_shard in zip(self._segments, local_shards):
            segment.adopt(local_shard, self._fwd_bwd_param_dtype)
        if grad is not None and self._offload_params:
            grad = self._segments[0].pinned(grad)
        if grad is not None and grad.dtype == local_shards[0].dtype:
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
        return [self.slot(index).fqn for index in range(self.layout.num_params)]

    def full_param_views(self) -> list[torch.Tensor]:
        """Detached views of the unsharded parameters (the handle must be unsharded)."""
        self._assert_state(HandleState.UNSHARDED, "full_param_views")
        return [view.detach() for view in self._unsharded_views()]

    def load_full_param(self, index: int, value: torch.Tensor) -> None:
        """Copy this rank's piece of parameter ``index``'s full ``value`` into its shard."""
        self._assert_state(HandleState.SHARDED, "load_full_param")
        slot = self.slot(index)
        if value.shape != slot.shape:
            raise ValueError(
                f"cannot load '{slot.fqn}' of FSDP unit '{self.label}': the state dict has shape "
                f"{tuple(value.shape)} but the parameter has shape {tuple(slot.shape)}"
            )
        self.segment_of(index).load_piece(self.layout.locations[index][1], value)

    def full_params_on_first_rank(self, device: torch.device | None) -> list[torch.Tensor] | None:
        """The full parameters (views of fresh memory, moved to ``device`` if given) on the
        shard group's first rank; the other ranks only send their shards and get None. For
        ``rank0_only`` state dicts: no rank but the first allocates a unit-sized buffer."""
        views: dict[int, torch.Tensor] = {}
        for index, segment in enumerate(self._segments):
            shard = segment.flat_param._local_shard.detach()  # the master copy
            flat = segment.gather_flat_to_first_rank(shard, self._segment_label(index))
            if flat is None:
                continue
            if device is not None and flat.device != device:
                flat = flat.to(device)
            views.update(zip(segment.indices, segment.views_of_flat(flat)))
        if self.groups.shard_rank != 0:
            return None
        return [views[index] for index in range(self.layout.num_params)]

    @property
    def offload_params(self) -> bool:
        """The shards and the gradient live on the CPU (``CPUOffload(offload_params=True)``)."""
        return self._offload_params

    def _use_sharded_params(self) -> None:
        """``use_orig_params``: original parameters registered, data = their shard pieces."""
        for segment in self._segments:
            views = segment.sharded_piece_views(segment.flat_param)
            for index, view in zip(segment.indices, views):
                self._orig_params[index].data = view.detach()
        for param, slot_owners in zip(self._orig_params, self._owners):
            for module, name in slot_owners:
                _assign_param(module, name, param, self._unsafe_setattr)

    def register_orig_params(self) -> None:
        """After a forward that keeps the unit unsharded until backward (the root, or
        SHARD_GRAD_OP), with ``use_orig_params``: modules list the original parameters (on
        their shard pieces) again, as torch's do, so ``model.parameters()`` between forward
        and backward sees every parameter. The step's graph keeps the unsharded views it was
        built with; backward recomputations set them again (``use_unsharded_views``)."""
        self._assert_state(HandleState.UNSHARDED, "register_orig_params")
        if self._use_orig_params:
            self._use_sharded_params()

    def _unsharded_views(self) -> list[torch.Tensor]:
        """Per parameter, its view of its segment's active leaf, linked to it by autograd.

        Made with grad enabled whatever the caller's mode: autograd runs the pre-backward hook
        with grad disabled, and a view made there would not lead back to the leaf, so a
        recomputation in backward (activation checkpointing) would build a graph that gives
        the parameters no gradient. See [Note: forward inside backward] in _runtime.py.
        """
        views: dict[int, torch.Tensor] = {}
        with torch.enable_grad():
            for segment in self._segments:
                views.update(zip(segment.indices, segment.leaf_views()))
        return [views[index] for index in range(self.layout.num_params)]

    def use_unsharded_views(self) -> None:
        """Point every owner module's attribute at its view of the unsharded parameter. With
        ``use_orig_params`` the view is also listed in the module's ``_parameters`` (a plain
        tensor there, as torch's FSDP does), so ``named_parameters()`` called inside the
        forward sees every original parameter, at full shape."""
        self._assert_state(HandleState.UNSHARDED, "use_unsharded_views")
        self._check_params_not_replaced()
        for view, slot_owners in zip(self._unsharded_views(), self._owners):
            for module, name in slot_owners:
                if self._use_orig_params:
                    module.__dict__.pop(name, None)
                    module._parameters[name] = view  # type: ignore[assignment]
                else:
                    _assign_plain(module, name, view, self._unsafe_setattr)

    def _check_params_not_replaced(self) -> None:
        """Raise if the user registered another parameter where this unit manages one: FSDP
        would silently keep training the parameter it found at wrapping time."""
        for index, (param, slot_owners) in enumerate(zip(self._orig_params, self._owners)):
            for module, name in slot_owners:
                current = module._parameters.get(name)
                # Registered there: the original (use_orig_params, while sharded), our view
                # (use_orig_params, in forward: a plain tensor, which setattr cannot register)
                # or nothing (flat parameters); any other Parameter is the user's.
                if isinstance(current, nn.Parameter) and not (
                    self._use_orig_params and current is param
                ):
                    fqn = self.param_fqns[index]
                    raise RuntimeError(
                        f"the parameter {fqn} of FSDP unit '{self.label}' was replaced after "
                        "FullyShardedDataParallel wrapped the model; FSDP shards and trains the "
                        "parameters it found at wrapping time. Replace, resize or tie "
                        "parameters before wrapping (or load new values through load_state_dict"
                        " or summon_full_params(writeback=True))"
                    )

    def _write_back_orig_params(self) -> None:
        """``use_orig_params``, before the shards are gathered: adopt what the user did to the
        original parameters since they were last given their shard pieces (see [Note: original
        parameters changed after wrapping])."""
        if not self._use_orig_params:
            return
        changed = False
        for index, view in self._orig_param_pieces():
            param = self._registered_orig_param(index, view)
            if param is None:  # unregistered for now (summon, state dicts): nothing to adopt
                continue
            if param is not self._orig_params[index]:
                self._orig_params[index] = param  # its .grad, if any, is not kept (torch)
                changed = True
            if view.numel() > 0 and param.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(param.detach())
                changed = True
        if changed:
            self._use_sharded_params()

    def _orig_param_pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """Each original parameter's index and its piece of the shard (empty if none)."""
        for segment in self._segments:
            yield from zip(segment.indices, segment.sharded_piece_views(segment.flat_param))

    def _registered_orig_param(self, index: int, view: torch.Tensor) -> nn.Parameter | None:
        """The Parameter the owners of parameter ``index`` hold now, if it can be written back
        into ``view`` (its shard piece): the same object in every owner, not another of this
        unit's parameters, and of the piece's shape."""
        held = [module._parameters.get(name) for module, name in self._owners[index]]
        param = held[0]
        if param is None or not isinstance(param, nn.Parameter):
            return None
        fqn = self.param_fqns[index]
        replaced = param is not self._orig_params[index]
        if any(p is not param for p in held) or (
            replaced and any(param is other for other in self._orig_params)
        ):
            raise RuntimeError(
                f"the parameter {fqn} of FSDP unit '{self.label}' was replaced after "
                "FullyShardedDataParallel wrapped the model, by another of the unit's "
                "parameters or differently in the modules sharing it; FSDP cannot change "
                "which parameters are shared. Tie or untie parameters before wrapping"
            )
        if param.shape != view.shape:
            raise RuntimeError(
                "Cannot writeback when the parameter shape changes\n"
                f"Expects {view.shape} but got {param.shape}: the parameter {fqn} of FSDP unit "
                f"'{self.label}' was replaced after FullyShardedDataParallel wrapped the model "
                "(or its .data was). With use_orig_params=True each original parameter holds "
                "this rank's piece of its shard outside forward, so only a tensor of that shape "
                "can be written back. Replace, resize or tie parameters before wrapping (or "
                "load new values through load_state_dict or summon_full_params(writeback=True))"
            )
        return param

    def check_orig_params_kept(self) -> None:
        """At a pre-backward of a unit still unsharded since its forward: its original
        parameters must not have been replaced since that forward (the step's graph holds
        views of the unsharded parameters, which a change would silently bypass)."""
        if not self._use_orig_params:
            return
        for index, view in self._orig_param_pieces():
            param, owners = self._orig_params[index], self._owners[index]
            replaced = any(module._parameters.get(name) is not param for module, name in owners)
            moved = view.numel() > 0 and param.data_ptr() != view.data_ptr()
            if replaced or moved:
                raise OrigParamChangedError(
                    "FSDP does not support changing the parameters between forward and "
                    f"backward for {self.sharding_strategy}: the parameter "
                    f"{self.param_fqns[index]} of FSDP unit '{self.label}' was "
                    f"{'replaced' if replaced else 'given new .data'} after its forward; "
                    "change parameters outside the forward-backward of a step (or in place)"
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
        segment = self._segments[0]
        return segment.active is segment.unsharded_for(self._dtype_for(full_precision))

    @property
    def unsharded_leaf(self) -> torch.Tensor:
        """The trainable (or only) leaf modules' views refer to while unsharded (the last one
        used otherwise)."""
        return self._segments[0].active.leaf

    @property
    def _unsharded_flat_param(self) -> torch.Tensor:
        """torch's name for ``unsharded_leaf``."""
        return self.unsharded_leaf

    def unshard(self, full_precision: bool = False) -> None:
        """Issue the all-gather of every rank's shard into `_full_param_padded` (async), one
        per segment.

        The shard is cast to the compute dtype (``param_dtype``, or the original dtype with
        ``full_precision``) and moved to the compute device first, so the collective carries
        the compute dtype's bytes.
        """
        self._assert_state(HandleState.SHARDED, "unshard")
        self._write_back_orig_params()
        dtype = self._dtype_for(full_precision)
        in_flight = False
        for index, segment in enumerate(self._segments):
            in_flight |= segment.unshard(dtype, self._segment_label(index))
        self.state = HandleState.UNSHARDING if in_flight else HandleState.UNSHARDED

    def wait_unshard(self) -> None:
        """Block until the unsharded parameters are ready."""
        if self.state == HandleState.UNSHARDING:
            for segment in self._segments:
                segment.wait_unshard()
            self.state = HandleState.UNSHARDED
        self._assert_state(HandleState.UNSHARDED, "wait_unshard")

    def reshard(self) -> None:
        """Free the unsharded storage and give modules back their sharded parameters."""
        if self.state == HandleState.UNSHARDING:
            self.wait_unshard()
        self._assert_state(HandleState.UNSHARDED, "reshard")
        for segment in self._segments:
            segment.reshard()
        if self._use_orig_params:
            self._use_sharded_params()
        self.state = HandleState.SHARDED

    def unsharded_storage_size(self) -> int:
        """Bytes held by the unsharded buffers (0 when resharded)."""
        return sum(segment.storage_size() for segment in self._segments)

    # -- gradients --------------------------------------------------------------------------
    # Only `flat_param`'s segment can require grad (see [Note: frozen parameters]).

    def register_post_backward_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook`` each time autograd has accumulated this unit's unsharded gradient."""
        assert self._post_backward_hook is None, "the post-backward hook is registered once"
        self._post_backward_hook = hook
        self._segments[0].set_post_backward_hook(hook)

    def sync_requires_grad(self) -> None:
        """At the root's pre-forward: adopt ``requires_grad`` changes made since the last
        forward (see [Note: requires_grad changed after wrapping])."""
        for position, segment in enumerate(self._segments):
            if self._use_orig_params:
                params = [self._orig_params[index] for index in segment.indices]
                wanted = any(param.requires_grad for param in params)
            else:
                wanted = segment.flat_param.requires_grad
            if wanted == segment.requires_grad:
                continue
            if position > 0:
                if self._use_orig_params:
                    fqns = [
                        self.slot(i).fqn for i, p in zip(segment.indices, params) if p.requires_grad
                    ]
                    what = ", ".join(fqns)
                else:
                    what = "the frozen flat parameter (_frozen_flat_param)"
                raise RuntimeError(
                    f"FSDP unit '{self.label}': {what} now require(s) grad, but were frozen "
                    "when FullyShardedDataParallel wrapped the unit alongside trainable "
                    "parameters, so they were flattened apart and get no gradient. Unfreeze "
                    "them before wrapping, or give them an FSDP unit of their own "
                    "(auto_wrap_policy)"
                )
            segment.set_requires_grad(wanted)

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
            self._pending_reduction = _PendingReduction(
                work, grad, grad, postdivide, computed_dtype
            )
            return
        layout = self._segments[0].layout
        padding = layout.padded_numel - layout.numel
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
            comm.all_reduce(reduced, self.groups.replicate, self.label).wait()
        if pending.postdivide > 1:
            reduced.div_(pending.postdivide)
        dtype = pending.computed_dtype if self._keep_low_precision_grads else self._orig_param_dtype
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
        segment = self._segments[0]
        for index, view in zip(segment.indices, segment.sharded_piece_views(flat_grad)):
            if not self._orig_params[index].requires_grad or view.numel() == 0:
                continue
            grad = self._orig_params[index].grad
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

        Parameters with no piece on this rank, or that do not require grad now, have no
        gradient, as in torch.
        """
        grads: dict[int, torch.Tensor] = {}
        flat_grad = self.flat_param.grad
        if flat_grad is not None:
            segment = self._segments[0]
            for index, view in zip(segment.indices, segment.sharded_piece_views(flat_grad)):
                trains = self._orig_params[index].requires_grad
                if trains and (view.numel() > 0 or self.slot(index).numel == 0):
                    grads[index] = view
        for index, param in enumerate(self._orig_params):
            _assign_grad(param, grads.get(index))

    # -- summon_full_params -----------------------------------------------------------------

    def expose_unsharded_params(self) -> None:
        """Make the full parameters visible as registered ``nn.Parameter`` s (for summon)."""
        self._assert_state(HandleState.UNSHARDED, "expose_unsharded_params")
        self.exposes_unsharded_params = True
        self.sync_orig_grads()  # leaving re-attaches grads from the sharded gradient
        views = [v.detach() for v in self._unsharded_views()]
        for index, (param, view, slot_owners) in enumerate(
            zip(self._orig_params, views, self._owners)
        ):
            exposed = param
            if self._use_orig_params:
                param.data = view
            else:  # the flag the user sees on the flat parameter (it may have changed since)
                flat_param = self.segment_of(index).flat_param
                exposed = nn.Parameter(view, requires_grad=flat_param.requires_grad)
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
        segment = self._segments[0]  # frozen parameters keep no gradient
        full_grad = flat_grad.to(self.device)
        if self.uses_sharded_strategy:
            full_grad = full_grad.new_empty(segment.layout.padded_numel)
            source = flat_grad.to(self.device)
            comm.all_gather_into(full_grad, source, self.groups.shard, self.label).wait()
        for index, view in zip(segment.indices, segment.views_of_flat(full_grad)):
            param = self._orig_params[index]
            _assign_grad(param, view if param.requires_grad else None)
        self._exposes_unsharded_grads = True

    def _write_back_grads(self) -> None:
        """``summon_full_params(with_grads=True, writeback=True)``: copy this rank's pieces of
        the full gradients (edited in the summon) into the sharded gradient, as torch's
        ``_writeback_to_local_shard(handle, writeback_grad=True)``. A rank that had no sharded
        gradient keeps none (its zeros were only a stand-in for the all-gather), as in torch."""
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            return
        segment = self._segments[0]
        views = segment.sharded_piece_views(flat_grad)
        for index, piece, view in zip(segment.indices, segment.pieces, views):
            grad = self._orig_params[index].grad
            if grad is None or piece is None or grad.data_ptr() == view.data_ptr():
                continue  # no piece here, or NO_SHARD: the full grad is the sharded one
            source = grad.detach().reshape(-1)[piece.param_start : piece.param_start + piece.numel]
            with torch.no_grad():
                view.view(-1).copy_(source)

    def hide_unsharded_params(self, writeback: bool) -> None:
        """Undo ``expose_unsharded_params``; with ``writeback`` keep edits made to them.

        Where the handle was resharded inside the summon (an internal error, then reported),
        modules still lose the exposed parameters, so the model stays usable."""
        self.exposes_unsharded_params = False
        grads_exposed, self._exposes_unsharded_grads = self._exposes_unsharded_grads, False
        if self.state != HandleState.UNSHARDED:
            self._drop_exposed_params()
            self._assert_state(HandleState.UNSHARDED, "hide_unsharded_params")
        if writeback:
            for segment in self._segments:
                segment.write_back()
            if grads_exposed:
                self._write_back_grads()
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
