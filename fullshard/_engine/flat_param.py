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

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from ..api import MixedPrecision
from .accumulated_grads import AccumulatedGradViews
from .dtensor_params import DTensorParams, local_tensor
from .extensions import AllGatherExtensions, has_extension, is_extension_subclass
from .flat_segment import FlatParameter, FlatSegment
from .grads import GradReduction, assign_grad
from .handle_state import HandleState
from .layout import ParamSlot, ShardPiece, UnitLayout, make_unit_layout
from .orig_params import OrigParamViews
from .sharding import Sharding
from .summon_views import SummonViews

__all__ = ["FlatParamHandle", "FlatParameter", "HandleState"]

_FSDP_USE_UNSAFE_SETATTR = "FSDP_USE_UNSAFE_SETATTR"
"""torch's name for the variable (its tests import it from here); read into
`fullshard._switches.Switches.use_unsafe_setattr` as the unit is built."""

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
# `layout.UnitLayout`): the trainable segment, whose flat parameter is `flat_param`, and the
# frozen one, a second `FlatParameter` with requires_grad=False. Only the trainable segment's
# leaf requires grad, so autograd allocates the unsharded gradient for the trainable
# parameters only, the reduce-scatter sends only it, `flat_param.grad` is only its shard and,
# with use_orig_params=False, the optimizer's state covers only trainable elements. torch's
# FSDP1 refuses such units with use_orig_params=False and, with True, computes and reduces a
# gradient for the whole unit, frozen elements included. The price is a second all-gather
# per unshard (one per segment). Frozen views do not require grad, yet autograd may still
# read them (to compute input gradients) after the trainable leaf's post-backward hook, so
# the runtime reshards such a unit once its forward inputs' gradients are computed too
# (`has_frozen_segment`; see [Note: resharding units with frozen parameters] in runtime.py).


class FlatParamHandle(OrigParamViews, SummonViews, GradReduction, AccumulatedGradViews):
    """Owns a unit's flat parameters: their storage (one or two segments), views and gradient.

    Parameters are given in registration order; ``owners[i]`` lists every ``(module, attr)``
    that refers to parameter ``i`` (more than one when a parameter is shared, e.g. tied
    weights). ``device`` is the compute device; with ``offload_params`` the shards and the
    gradient live on the CPU instead.
    """

    _orig_param_dtype: torch.dtype
    _fwd_bwd_param_dtype: torch.dtype
    _reduce_dtype: torch.dtype
    """The three dtypes of [Note: mixed precision], set by ``_set_dtypes``."""

    def __init__(
        self,
        params: list[nn.Parameter],
        owners: list[list[tuple[nn.Module, str]]],
        fqns: list[str],
        sharding: Sharding,
        use_orig_params: bool,
        device: torch.device,
        label: str,
        mixed_precision: MixedPrecision | None = None,
        offload_params: bool = False,
        unsafe_setattr: bool = False,
        dtensor_params: DTensorParams | None = None,
    ) -> None:
        if not params:
            raise ValueError("a FlatParamHandle needs at least one parameter")
        self._check_uniform_dtype(params, fqns, by_requires_grad=dtensor_params is not None)
        self.label = label
        groups = sharding.groups
        self.groups = groups
        self.sharding_strategy = sharding.strategy  # FSDP1's name, for messages
        self.uses_sharded_strategy = sharding.split
        self._use_orig_params = use_orig_params
        self._unsafe_setattr = unsafe_setattr
        self._dtensor_params = dtensor_params  # FSDP2's DTensor parameters (dtensor_params.py)
        self.gradient_divide_factor: float | None = None  # None: the data parallel ranks
        self._init_reduction_state()
        self._init_exposure_state()
        self._shard_version_at_unshard = -1  # the shard's version when last gathered
        self.device = device
        self._offload_params = offload_params
        self._mixed_precision = mixed_precision
        self._orig_params: list[nn.Parameter] = list(params)
        self._owners = owners
        self.layout: UnitLayout = make_unit_layout(  # FSDP2 splits each parameter on dim 0
            fqns,
            [self._in_layout(i, p).shape for i, p in enumerate(params)],
            [p.requires_grad for p in params],
            groups.shard_size if self.uses_sharded_strategy else 1,
            dim0=dtensor_params is not None,
        )
        self._keep_low_precision_grads = bool(
            mixed_precision and mixed_precision.keep_low_precision_grads
        )
        self._set_dtypes(params[self.layout.param_indices(0)[0]].dtype)  # trainable, if any
        # FSDP2's all-gather extensions: parameters of a tensor subclass that has them keep
        # local tensors of their own (see [Note: all-gather extensions])
        self._extension_subclasses, self._extensions = self._find_extensions(
            params, owners, dtensor_params
        )
        self._unsharded_in_full_precision = False
        self._segments: tuple[FlatSegment, ...] = self._make_segments(params)
        """The trainable segment first (see [Note: frozen parameters])."""
        self.flat_param: FlatParameter = self._segments[0].flat_param
        self._post_backward_hook: Callable[[], None] | None = None
        self.state = HandleState.SHARDED
        self._has_optim_in_backward = False  # see [Note: optimizer in backward]; at lazy init
        self.exposes_unsharded_params = False  # summon: the full parameters (and grads) shown
        self._exposes_unsharded_grads = False
        self._release_orig_params()

    # -- construction -------------------------------------------------------------------

    def _find_extensions(
        self,
        params: list[nn.Parameter],
        owners: list[list[tuple[nn.Module, str]]],
        dtensor_params: DTensorParams | None,
    ) -> tuple[set[int], AllGatherExtensions | None]:
        """The parameters of a tensor subclass with all-gather extensions, and the unit's
        extension all-gathers (FSDP2 only)."""
        if dtensor_params is None:
            return set(), None
        subclasses = {i for i, p in enumerate(params) if is_extension_subclass(p)}
        extensions = AllGatherExtensions(
            dtensor_params.mesh,
            self.groups.shard,
            dtensor_params.mp_policy,
            [p.shape for p in params],
            [slot_owners[0][0] for slot_owners in owners],
            dtensor_params.post_forward_group,
        )
        return subclasses, extensions

    @staticmethod
    def _check_uniform_dtype(
        params: list[nn.Parameter], fqns: list[str], by_requires_grad: bool
    ) -> None:
        """One dtype per unit (FSDP1, as torch's); FSDP2: one for the trainable parameters and
        one for the frozen ones, which torch lets differ (e.g. frozen float8 weights)."""
        groups = (
            [
                [i for i, p in enumerate(params) if p.requires_grad is trains]
                for trains in (True, False)
            ]
            if by_requires_grad
            else [list(range(len(params)))]
        )
        for indices in groups:
            if len({params[i].dtype for i in indices}) > 1:
                found = ", ".join(f"{fqns[i]}: {params[i].dtype}" for i in indices)
                raise ValueError(
                    f"FSDP expects every parameter of one unit to have the same dtype, got "
                    f"{found}; cast the module to one dtype or wrap the differing modules in "
                    "their own units"
                )

    def _make_segments(self, params: list[nn.Parameter]) -> tuple[FlatSegment, ...]:
        segments = []
        for index, segment_layout in enumerate(self.layout.segments):
            indices = self.layout.param_indices(index)
            dtensors = self._dtensor_params
            segment = FlatSegment(
                segment_layout,
                indices,
                [self._layout_source(i, params[i]) for i in indices],
                self.groups,
                self.uses_sharded_strategy,
                self.device,
                self._offload_params,
                self._compute_dtype(params[indices[0]].dtype),
                shard_dims=None if dtensors is None else [dtensors.dims[i] for i in indices],
                post_forward_group=None if dtensors is None else dtensors.post_forward_group,
                unsharded_shapes=None
                if dtensors is None
                else [dtensors.own_shape(i) for i in indices],
                from_extensions=all(i in self._extension_subclasses for i in indices),
            )
            segments.append(segment)
        return tuple(segments)

    def _layout_source(self, index: int, param: torch.Tensor) -> torch.Tensor:
        """What the flat shard is built from for parameter ``index``: zeros for an extension
        subclass (its values stay in its own local tensor), else the parameter."""
        if index in self._extension_subclasses:  # one zero, expanded: no memory
            return torch.zeros((), dtype=param.dtype, device=param.device).expand(param.shape)
        return self._in_layout(index, param)

    def _in_layout(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Parameter ``index`` (or a tensor of its shape) as the layout splits it: moved where
        ``fully_shard`` shards it on another dim (see [Note: sharding on another dim])."""
        dtensors = self._dtensor_params
        return tensor if dtensors is None else dtensors.to_layout(index, tensor)

    def _from_layout(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        dtensors = self._dtensor_params
        return tensor if dtensors is None else dtensors.from_layout(index, tensor)

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

    def _dtype_for(self, full_precision: bool, segment: int = 0) -> torch.dtype:
        """What segment ``segment`` computes in: its own dtype in full precision, else the
        compute dtype (a frozen segment may have its own dtype under FSDP2)."""
        own = self._segments[segment].flat_param.dtype if segment else self._orig_param_dtype
        return own if full_precision else self._compute_dtype(own)

    def _compute_dtype(self, own: torch.dtype) -> torch.dtype:
        """``param_dtype`` if set, else the parameters' own dtype."""
        mp = self._mixed_precision
        return (mp.param_dtype if mp is not None else None) or own

    def check_adoptable(self, converted: torch.Tensor, segment: int = 0) -> None:
        """Whether segment ``segment``'s flat parameter can take ``converted`` in place."""
        self._segments[segment].check_adoptable(converted, self.label)

    def adopt_replaced_data(self) -> None:
        """At the root's lazy init, adopt a flat parameter's ``.data`` replaced since wrapping
        as its shard, as torch's lazy init does: accelerate upcasts low-precision flat
        parameters that way (``flat_param.data = flat_param.data.float()``) before the first
        forward. Without this the optimizer would step the new tensor while the all-gathers
        read the old one."""
        flat_params = self.flat_params
        if all(_is_same_tensor(fp.data, fp._local_shard) for fp in flat_params):
            return
        for fp in flat_params:
            if fp.data.shape != fp._local_shard.shape:
                raise RuntimeError(
                    f"the flat parameter of FSDP unit '{self.label}' was given data of shape "
                    f"{tuple(fp.data.shape)} where its shard has {tuple(fp._local_shard.shape)}:"
                    " replace a flat parameter's data only by a tensor of the shard's shape "
                    "(a cast or a move)"
                )
        self.adopt_shards([fp.data for fp in flat_params], self.flat_param.grad)

    def adopt_shards(self, local_shards: list[torch.Tensor], grad: torch.Tensor | None) -> None:
        """Make ``local_shards`` (one per segment) and ``grad`` (``flat_param``'s) the shards
        after ``module.half()``, ``.to()``...

        ``nn.Module._apply`` converts registered parameters by replacing their data; this
        re-points the shards, the unsharded buffers, the leaves and the original parameters'
        views at the converted tensors. The compute device stays: a shard moved elsewhere is
        reported at the next forward (``init.check_on_compute_device``).
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
            segment.adopt(local_shard, self._compute_dtype(local_shard.dtype))
        if grad is not None and self._offload_params:
            grad = self._segments[0].pinned(grad)
        if grad is not None and grad.dtype == local_shards[0].dtype:
            self.flat_param.grad = grad
        elif grad is not None:
            assign_grad(self.flat_param, grad)
        if self._use_orig_params:
            self._use_sharded_params()
            self._use_sharded_grad_views()

    def _adopt_segment(self, position: int, shard: torch.Tensor) -> None:
        """Segment ``position`` takes ``shard`` (materialised from meta) as its flat shard;
        the original parameters are re-pointed at the next write-back or reshard."""
        self._assert_state(HandleState.SHARDED, "_adopt_segment")
        segment = self._segments[position]
        segment.adopt(shard, self._compute_dtype(shard.dtype))
        if position == 0:
            self._set_dtypes(shard.dtype)

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
        value = self._in_layout(index, value)
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
        return [self._from_layout(index, views[index]) for index in range(self.layout.num_params)]

    @property
    def offload_params(self) -> bool:
        """The shards and the gradient live on the CPU (``CPUOffload(offload_params=True)``)."""
        return self._offload_params

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
        self.adopt_exposed_grad()  # see [Note: gradients accumulated under no_sync]
        self._write_back_orig_params()
        self.release_grads_if_dropped()
        if self._shard_version() != self._shard_version_at_unshard:
            for segment in self._segments:  # kept over k ranks, then changed: stale
                segment.drop_post_forward()
            if self._extensions is not None:
                self._extensions.drop_post_forward()
        self._shard_version_at_unshard = self._shard_version()
        in_flight = False
        for index, segment in enumerate(self._segments):
            dtype = self._dtype_for(full_precision, index)
            in_flight |= segment.unshard(dtype, self._segment_label(index))
        in_flight |= self._issue_extensions()
        self._unsharded_in_full_precision = full_precision
        self.state = HandleState.UNSHARDING if in_flight else HandleState.UNSHARDED

    def _issue_extensions(self) -> bool:
        """FSDP2: issue the all-gathers of parameters with all-gather extensions (see [Note:
        all-gather extensions]); True if there are any."""
        extensions = self._extensions
        if extensions is None:
            return False
        locals_ = {
            index: local
            for index, local in ((i, local_tensor(p)) for i, p in enumerate(self._orig_params))
            if has_extension(local)
        }
        if locals_:
            extensions.issue(locals_, self.device, self.label)
        return bool(locals_)

    def wait_unshard(self) -> None:
        """Block until the unsharded parameters are ready."""
        if self.state == HandleState.UNSHARDING:
            for segment in self._segments:
                segment.wait_unshard()
            self._finish_extensions()
            self.state = HandleState.UNSHARDED
        self._assert_state(HandleState.UNSHARDED, "wait_unshard")

    def _finish_extensions(self) -> None:
        """Build the extension parameters' unsharded tensors; modules compute with them."""
        extensions = self._extensions
        if extensions is None:
            return
        full_precision = self._unsharded_in_full_precision
        dtypes = {
            index: self._dtype_for(full_precision, self.layout.locations[index][0])
            for index in range(self.layout.num_params)
        }
        extensions.wait(dtypes)
        for segment in self._segments:
            params = segment.active.params
            if params is not None:
                params.overrides = {
                    slot: extensions.unsharded[index]
                    for slot, index in enumerate(segment.indices)
                    if index in extensions.unsharded
                }
                if segment.from_extensions and len(params.overrides) < len(segment.indices):
                    missing = [self.param_fqns[i] for i in segment.indices]
                    raise RuntimeError(
                        f"parameters {missing} of FSDP unit '{self.label}' no longer carry "
                        "their all-gather extension (fsdp_pre_all_gather / "
                        "fsdp_post_all_gather): their local tensors were replaced by tensors "
                        "of another class after fully_shard; keep the subclass (convert "
                        "with operations it preserves), or apply fully_shard to the "
                        "converted model"
                    )

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded storage and give modules back their sharded parameters
        (``after_forward``: keep them over a smaller group if ``reshard_after_forward=k``)."""
        if self.state == HandleState.UNSHARDING:
            self.wait_unshard()
        self._assert_state(HandleState.UNSHARDED, "reshard")
        for segment in self._segments:
            segment.reshard(after_forward)
        if self._extensions is not None:
            self._extensions.reshard(after_forward)
        if self._use_orig_params:
            self._use_sharded_params()
        self.state = HandleState.SHARDED

    def _shard_version(self) -> int:
        """Changes with every in-place update of the shard: through the flat parameter, or
        through the original (DTensor) parameters, whose in-place ops run below autograd on
        their local tensors and so bump only the DTensor's own counter."""
        shards = sum(segment.flat_param._local_shard._version for segment in self._segments)
        return shards + sum(param._version for param in self._orig_params)

    def shard_changed_since_unshard(self) -> bool:
        """Whether the shard was updated in place (an optimizer step) since the unsharded
        parameters were gathered: kept unsharded across steps, they would be stale."""
        return self._shard_version() != self._shard_version_at_unshard

    def unsharded_storage_size(self) -> int:
        """Bytes held by the unsharded buffers (0 when resharded)."""
        return sum(segment.storage_size() for segment in self._segments)

    # -- gradients --------------------------------------------------------------------------
    # Only `flat_param`'s segment can require grad (see [Note: frozen parameters]).

    # [Note: optimizer in backward]
    # `torch.distributed.optim._apply_optimizer_in_backward(..., register_hook=False)` gives
    # each parameter its own optimizers (`param._in_backward_optimizers`) and leaves running
    # them to FSDP: as soon as a unit's sharded gradient is final, each original parameter
    # with a gradient steps and its gradient is freed, so no sharded gradient outlives the
    # backward. Only `use_orig_params=True` exposes the original parameters to optimizers.

    # -- summon_full_params -----------------------------------------------------------------


def _is_same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.data_ptr() == b.data_ptr()
        and a.dtype == b.dtype
        and a.device == b.device
        and a.shape == b.shape
    )
