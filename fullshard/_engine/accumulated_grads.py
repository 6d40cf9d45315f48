"""FSDP1's gradients inside ``no_sync()``, shown where torch's FSDP1 shows them. A part of
``FlatParamHandle`` (see ``flat_param``).

[Note: gradients accumulated under no_sync]
A backward inside ``no_sync()`` does not reduce: the unit's unsharded gradient stays on its
unsharded leaf, where autograd adds the next one. torch's FSDP1 shows that gradient to the
user meanwhile: ``flat_param.grad`` is the unsharded flat gradient while the parameter is
the shard, and with ``use_orig_params`` each original parameter's ``.grad`` is its view of
it, in the parameter's full shape while the parameter holds its shard piece (both through
``.data``, which skips the setter's shape check; torch's test
``TestFSDPUseOrigParamsNoSync::test_no_sync_correctness`` reads them). fullshard does the
same (``expose_accumulated_grad``, after each such backward), sets the sharded gradient of
earlier synchronised steps aside meanwhile, as torch's ``_saved_grad_shard``, and before the
unit next gathers or reduces (``adopt_exposed_grad``) takes back what the user did to the
shown gradients: set to None (``zero_grad(set_to_none=True)``: that parameter's part
dropped, with its part of the sharded gradient set aside, or all of both when every one is
None), zeroed or edited in place (the same memory), or replaced by a tensor of the same size
(copied in). The set-aside gradient then returns to ``.grad``, and the next reduction adds
to it. ``fully_shard`` keeps the accumulation inside, as torch's FSDP2 does: its ``.grad``
stays the sharded DTensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .flat_segment import FlatParameter, FlatSegment, Unsharded
from .grads import assign_grad

if TYPE_CHECKING:
    from .dtensor_params import DTensorParams
    from .layout import ParamSlot

__all__: list[str] = []


class AccumulatedGradViews:
    """``FlatParamHandle``'s verbs for [Note: gradients accumulated under no_sync]."""

    if TYPE_CHECKING:  # supplied by FlatParamHandle
        label: str
        flat_param: FlatParameter
        _segments: tuple[FlatSegment, ...]
        _orig_params: list[nn.Parameter]
        _use_orig_params: bool
        _dtensor_params: DTensorParams | None

        def _use_sharded_grad_views(self, unused: set[int] | None = None) -> None: ...
        def slot(self, index: int) -> ParamSlot: ...

    def _init_exposure_state(self) -> None:
        self._exposed: tuple[Unsharded, torch.Tensor] | None = None
        """The buffer whose leaf's gradient is shown, and that gradient as shown."""
        self._set_aside_grad: torch.Tensor | None = None
        """``flat_param.grad`` (the sharded gradient) while the unsharded one is shown."""

    def expose_accumulated_grad(self) -> None:
        """After a backward inside ``no_sync()``: show the accumulated unsharded gradient on
        ``.grad`` (FSDP1 only; see the note)."""
        if self._dtensor_params is not None:
            return
        held = [u for u in self._segments[0].buffers() if u.leaf.grad is not None]
        if len(held) != 1:  # none, or both precisions' (an eval pass in between): not shown
            return
        unsharded = held[0]
        grad = unsharded.leaf.grad
        assert grad is not None
        if self._exposed is None:
            self._set_aside_grad, self.flat_param.grad = self.flat_param.grad, None
        self._exposed = (unsharded, grad)
        if not self._use_orig_params:
            assign_grad(self.flat_param, grad)
            return
        segment = self._segments[0]
        for index, view in zip(segment.indices, segment.views_of_flat(grad)):
            param = self._orig_params[index]
            assign_grad(param, view if param.requires_grad else None)

    def adopt_exposed_grad(self) -> None:
        """Before the unit gathers or reduces again: take back what the user did to the shown
        gradients, and give ``.grad`` the sharded gradient again (see the note)."""
        if self._exposed is None:
            return
        unsharded, shown = self._exposed
        if self._use_orig_params:
            self._adopt_orig_grads(unsharded, shown)
        else:
            self._adopt_flat_grad(unsharded, shown)
        self._end_exposure()

    def drop_exposed_grad(self) -> None:
        """The accumulation is dropped (a failed step): ``.grad`` is the sharded one again."""
        if self._exposed is not None:
            self._exposed[0].leaf.grad = None
            self._end_exposure()

    def _end_exposure(self) -> None:
        self._exposed = None
        assign_grad(self.flat_param, self._set_aside_grad)
        self._set_aside_grad = None
        if self._use_orig_params:
            self._use_sharded_grad_views()

    def _adopt_flat_grad(self, unsharded: Unsharded, shown: torch.Tensor) -> None:
        current = self.flat_param.grad
        if current is None:  # dropped: the gradient of earlier steps too
            unsharded.leaf.grad = self._set_aside_grad = None
        elif current is not shown:
            _copy_into(unsharded, shown, current, f"flat parameter of FSDP unit '{self.label}'")

    def _adopt_orig_grads(self, unsharded: Unsharded, shown: torch.Tensor) -> None:
        segment = self._segments[0]
        held = [
            (index, view, self._orig_params[index].grad)
            for index, view in zip(segment.indices, segment.views_of_flat(shown))
            if self._orig_params[index].requires_grad
        ]
        if all(grad is None for _, _, grad in held):  # dropped: earlier steps' too
            unsharded.leaf.grad = self._set_aside_grad = None
            return
        set_aside = self._set_aside_grad
        pieces = segment.sharded_piece_views(set_aside) if set_aside is not None else None
        for index, view, grad in held:
            if grad is None:  # this parameter's gradient dropped, its earlier steps' too
                view.zero_()
                if pieces is not None:
                    pieces[segment.indices.index(index)].zero_()
            elif grad.data_ptr() != view.data_ptr() or grad.shape != view.shape:
                where = f"parameter '{self.slot(index).fqn}' of FSDP unit '{self.label}'"
                _check_size(grad, view, where)
                with torch.no_grad():
                    view.copy_(grad.detach().reshape(view.shape))


def _copy_into(unsharded: Unsharded, shown: torch.Tensor, value: torch.Tensor, where: str) -> None:
    """The user replaced the shown flat gradient by ``value``: it becomes the accumulation."""
    _check_size(value, shown, where)
    with torch.no_grad():
        shown.copy_(value.detach().reshape(shown.shape))
    unsharded.leaf.grad = shown


def _check_size(value: torch.Tensor, shown: torch.Tensor, where: str) -> None:
    if value.numel() != shown.numel():
        raise RuntimeError(
            f"inside no_sync() the .grad of the {where} is the unsharded gradient accumulated "
            f"so far ({shown.numel()} elements, shape {tuple(shown.shape)}), but a tensor of "
            f"shape {tuple(value.shape)} was assigned to it; assign a tensor of the unsharded "
            "shape, or None to drop the accumulation"
        )
