"""The original parameters of a unit: views of its flat parameters that modules see, their
gradients, and what happens when a user changes them after wrapping. A part of
``FlatParamHandle`` (see ``flat_param``), which supplies the storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _global_parameter_registration_hooks
from torch.utils.weak import WeakIdKeyDictionary

from .._comm.groups import ShardingGroups
from ..api import ShardingStrategy
from .dtensor_params import DTensorParams, local_tensor, sharded_by_a_unit
from .extensions import sharded_local
from .flat_segment import FlatParameter, FlatSegment
from .grads import assign_grad
from .handle_state import HandleState
from .layout import ParamSlot, UnitLayout

__all__ = ["OrigParamChangedError"]

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


RELEASED: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""Original parameter whose values moved into a flat parameter (FSDP1) or which a new DTensor
parameter replaced (``fully_shard``) -> its name (held weakly, not set on the user's
parameter); see ``optimizer_check``. ``REPLACED_BY_DTENSOR`` tells the two apart."""

REPLACED_BY_DTENSOR: WeakIdKeyDictionary = WeakIdKeyDictionary()
"""The parameters of ``RELEASED`` that ``fully_shard`` replaced (-> True), so an error names
the API the user called."""


class OrigParamChangedError(RuntimeError, AssertionError):
    """An original parameter replaced between a forward and its backward (torch raises an
    AssertionError; a RuntimeError too, as it is the user's doing)."""


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
    """Register ``param`` as ``module.<name>``: through the module's ``setattr`` where its
    class has its own (or its own ``register_parameter``, or someone hooks parameter
    registration), else straight into its dicts, which is what ``nn.Module.__setattr__``
    would do, at a fraction of the cost (this runs for every parameter at every reshard
    under ``use_orig_params`` and ``fully_shard``)."""
    cls = type(module)
    if unsafe or (
        cls.__setattr__ is nn.Module.__setattr__
        and cls.__delattr__ is nn.Module.__delattr__
        and cls.register_parameter is nn.Module.register_parameter
        and not _global_parameter_registration_hooks
    ):
        module.__dict__.pop(name, None)
        module._parameters[name] = param
        return
    if hasattr(module, name):
        delattr(module, name)
    setattr(module, name, param)


def _equal_copies(held: list[nn.Parameter | None]) -> bool:
    """Whether the modules sharing a parameter hold new parameters that are equal copies of
    each other (``load_state_dict(assign=True)`` gives each name of a tied parameter its own
    tensor): the tie is kept, with the first of them."""
    first = held[0]
    return all(
        param is not None
        and param.shape == first.shape  # type: ignore[union-attr]
        and torch.equal(local_tensor(param), local_tensor(first))  # type: ignore[arg-type]
        for param in held
    )


class StorageLess(torch.Tensor):
    """What a module holds as an original parameter of a flat-parameter unit outside
    forward (see ``OrigParamViews.hold_storageless_views``): shape, dtype and device, and no
    values; any operation on it raises, naming the parameter and where its values are."""

    _where: str

    @staticmethod
    def __new__(
        cls, shape: torch.Size, dtype: torch.dtype, device: torch.device, where: str
    ) -> StorageLess:
        tensor = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)
        tensor._where = where
        return tensor

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch declares it without func
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        held = next(arg for arg in (*args, *(kwargs or {}).values()) if isinstance(arg, cls))
        raise RuntimeError(
            f"{held._where} ({tuple(held.shape)}, {held.dtype}) has no values outside "
            f"forward: with use_orig_params=False the unit holds them in its flat parameter "
            f"({func} was called on the module's attribute). Read them inside "
            "FullyShardedDataParallel.summon_full_params(model), from model.state_dict(), or "
            "wrap with use_orig_params=True to keep the original parameters registered"
        )

    def __repr__(self, *, tensor_contents: object = None) -> str:  # type: ignore[override]
        return f"StorageLess({self._where}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __deepcopy__(self, memo: dict[int, object]) -> StorageLess:
        return StorageLess(self.shape, self.dtype, self.device, self._where)


class OrigParamViews:
    """``FlatParamHandle``'s verbs on the original parameters."""

    if TYPE_CHECKING:  # supplied by FlatParamHandle
        label: str
        device: torch.device
        groups: ShardingGroups
        sharding_strategy: ShardingStrategy
        uses_sharded_strategy: bool
        layout: UnitLayout
        state: HandleState
        flat_param: FlatParameter
        exposes_unsharded_params: bool
        _exposes_unsharded_grads: bool
        _segments: tuple[FlatSegment, ...]
        _orig_params: list[nn.Parameter]
        _owners: list[list[tuple[nn.Module, str]]]
        _use_orig_params: bool
        _unsafe_setattr: bool
        _dtensor_params: DTensorParams | None
        _extension_subclasses: set[int]

        @property
        def param_fqns(self) -> list[str]: ...
        def segment_of(self, index: int) -> FlatSegment: ...
        def slot(self, index: int) -> ParamSlot: ...
        def reshard(self) -> None: ...
        def adopt_exposed_grad(self) -> None: ...
        def _assert_state(self, expected: HandleState, verb: str) -> None: ...
        def _adopt_segment(self, position: int, shard: torch.Tensor) -> None: ...

    def _release_orig_params(self) -> None:
        """Hand the original parameters' storage over to the flat parameter."""
        if self._use_orig_params:
            self._use_sharded_params()
            return
        self.hold_storageless_views()
        for param, fqn in zip(self._orig_params, self.param_fqns):
            # The handle keeps the object only to recognise it; its values now live in the
            # flat parameter, so drop the original storage.
            param.data = param.data.new_empty(0)
            RELEASED[param] = fqn

    def hold_storageless_views(self) -> None:
        """Flat parameters (``use_orig_params=False``), before the first forward and after a
        summon: each owner module's attribute is a `StorageLess` tensor with its
        parameter's shape, dtype and device, as torch's FSDP1 leaves views there. So
        ``module.weight is not None``, its shape and ``print(model)`` work as on torch
        (``nn.Linear``'s repr reads ``bias``), and using the values raises an error that
        says where to read them (torch's views there may hold no storage at all)."""
        for index, slot_owners in enumerate(self._owners):
            flat = self.segment_of(index).flat_param
            where = f"parameter '{self.param_fqns[index]}' of FSDP unit '{self.label}'"
            view = StorageLess(self.slot(index).shape, flat.dtype, flat.device, where)
            for module, name in slot_owners:
                _assign_plain(module, name, view, self._unsafe_setattr)

    def _use_sharded_params(self) -> None:
        """``use_orig_params``: original parameters registered, data = their shard pieces."""
        for segment in self._segments:
            on_piece = self._on_their_pieces(segment)
            if all(on_piece):  # as every reshard but the first finds them
                continue
            views = segment.sharded_piece_views(segment.flat_param)
            for index, view, kept in zip(segment.indices, views, on_piece):
                if not kept:
                    self._set_sharded_piece(index, view)
        for param, slot_owners in zip(self._orig_params, self._owners):
            for module, name in slot_owners:
                _assign_param(module, name, param, self._unsafe_setattr)

    def _set_sharded_piece(self, index: int, view: torch.Tensor) -> None:
        """Original parameter ``index`` on ``view``, its piece of the shard: as its ``.data``
        (FSDP1), or as the local tensor of its DTensor (FSDP2; the plain parameter found at
        construction is replaced by a DTensor one, as torch's ``fully_shard`` does)."""
        dtensors = self._dtensor_params
        param = self._orig_params[index]
        if dtensors is None:
            param.data = view.detach()
        elif index in self._extension_subclasses:  # its local tensor is not in the shard
            if not sharded_by_a_unit(param):
                local = sharded_local(param, self.groups.shard_rank, self.groups.shard_size)
                self._orig_params[index] = dtensors.make_param_on(index, local, param.requires_grad)
                RELEASED[param] = self.slot(index).fqn
                REPLACED_BY_DTENSOR[param] = True
        elif sharded_by_a_unit(param):
            dtensors.repoint(param, index, view)
        else:  # the plain parameter found at construction, or a tensor-parallel DTensor
            self._orig_params[index] = dtensors.make_param(index, view, param.requires_grad)
            if not isinstance(param, DTensor):
                param.data = param.data.new_empty(0)  # an optimizer still holding it is refused
            RELEASED[param] = self.slot(index).fqn
            REPLACED_BY_DTENSOR[param] = True

    def _sharded_grad(self, index: int, view: torch.Tensor) -> torch.Tensor:
        """What parameter ``index``'s ``.grad`` is, given its piece of the sharded gradient."""
        dtensors = self._dtensor_params
        return view if dtensors is None else dtensors.wrap(index, view)

    def register_orig_params(self) -> None:
        """After a forward that keeps the unit unsharded until backward (the root, or
        SHARD_GRAD_OP), with ``use_orig_params``: modules list the original parameters (on
        their shard pieces) again, as torch's FSDP1 does, so ``model.parameters()`` between
        forward and backward sees every parameter. The step's graph keeps the unsharded views
        it was built with; backward recomputations set them again (``use_unsharded_views``).
        FSDP2 (DTensor parameters) keeps the unsharded parameters registered instead, as
        torch's ``fully_shard`` does wherever a group stays unsharded; ``reshard()`` (or a
        state dict) registers the DTensors again."""
        self._assert_state(HandleState.UNSHARDED, "register_orig_params")
        if self._use_orig_params and self._dtensor_params is None:
            self._use_sharded_params()

    def _unsharded_views(self) -> list[torch.Tensor]:
        """Per parameter, its view of its segment's active leaf, linked to it by autograd.

        Made with grad enabled whatever the caller's mode: autograd runs the pre-backward hook
        with grad disabled, and a view made there would not lead back to the leaf, so a
        recomputation in backward (activation checkpointing) would build a graph that gives
        the parameters no gradient. See [Note: forward inside backward] in runtime.py.
        """
        views: dict[int, torch.Tensor] = {}
        dtensors = self._dtensor_params
        with torch.enable_grad():
            for segment in self._segments:
                views.update(zip(segment.indices, segment.leaf_views()))
            if dtensors is not None:  # tensor-parallel pieces as their DTensors
                views = {index: dtensors.unsharded(index, view) for index, view in views.items()}
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
        for index, view in self._changed_orig_param_pieces():
            if index in self._extension_subclasses:
                continue  # its local tensor is its own (see [Note: all-gather extensions])
            param = self._registered_orig_param(index, view)
            if param is None:  # unregistered for now (summon, state dicts): nothing to adopt
                continue
            if param is not self._orig_params[index]:
                self._orig_params[index] = param  # its .grad, if any, is not kept (torch)
                if self._dtensor_params is not None and isinstance(param, DTensor):
                    self._dtensor_params.adopt(param)  # the unit's now (assigned by the user)
                changed = True
            local = local_tensor(param)
            if view.numel() > 0 and local.data_ptr() != view.data_ptr():
                with torch.no_grad():
                    view.copy_(local.detach().reshape(view.shape))  # a local is in layout order
                changed = True
        if changed:
            self._use_sharded_params()

    def _changed_orig_param_pieces(self) -> Iterator[tuple[int, torch.Tensor]]:
        """``_orig_param_pieces``, less the parameters every owner still holds, on their
        pieces: what ``_write_back_orig_params`` would find nothing to adopt in, known
        without making their views (this runs for every unit at every unshard)."""
        for segment in self._segments:
            held = [
                kept
                and all(m._parameters.get(n) is self._orig_params[i] for m, n in self._owners[i])
                for i, kept in zip(segment.indices, self._on_their_pieces(segment))
            ]
            if all(held):
                continue
            views = segment.sharded_piece_views(segment.flat_param)
            yield from (
                (index, view) for index, view, kept in zip(segment.indices, views, held) if not kept
            )

    def _on_their_pieces(self, segment: FlatSegment) -> list[bool]:
        """Per parameter of ``segment``, whether it lies on its piece of the shard as
        ``_set_sharded_piece`` puts it there: the same address, shape, dtype, contiguous (a
        DTensor one made by a unit: its local tensor, with the piece's size)."""
        out = []
        dtype = segment.flat_param.dtype
        for index, place in zip(segment.indices, segment.piece_places()):
            param = self._orig_params[index]
            if place is None or index in self._extension_subclasses:
                out.append(False)
                continue
            address, shape = place
            local = local_tensor(param)
            if self._dtensor_params is None:
                kept = local.shape == shape
            else:
                kept = sharded_by_a_unit(param) and local.numel() == shape.numel()
            kept = kept and local.dtype == dtype and local.is_contiguous()
            out.append(kept and (shape.numel() == 0 or local.data_ptr() == address))
        return out

    def materialize_assigned_params(self) -> None:
        """FSDP2, before a forward: a shard still on the meta device (``fully_shard`` on a meta
        model) whose parameters the modules now hold materialized (``load_state_dict(...,
        assign=True)``, or a new DTensor parameter assigned) is rebuilt on their device, and
        the unshard's write-back copies them in (see [Note: original parameters changed
        after wrapping]). A shard whose parameters are still on meta is torch's error, naming
        them."""
        if self._dtensor_params is None:
            return
        for position, segment in enumerate(self._segments):
            if not segment.flat_param.is_meta:
                continue
            held = [self._owners[index][0] for index in segment.indices]
            registered = [module._parameters.get(name) for module, name in held]
            on_meta = [
                self._param_fqn_from_root(index)
                for index, param in zip(segment.indices, registered)
                if param is None or local_tensor(param).is_meta
            ]
            if on_meta:
                raise RuntimeError(
                    "FSDP parameters should be materialized from meta device before training, "
                    f"but the following were still on meta device: {on_meta}\n"
                    "For example, call module.to_empty(device) to materialize to device and "
                    "call module.reset_parameters() on each module to initialize values."
                )
            first = local_tensor(registered[0])  # type: ignore[arg-type]
            shard = torch.zeros(segment.layout.shard_numel, dtype=first.dtype, device=first.device)
            self._adopt_segment(position, shard)

    def _param_fqn_from_root(self, index: int) -> str:
        """Parameter ``index``'s name under the root (the unit's label is its path there)."""
        fqn = self.slot(index).fqn
        return fqn if self.label in ("(root)", "") else f"{self.label}.{fqn}"

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
        fqn = self.slot(index).fqn
        replaced = param is not self._orig_params[index]
        if (any(p is not param for p in held) and not _equal_copies(held)) or (
            replaced and any(param is other for other in self._orig_params)
        ):
            raise RuntimeError(
                f"the parameter {fqn} of FSDP unit '{self.label}' was replaced after "
                "FullyShardedDataParallel wrapped the model, by another of the unit's "
                "parameters or differently in the modules sharing it; FSDP cannot change "
                "which parameters are shared. Tie or untie parameters before wrapping"
            )
        if isinstance(param, DTensor):  # its local tensor, in any shape, fills the piece
            fits = local_tensor(param).numel() == view.numel()
        else:
            fits = param.shape == view.shape
        if not fits:
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
        views of the unsharded parameters, which a change would silently bypass). FSDP2
        keeps the unsharded parameters registered meanwhile (``register_orig_params``): the
        sharded ones are not the modules' to replace then."""
        if not self._use_orig_params or self._dtensor_params is not None:
            return
        for index, view in self._orig_param_pieces():
            param, owners = self._orig_params[index], self._owners[index]
            replaced = any(module._parameters.get(name) is not param for module, name in owners)
            moved = view.numel() > 0 and local_tensor(param).data_ptr() != view.data_ptr()
            if replaced or moved:
                raise OrigParamChangedError(
                    "FSDP does not support changing the parameters between forward and "
                    f"backward for {self.sharding_strategy}: the parameter "
                    f"{self.param_fqns[index]} of FSDP unit '{self.label}' was "
                    f"{'replaced' if replaced else 'given new .data'} after its forward; "
                    "change parameters outside the forward-backward of a step (or in place)"
                )

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

    def sync_orig_grads(self) -> None:
        """Make the sharded gradient reflect the original parameters' ``.grad`` (after e.g.
        ``optim.zero_grad()``), before anything re-derives their grads from it."""
        self.adopt_exposed_grad()  # see [Note: gradients accumulated under no_sync]
        if self._use_orig_params:
            self._pull_orig_grads()

    def release_grads_if_dropped(self) -> None:
        """``use_orig_params``: once every original gradient was dropped
        (``zero_grad(set_to_none=True)``), drop the sharded gradient they viewed, at the
        unit's next unshard rather than its next reduction: through the forward and most of
        the backward the unit then holds no gradient (torch's FSDP1 does so in its
        pre-forward; torch's FSDP2 gradients are the reduce-scatter's own output)."""
        if not self._use_orig_params or self.flat_param.grad is None:
            return
        if all(param.grad is None for param in self._orig_params):
            self.flat_param.grad = None

    def _pull_orig_grads(self) -> None:
        """``use_orig_params``: adopt what the user did to the original parameters' grads.

        The optimizer sees the original parameters, so ``zero_grad()`` sets their ``.grad``
        to None (or zeroes our views in place); a user may also assign new tensors.
        """
        flat_grad = self.flat_param.grad
        if flat_grad is None:
            return
        segment = self._segments[0]
        held = [
            (index, view, self._orig_params[index].grad)
            for index, view in zip(segment.indices, segment.sharded_piece_views(flat_grad))
            if self._orig_params[index].requires_grad and view.numel() > 0
        ]
        if all(grad is None for _, _, grad in held):  # e.g. zero_grad(set_to_none=True)
            self.flat_param.grad = None  # rather than zeroing it piece by piece
            return
        for _, view, grad in held:
            if grad is None:
                view.zero_()
                continue
            grad = local_tensor(grad)
            if grad.data_ptr() != view.data_ptr():
                view.copy_(grad.reshape(view.shape))  # a local gradient is in layout order

    def _use_sharded_grad_views(self, unused: set[int] | None = None) -> None:
        """``use_orig_params``: each original ``.grad`` views its piece of the sharded grad.

        Parameters that do not require grad now have no gradient, as in torch. One with no
        piece on this rank has none either under FSDP1 (as torch's); under FSDP2 its gradient
        is an empty DTensor, as torch's ``fully_shard`` gives every rank: the ranks must run
        the same DTensor collectives on it (``clip_grad_norm_``), and an optimizer that
        skipped it on some ranks only would step different parameter lists. A parameter in
        ``unused`` (no rank's backward gave it a gradient) keeps no gradient if it had none
        (see [Note: parameters without a gradient] in grads.py).
        """
        grads: dict[int, torch.Tensor] = {}
        flat_grad = self.flat_param.grad
        if flat_grad is not None:
            segment = self._segments[0]
            for index, view in zip(segment.indices, segment.sharded_piece_views(flat_grad)):
                param = self._orig_params[index]
                if unused and index in unused and param.grad is None:
                    continue
                if param.requires_grad and (view.numel() > 0 or self._has_empty_shards(index)):
                    grads[index] = self._sharded_grad(index, view)
        for index, param in enumerate(self._orig_params):
            assign_grad(param, grads.get(index))

    def run_post_accumulate_grad_hooks(self) -> None:
        """FSDP2: call the hooks registered on the DTensor parameters with
        ``register_post_accumulate_grad_hook`` once their sharded gradient is in ``.grad``
        (autograd never accumulates into them, the unit does), as torch's ``fully_shard``
        does; optimizers stepped in backward rely on it."""
        for param in self._orig_params:
            hooks = param._post_accumulate_grad_hooks
            if hooks and param.grad is not None:
                for hook in list(hooks.values()):
                    hook(param)

    def _has_empty_shards(self, index: int) -> bool:
        """Parameter ``index``'s gradient exists even where its piece here is empty: FSDP2's
        DTensors (every rank holds a local tensor, perhaps empty), or an empty parameter."""
        return self._dtensor_params is not None or self.slot(index).numel == 0
