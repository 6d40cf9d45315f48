"""One step's state shared by every unit under a root (``RootState``, owned by the root's
``UnitRuntime``): the order units ran forward in, prefetching, reductions in flight, the
end-of-backward callback.
"""

from __future__ import annotations

import threading
from typing import Protocol

from torch.autograd import Variable

from ..api import BackwardPrefetch
from .autograd_graph import NestedForwards
from .compile import eager
from .exec_order import ExecOrderValidator, validation_enabled
from .flat_param import FlatParamHandle, HandleState
from .storage_pool import POOL

__all__ = ["RootState", "reductions_in_flight"]


class UnitRuntime(Protocol):
    """What the step reads of a unit's runtime (``runtime.UnitRuntime``)."""

    handle: FlatParamHandle | None
    ran_pre_backward: bool
    unshard_in_backward: bool
    full_precision: bool
    max_reductions_in_flight: int | None

    def finish_backward(self) -> None: ...
    def reset_step(self) -> None: ...


# [Note: reductions in flight]
# A reduction holds its unit's unsharded gradient until it completes, so waiting for all of
# them at the end of backward would keep every unit's full gradient alive at once (the whole
# model's worth). Each post-backward therefore finalises all but the newest
# `reductions_in_flight` reductions (below): with one, a unit's reduce-scatter overlaps the
# next unit's gradient computation, and one unsharded gradient outlives its unit's hook.
def reductions_in_flight(
    backward_prefetch: BackwardPrefetch | None, override: int | None = None
) -> int:
    """How many reductions may stay in flight after a unit's post-backward.

    Backward keeps at most three unit-sized buffers alive besides activations: the unit's
    parameters, its gradient being computed, and either the next unit's prefetched
    parameters (BACKWARD_PRE: the all-gather overlaps this unit's gradient computation, and
    each reduction completes in its own post-backward) or the previous unit's gradient still
    being reduced (BACKWARD_POST and None: the reduction overlaps the next unit's gradient
    computation). ``override`` (FULLSHARD_REDUCTIONS_IN_FLIGHT) replaces it (memory for
    overlap)."""
    if override is not None:
        return override
    return 0 if backward_prefetch == BackwardPrefetch.BACKWARD_PRE else 1


class RootState:
    """State shared by every unit under one root for one step; owned by the root."""

    def __init__(
        self,
        units: list[UnitRuntime],
        backward_prefetch: BackwardPrefetch | None,
        forward_prefetch: bool = False,
        reductions_override: int | None = None,
    ):
        self.units = units
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.reductions_in_flight = reductions_in_flight(backward_prefetch, reductions_override)
        self.forward_order: list[UnitRuntime] = []
        """Units with parameters, in the order their forward first ran this step."""
        self.exec_order = ExecOrderValidator([unit.handle for unit in units])
        """Used under TORCH_DISTRIBUTED_DEBUG=DETAIL only (see [Note: execution-order
        validation] in exec_order.py)."""
        self._forward_ranges: dict[int, NestedForwards] = {}
        """Per thread (autograd numbers nodes per thread), where each unit's forward is in
        autograd's sequence numbers, this step."""
        self.previous_forward_order: list[UnitRuntime] = []
        """The last step's ``forward_order``: what forward prefetching expects to run next."""
        self.pending_reductions: list[UnitRuntime] = []
        self.end_of_backward_queued = False
        self.buffers_full_precision: bool | None = None
        """Whether buffers are in their own dtype (True) or in ``buffer_dtype`` (False);
        None before the first forward casts them."""
        self.forwards = 0
        """The root's forwards begun so far (a group's forward belongs to one of them)."""

    def begin_forward(self, training: bool) -> None:
        self.forwards += 1
        if training and validation_enabled():
            self.exec_order.begin_iteration()
        for unit in self.units:
            if unit.handle is not None:
                unit.handle.sync_requires_grad()
        if self.forward_order:
            self.previous_forward_order = self.forward_order
        self.forward_order = []
        self._forward_ranges = {}

    def forget_forward_ranges(self) -> None:
        self._forward_ranges = {}

    @property
    def forward_ranges(self) -> NestedForwards:
        """This thread's ``NestedForwards``."""
        return self._forward_ranges.setdefault(threading.get_ident(), NestedForwards())

    def prefetch_for_forward(self, unit: UnitRuntime) -> None:
        """``forward_prefetch``: issue the all-gather of the unit whose forward followed
        ``unit``'s in the previous step, so it runs while ``unit`` computes."""
        if not self.forward_prefetch or unit not in self.previous_forward_order:
            return
        index = self.previous_forward_order.index(unit)
        if index + 1 == len(self.previous_forward_order):
            return
        target = self.previous_forward_order[index + 1]
        handle = target.handle
        if handle is not None and handle.state == HandleState.SHARDED:
            handle.unshard(unit.full_precision)

    def record_forward(self, unit: UnitRuntime) -> None:
        if unit not in self.forward_order:
            self.forward_order.append(unit)

    def queue_end_of_backward(self) -> None:
        """Have autograd call ``finish_backward`` once the current backward pass is done."""
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self.finish_backward)

    def prefetch_for_backward(self, unit: UnitRuntime, when: BackwardPrefetch) -> None:
        """Issue the all-gather of the unit that backward reaches after ``unit``, if the
        configured ``backward_prefetch`` is ``when`` (BACKWARD_PRE: from ``unit``'s
        pre-backward, before its gradient is computed; BACKWARD_POST: from its post-backward)."""
        if self.backward_prefetch != when or unit not in self.forward_order:
            return
        index = self.forward_order.index(unit)
        if index == 0:
            return
        target = self.forward_order[index - 1]
        handle = target.handle
        if (
            handle is not None
            and not target.ran_pre_backward
            and target.unshard_in_backward
            and handle.state == HandleState.SHARDED
        ):
            handle.unshard(target.full_precision)

    def reductions_to_keep(self) -> int:
        """``reductions_in_flight``, or the largest cap a unit was given."""
        caps = [u.max_reductions_in_flight for u in self.units]
        return max((c for c in caps if c is not None), default=self.reductions_in_flight)

    def finalize_reductions(self, keep: int = 0) -> None:
        """Wait for all but the newest ``keep`` reductions, oldest first, and finalise their
        sharded gradients (see [Note: reductions in flight])."""
        while len(self.pending_reductions) > keep:
            unit = self.pending_reductions.pop(0)
            assert unit.handle is not None
            unit.handle.finalize_grad()

    @eager
    def finish_backward(self) -> None:
        """Wait for every reduction, finalise sharded gradients, reshard everything, and give
        the memory kept for unshards back (see [Note: reusing unsharded memory])."""
        self.finalize_reductions()
        for unit in self.units:
            unit.finish_backward()
        self.end_of_backward_queued = False
        POOL.clear()

    def reset_step(self) -> None:
        """After a forward or backward raised (FSDP2's ``reset_iter_state``): wait for the
        collectives in flight, discard the step's gradients not yet in ``.grad``, reshard
        every unit and forget the step, so the next forward starts afresh. Autograd drops a
        failed backward's queued callback, so ``finish_backward`` never ran."""
        for unit in self.units:
            unit.reset_step()
        POOL.clear()
        self.pending_reductions = []
        self.end_of_backward_queued = False
        self.forward_order = []
        self._forward_ranges = {}
