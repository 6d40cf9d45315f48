"""``summon_full_params`` on a unit's original parameters (FSDP1): the full parameters, and
with ``with_grads`` the full gradients, shown to the modules as registered Parameters, and
what is edited there written back. A part of ``FlatParamHandle`` (see ``flat_param``),
beside ``OrigParamViews``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .._comm.groups import ShardingGroups
from .dtensor_params import DTensorParams
from .flat_segment import FlatParameter, FlatSegment
from .grads import assign_grad
from .handle_state import HandleState
from .orig_params import _assign_param, _assign_plain

__all__: list[str] = []


class SummonViews:
    """``FlatParamHandle``'s verbs for ``summon_full_params``."""

    if TYPE_CHECKING:  # supplied by FlatParamHandle
        label: str
        device: torch.device
        groups: ShardingGroups
        uses_sharded_strategy: bool
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

        def segment_of(self, index: int) -> FlatSegment: ...
        def reshard(self) -> None: ...
        def _assert_state(self, expected: HandleState, verb: str) -> None: ...
        def _unsharded_views(self) -> list[torch.Tensor]: ...
        def sync_orig_grads(self) -> None: ...
        def _use_sharded_params(self) -> None: ...
        def hold_storageless_views(self) -> None: ...
        def _use_sharded_grad_views(self, unused: set[int] | None = None) -> None: ...

    def expose_unsharded_params(self) -> None:
        """Make the full parameters visible as registered ``nn.Parameter`` s (for summon)."""
        self._assert_state(HandleState.UNSHARDED, "expose_unsharded_params")
        if self._dtensor_params is not None:
            raise RuntimeError(
                f"summon_full_params is FullyShardedDataParallel's; '{self.label}' was sharded "
                "by fully_shard: call module.unshard() (its parameters are then full tensors "
                "until module.reshard()), or gather a DTensor parameter with .full_tensor()"
            )
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
            assign_grad(param, view if param.requires_grad else None)
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
        parameters) storageless views until the next forward sets its views."""
        if self._use_orig_params:
            self._use_sharded_params()
            self._use_sharded_grad_views()
            return
        self.hold_storageless_views()
