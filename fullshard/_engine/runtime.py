"""Runtime: the hooks and the communication schedule of one training step.

FULL_SHARD, per unit:

- pre-forward: all-gather (unless already unsharded), wait, point modules at the views;
- post-forward: reshard (non-root units only, see [Note: the root keeps its parameters]),
  and hook every output tensor that requires grad;
- pre-backward (first output hook to fire): all-gather again, prefetch the unit that runs
  next in backward, wait for our own parameters;
- post-backward (the unsharded leaf's post-accumulate-grad hook): issue the reduce-scatter,
  reshard;
- ... and finalise the previous unit's reduction (see [Note: reductions in flight]);
- end of backward (an autograd engine callback queued by the first hook of the pass): wait
  for the last reduction, accumulate sharded gradients, reshard whatever is still unsharded.
"""

from __future__ import annotations

import enum
import functools
import weakref
from typing import Any

import torch

from ..api import BackwardPrefetch
from .autograd_graph import (
    ForwardRecord,
    autograd_sequence_nr,
    gradient_sources,
    input_nodes,
    iter_tensors,
    will_run,
)
from .compile import eager
from .exec_order import validation_enabled
from .flat_param import FlatParamHandle, HandleState
from .sharding import Sharding
from .step import RootState
from .storage_pool import POOL

__all__: list[str] = []

# [Note: the root keeps its parameters]
# Under FULL_SHARD every unit frees its unsharded parameters after forward, except the root:
# the first thing backward does is use the root's parameters again (its last layers run first
# in backward), so freeing and re-gathering them would only add one all-gather of the root's
# parameters per step. The root is resharded at its post-backward instead. Forward passes that
# cannot be followed by a backward (no grad, or no output requiring grad) reshard every unit.


# [Note: forward inside backward]
# Activation checkpointing runs (part of) a unit's forward again inside backward, and the
# recomputation must see the unit's parameters unsharded and linked by autograd to the
# unsharded leaf, so that their gradients reach it:
# - The views the pre-backward hook gives modules are made with grad enabled (autograd runs
#   hooks with grad disabled; see `FlatParamHandle._unsharded_views`).
# - A unit's forward entered again after its pre-backward (non-reentrant checkpointing of a
#   whole unit) is a recomputation: it only makes sure the parameters are unsharded and
#   leaves the step's state alone (no hooks on its outputs, no reshard afterwards).
# - Reentrant checkpointing (`use_reentrant=True`, `CheckpointImpl.REENTRANT`) recomputes in
#   a backward of its own, so the leaf's gradient may arrive in several installments: one
#   from the step's graph, one from each reentrant region inside the unit. Resharding after
#   the first would free parameters that a later installment's recomputation (or a node of
#   the step's graph) still reads. post_forward records the nodes that deliver them in the
#   graph the forward built (`gradient_sources`: the leaf's AccumulateGrad and each reentrant
#   region's node), in a record the output hooks own (it dies with the graph); the
#   pre-backward hook counts those the backward in progress will run, and post_backward
#   reshards only after the last installment. The reductions are linear, so each
#   installment is reduced as it arrives (two reduce-scatters where a unit's parameters are
#   used both inside and outside a reentrant region).


# [Note: resharding units with frozen parameters]
# A unit reshards in its post-backward hook, which fires once autograd has accumulated the
# gradient of its trainable leaf: every node that read a trainable view has run by then. A
# frozen parameter's view gets no gradient, so a node that reads it only to compute an input
# gradient (x @ W for a frozen W) may run after that hook, or with a fully frozen unit there
# is no hook at all. Such a unit also waits for the gradients of its forward's inputs (a
# multi-grad hook on the inputs that require grad): once both have arrived no node of the
# unit's backward is left. A unit whose inputs need no gradient has nothing reading frozen
# views after its leaf's hook. Before this, such units stayed unsharded until the end of
# backward: with LoRA (every unit mixes frozen and trainable) the whole model at once.


class TrainingState(enum.Enum):
    """What an FSDP unit is doing."""

    IDLE = enum.auto()
    """Between steps: parameters sharded (the root's may be kept until backward)."""
    FORWARD_BACKWARD = enum.auto()
    """Inside forward or backward: hooks are driving unshard/reshard and reductions."""
    SUMMON_FULL_PARAMS = enum.auto()
    """Inside `summon_full_params`: the full parameters are exposed to the user."""


IN_STEP = (TrainingState.IDLE, TrainingState.FORWARD_BACKWARD)
"""Where the step's hooks may start: never inside `summon_full_params`."""


class HandleTrainingState(enum.Enum):
    """Where in the step a unit's flat parameter is."""

    IDLE = enum.auto()
    """Not in use by forward or backward."""
    FORWARD = enum.auto()
    """The unit's forward is running with its parameters unsharded."""
    BACKWARD_PRE = enum.auto()
    """Its pre-backward hook ran: parameters unsharded for gradient computation."""
    BACKWARD_POST = enum.auto()
    """Its gradient was computed and its reduction issued."""
    SUMMON_FULL_PARAMS = enum.auto()
    """Its full parameters are exposed by `summon_full_params`."""


def _wait_for_event(event: Any) -> None:
    """The current stream waits for ``event`` (on the CPU: the host waits, which is at once:
    CPU work runs in program order)."""
    device = getattr(event, "device", None)
    if device is None or device.type == "cpu":
        event.synchronize()
    else:
        torch.get_device_module(device.type).current_stream().wait_event(event)


def _prefetch(units: list[UnitRuntime], full_precision: bool) -> None:
    """Issue the all-gathers of ``units`` not yet unsharded (explicit prefetching)."""
    for unit in units:
        handle = unit.handle
        if handle is not None and handle.state == HandleState.SHARDED:
            handle.unshard(full_precision)


class UnitRuntime:
    """Per-unit runtime state and the hooks that drive it."""

    def __init__(self, handle: FlatParamHandle | None, sharding: Sharding) -> None:
        self.handle = handle
        self.reshard_after_forward: bool | None = sharding.reshard_after_forward
        """Whether post-forward frees the unsharded parameters. None: yes, except the root's
        (see [Note: the root keeps its parameters]); FSDP2's explicit
        ``reshard_after_forward`` and ``set_reshard_after_forward`` give a bool."""
        self.reshard_without_backward = sharding.reshard_without_backward
        """A forward no backward can follow (grad disabled, or no output requiring grad)
        reshards whatever ``reshard_after_forward`` says (FSDP1's rule). False (FSDP2, as
        torch's): it follows ``reshard_after_forward``, so the root, or a unit set not to
        reshard, stays unsharded across eval or generation forwards."""
        self.is_root: bool | None = None
        """None until lazy initialisation at the first forward decides."""
        self.beside_root = False
        """A sibling of the root (another unit of the root's ``fully_shard`` call, see [Note:
        sibling units]): it keeps its parameters after forward as the root does."""
        self.root_state: RootState | None = None
        self.training_state = TrainingState.IDLE
        self.handle_training_state = HandleTrainingState.IDLE
        self.sync_gradients = True
        """False inside `no_sync()`: keep accumulating unsharded gradients locally."""
        self.reshard_after_backward = True
        """False: keep the parameters unsharded after backward (FSDP2's
        ``set_reshard_after_backward``; gathered again at the next forward only if an optimizer
        step changed the shard meanwhile)."""
        self.unshard_in_backward = True
        """False: backward computes this unit's gradients without its parameters (FSDP2's
        ``set_unshard_in_backward``, e.g. an embedding), so its pre-backward gathers nothing."""
        self.max_reductions_in_flight: int | None = None
        """FSDP2's ``set_reduce_scatter_max_input_buffers``: the reductions that may stay in
        flight after a post-backward (the step uses the largest any unit asks for; None:
        the engine's default, see [Note: reductions in flight])."""
        self.post_optim_event: Any = None
        """FSDP2's ``set_post_optim_event``: waited for at the root's next forward."""
        self.forward_prefetch_targets: list[UnitRuntime] = []
        self.backward_prefetch_targets: list[UnitRuntime] = []
        """Units whose all-gathers this unit's pre-forward / pre-backward issues (FSDP2's
        ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)."""
        self.ran_pre_backward = False
        self.exposes_full_params = False
        """True inside `summon_full_params` where this rank sees the full parameters."""
        self.full_precision = False
        """This step's forward runs in the parameters' own dtype despite mixed precision
        (eval with FSDP_USE_FULL_PREC_IN_EVAL=1); backward follows the forward."""
        self.recomputing = False
        """Inside a forward entered again during this unit's backward (activation
        checkpointing; see [Note: forward inside backward])."""
        self.forward_started_at = 0
        """Autograd's sequence number when this unit's current forward began."""
        self.forward_records: list[weakref.ref[ForwardRecord]] = []
        """One per forward whose graph may still be backpropagated (dead ones are pruned)."""
        self.expected_installments = 0
        """How many times the backward in progress delivers the unit's gradient (counted at
        the pre-backward hook, from the forwards' records)."""
        self.received_installments = 0
        self.pending_input_grads: set[ForwardRecord] = set()
        """Units with frozen parameters: the forwards whose inputs' gradients the backward in
        progress has yet to compute (see [Note: resharding units with frozen parameters])."""
        if handle is not None:
            handle.register_post_backward_hook(self.post_backward)

    @property
    def root(self) -> RootState:
        if self.root_state is None:
            raise RuntimeError("fullshard internal error: unit used before lazy initialisation")
        return self.root_state

    def _move_to(
        self,
        state: TrainingState,
        handle_state: HandleTrainingState,
        start: tuple[TrainingState, ...],
    ) -> None:
        """The one place the unit's training state changes: each verb names the states it
        may start from, so a hook running where it must not (a step inside
        ``summon_full_params``, a summon inside the step) fails here, not later."""
        assert self.training_state in start, (
            f"fullshard internal error: {state.name} from {self.training_state.name} "
            f"(allowed from {[s.name for s in start]})"
        )
        self.training_state = state
        self.handle_training_state = handle_state

    def begin_summon(self, expose: bool) -> None:
        """``summon_full_params`` took this unit's full parameters (``expose``: this rank
        sees them; not the other ranks under ``rank0_only``)."""
        self._move_to(
            TrainingState.SUMMON_FULL_PARAMS,
            HandleTrainingState.SUMMON_FULL_PARAMS,
            start=(TrainingState.IDLE,),
        )
        self.exposes_full_params = expose

    def end_summon(self) -> None:
        self._move_to(
            TrainingState.IDLE,
            HandleTrainingState.IDLE,
            start=(TrainingState.SUMMON_FULL_PARAMS,),
        )
        self.exposes_full_params = False

    def in_backward(self) -> bool:
        """Between this unit's pre-backward and the end of backward."""
        return self.handle_training_state in (
            HandleTrainingState.BACKWARD_PRE,
            HandleTrainingState.BACKWARD_POST,
        )

    @eager
    def pre_forward(self, full_precision: bool = False, training: bool = False) -> None:
        if self.in_backward():
            self._pre_recompute()
            return
        # A recomputation's forward may never reach its post-forward (non-reentrant
        # checkpointing stops as soon as it has what backward needs).
        self.recomputing = False
        if self.is_root:
            self.root.begin_forward(training)
            if self.post_optim_event is not None:
                _wait_for_event(self.post_optim_event)
                self.post_optim_event = None
        self._move_to(TrainingState.FORWARD_BACKWARD, HandleTrainingState.FORWARD, start=IN_STEP)
        self.full_precision = full_precision
        self.forward_started_at = autograd_sequence_nr()
        handle = self.handle
        if handle is None:
            return
        self.root.record_forward(self)
        if training and validation_enabled():
            self.root.exec_order.record(handle)
        if handle.state != HandleState.SHARDED and (
            not handle.unsharded_matches(full_precision) or handle.shard_changed_since_unshard()
        ):
            # Kept from a forward in the other precision (train <-> eval), or across an
            # optimizer step (reshard_after_backward False): gather the current values.
            handle.reshard()
        if handle.state == HandleState.SHARDED:
            handle.unshard(full_precision)
        self.root.prefetch_for_forward(self)  # issued before we block on our own all-gather
        _prefetch(self.forward_prefetch_targets, full_precision)
        handle.wait_unshard()
        handle.use_unsharded_views()

    def _pre_recompute(self) -> None:
        """A forward during this unit's backward (see [Note: forward inside backward])."""
        self.recomputing = True
        handle = self.handle
        if handle is None:
            return
        if handle.state == HandleState.SHARDED:
            handle.unshard(self.full_precision)
        handle.wait_unshard()
        handle.use_unsharded_views()

    @eager
    def post_forward(self, output: Any, inputs: Any = ()) -> Any:
        if self.recomputing:
            self.recomputing = False
            return output
        requires_grad = [t for t in iter_tensors(output) if t.requires_grad]
        will_backward = torch.is_grad_enabled() and bool(requires_grad)
        handle = self.handle
        if will_backward:
            record = self._record_forward(inputs, requires_grad)
            for tensor in requires_grad:
                tensor.register_hook(functools.partial(self._pre_backward_hook, record))
        if self.is_root:  # every unit's walk is done: drop the nodes the ranges hold
            self.root.forget_forward_ranges()
        # SHARDED already: a forward run inside this one (a registered forward method such as
        # generate calling the module) resharded it.
        if handle is None or handle.state == HandleState.SHARDED:
            pass
        elif self._reshards_after_forward(will_backward):
            handle.reshard(after_forward=True)
        else:
            handle.register_orig_params()
        if self.is_root and not will_backward:
            POOL.clear()  # no backward follows: see [Note: reusing unsharded memory]
        # From IDLE too: a unit whose forward runs again inside its own forward (recursion)
        # is back to IDLE after the inner call.
        self._move_to(TrainingState.IDLE, HandleTrainingState.IDLE, start=IN_STEP)
        return output

    def _reshards_after_forward(self, will_backward: bool) -> bool:
        if not will_backward and self.reshard_without_backward:
            return True
        if self.reshard_after_forward is None:
            return not (self.is_root or self.beside_root)
        return self.reshard_after_forward

    def _record_forward(self, inputs: Any, outputs: list[torch.Tensor]) -> ForwardRecord:
        """What backward needs to know of this forward to reshard at the right moment (see
        [Note: forward inside backward], [Note: resharding units with frozen parameters])."""
        record = ForwardRecord()
        needing_grad = [t for t in iter_tensors(inputs) if t.requires_grad]
        nodes = input_nodes(needing_grad)
        handle = self.handle
        ranges = self.root.forward_ranges
        if handle is not None and handle.unsharded_leaf.requires_grad:
            record.sources = gradient_sources(
                outputs, handle.unsharded_leaf, self.forward_started_at, ranges
            )
        if handle is not None and handle.has_frozen_segment and needing_grad:
            record.inputs, record.input_nodes = needing_grad, nodes
        ranges.add(self.forward_started_at, autograd_sequence_nr(), nodes)
        self.forward_records = [ref for ref in self.forward_records if ref() is not None]
        self.forward_records.append(weakref.ref(record))
        return record

    def _count_installments(self) -> None:
        """At the pre-backward hook: how many gradient installments and input gradients the
        backward in progress will deliver, from the records of the forwards it runs through
        (a forward never backpropagated counts nothing)."""
        records = [r for r in (ref() for ref in self.forward_records) if r is not None]
        sources = {node for record in records for node in record.sources}
        self.expected_installments = sum(will_run(node) for node in sources)
        self.received_installments = 0
        for record in records:
            if record.inputs and any(will_run(node) for node in record.input_nodes):
                self.pending_input_grads.add(record)
                record.input_hook = torch.autograd.graph.register_multi_grad_hook(
                    record.inputs, functools.partial(self._input_grads_computed, record)
                )

    @eager
    def _input_grads_computed(self, record: ForwardRecord, grads: Any) -> None:
        if record.input_hook is not None:
            record.input_hook.remove()
            record.input_hook = None
        self.pending_input_grads.discard(record)
        self._reshard_if_done()

    def _reshard_if_done(self) -> None:
        """After the unit's backward: every gradient installment of its trainable leaf and
        the gradients of its inputs (units with frozen parameters) have arrived."""
        handle = self.handle
        if (
            handle is not None
            and self.reshard_after_backward
            and handle.state != HandleState.SHARDED
            and self.received_installments >= self.expected_installments
            and not self.pending_input_grads
        ):
            handle.reshard()

    def _pre_backward_hook(self, record: ForwardRecord, grad: torch.Tensor) -> None:
        # ``record`` is unused here: the hook holds it so it lives as long as the graph.
        self.pre_backward()

    @eager
    def pre_backward(self) -> None:
        if self.ran_pre_backward:
            return
        self.ran_pre_backward = True
        self._count_installments()
        root = self.root
        root.queue_end_of_backward()
        self._move_to(
            TrainingState.FORWARD_BACKWARD, HandleTrainingState.BACKWARD_PRE, start=IN_STEP
        )
        handle = self.handle
        if handle is None:
            return
        if handle.state == HandleState.SHARDED:
            if not self.unshard_in_backward:
                _prefetch(self.backward_prefetch_targets, self.full_precision)
                return
            handle.unshard(self.full_precision)
        else:  # kept unsharded since its forward (or prefetched)
            handle.check_orig_params_kept()
        root.prefetch_for_backward(self, BackwardPrefetch.BACKWARD_PRE)  # before we block
        _prefetch(self.backward_prefetch_targets, self.full_precision)
        handle.wait_unshard()
        handle.use_unsharded_views()

    @eager
    def post_backward(self) -> None:
        handle = self.handle
        assert handle is not None
        root = self.root
        root.queue_end_of_backward()
        self._move_to(
            TrainingState.FORWARD_BACKWARD, HandleTrainingState.BACKWARD_POST, start=IN_STEP
        )
        if self.sync_gradients:
            handle.reduce_grad()
            root.pending_reductions.append(self)
            root.finalize_reductions(keep=root.reductions_to_keep())
        else:
            handle.accumulate_unsharded_grad()
            handle.expose_accumulated_grad()  # see [Note: gradients accumulated under no_sync]
        root.prefetch_for_backward(self, BackwardPrefetch.BACKWARD_POST)
        self.received_installments += 1
        self._reshard_if_done()

    def reset_step(self) -> None:
        """This unit's part of ``RootState.reset_step``."""
        handle = self.handle
        if handle is not None:
            handle.discard_unreduced_grads()
            if handle.state != HandleState.SHARDED:
                handle.reshard()
        self._forget_backward()
        self.recomputing = False
        self._move_to(TrainingState.IDLE, HandleTrainingState.IDLE, start=tuple(TrainingState))

    def _forget_backward(self) -> None:
        self.ran_pre_backward = False
        self.expected_installments = 0
        self.received_installments = 0
        for record in self.pending_input_grads:  # inputs whose gradients never came
            if record.input_hook is not None:
                record.input_hook.remove()
                record.input_hook = None
        self.pending_input_grads = set()

    @eager
    def finish_backward(self) -> None:
        handle = self.handle
        if handle is not None:
            if self.sync_gradients and handle.has_unsharded_grad():
                # Gradients accumulated under no_sync() that this pass did not touch.
                handle.reduce_grad()
                handle.finalize_grad()
            if handle.state != HandleState.SHARDED and self.reshard_after_backward:
                handle.reshard()
            elif handle.state != HandleState.SHARDED:
                handle.wait_unshard()
                handle.register_orig_params()  # kept for the next forward
        self._forget_backward()
        self._move_to(TrainingState.IDLE, HandleTrainingState.IDLE, start=IN_STEP)
