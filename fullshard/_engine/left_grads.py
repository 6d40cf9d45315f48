"""A unit's parameters' gradients, left where autograd put them for the reduce-scatter to
read, instead of copied into the unit's flat gradient in backward.

[Note: gradients reduced where autograd left them]
The backward of the node that made a unit's parameters from its leaf (``_SplitLeaf`` for the
flat layout, ``_Unflatten`` for ``fully_shard``'s dim-0 layout) writes every parameter's
gradient into one flat gradient, only for the reduce-scatter to read it back out. Over the
shared-memory transport, which copies its input into the cells anyway, that pass is not
needed: the node returns the flat gradient unwritten (autograd needs a gradient of the
leaf's size; fresh memory, not the pool's), keeps the parameters' gradients
(``LeftGrads.flat_grad``), and the reduce-scatter reads them where they lie
(``LeftGrads.take``, ``collectives.reduce_scatter_into(places=...)``), zeros where none
arrived. Same elements, same order of summation: the same bits. The flat gradient is left
unwritten only while nothing but that reduce-scatter reads it:

- only where the unit's last reduction could read places (``reads_places``: the
  shared-memory transport, a sharded strategy, no hook of the user's, no cast), and the leaf
  has no gradient yet (autograd would add the unwritten one to it at once);
- a second node into the same leaf in one backward call (a unit run twice in one forward)
  writes the first's (``materialize``) through its storage, which is the same memory
  wherever autograd keeps it now (in its sum of the two, or on the leaf), and writes its
  own: autograd sums them before the leaf's hook, and its sum would hold the unwritten one.
  "One backward call" is autograd's graph task, so that a reentrant checkpoint's nested
  backward, whose reduction runs while the outer call still holds another node's flat
  gradient, does not end the outer call's state;
- anomaly mode reads every node's output (for NaN): nothing is left there;
- every other reader of the leaf's gradient writes it first (accumulation without
  reduction, a reduction that cannot read places, a leaf gradient that is not the one
  returned); a dropped step drops the kept gradients with the leaf's.

Saved: one pass over each unit's gradient per backward (on the comm config's 2 ranks, the
copy took 65-69 ms of a 1.2-1.5 s step). Measured in alternated steps, the step moved by
-4.4% to +0.9%, within the spread of such runs (docs/benchmarks.md). The parameters'
gradients now live until the reduce-scatter ends, instead of a flat copy of them. The
unwritten flat gradient is fresh memory: untouched pages above glibc's mmap threshold, the
heap's memory below it.
"""

from __future__ import annotations

import torch

from .._comm.pieces import Places
from .storage_pool import POOL

__all__: list[str] = []

Grads = tuple[torch.Tensor | None, ...]


class LeftGrads:
    """One leaf's gradients left where autograd put them (see the note); a layout's
    subclass says how they are written into the flat gradient (``copy_in``: ``numel``
    elements, zeros where none arrived) and where each of its elements lies instead
    (``grad_places``; the elements past ``numel``, the padding to a multiple of the ranks,
    are zeros). A subclass, not callbacks: ``Dim0Unsharded`` is one, and a callback of its
    own held here would make a reference cycle the collector alone frees."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.able = True
        """Whether the layout lets a reduce-scatter read places (not: ``fully_shard``
        parameters sharded on another dim than 0)."""
        self.reads_places = False
        """Whether backward may leave the gradients: the unit's last reduction could read
        them where they lie (set by it)."""
        self._left: tuple[Grads, torch.UntypedStorage, torch.Tensor] | None = None
        """The gradients left, the storage of the flat gradient returned unwritten, and the
        leaf it was returned for."""
        self._in_flight: set[int] = set()
        """The autograd graph tasks (backward calls; a reentrant checkpoint's nested one is
        a task of its own) in which this leaf got a flat gradient that no reduction took
        yet: autograd sums a second one of the same task with it."""

    def copy_in(self, grads: Grads, flat: torch.Tensor) -> None:
        raise NotImplementedError

    def grad_places(self, grads: Grads) -> Places:
        raise NotImplementedError

    def flat_grad(self, grads: Grads, leaf: torch.Tensor) -> torch.Tensor:
        """Backward's: ``leaf`` 's gradient, ``grads`` written into it, or left."""
        task = torch._C._current_graph_task_id()
        in_flight = task in self._in_flight
        self._in_flight.add(task)
        self.materialize()  # an earlier node's: autograd may add this one to it
        if (
            self.reads_places
            and not in_flight  # another node's of this task, which autograd adds this to
            and leaf.grad is None  # else autograd adds this one to it at once
            and not torch.is_grad_enabled()
            and not torch.is_anomaly_enabled()  # it would read the unwritten one for NaNs
            and all(
                g is None or (g.dtype == leaf.dtype and g.layout == torch.strided) for g in grads
            )
        ):
            flat = torch.empty(leaf.numel(), dtype=leaf.dtype, device=leaf.device)
            self._left = (grads, flat.untyped_storage(), leaf)
            return flat
        # see [Note: reusing unsharded memory]; the reduction frees it into the pool again
        flat = POOL.empty(leaf.numel(), leaf.dtype, leaf.device)
        self.copy_in(grads, flat)
        return flat

    def materialize(self) -> None:
        """Write the gradients left into the flat gradient returned for them, wherever it is
        now: in autograd's sum of two nodes' (its storage is the same memory), on the leaf,
        or a copy of it on the leaf (autograd copies a gradient it cannot keep; the leaf had
        none, so the copy holds nothing else)."""
        left, self._left = self._left, None
        if left is None:
            return
        grads, storage, leaf = left
        current = leaf.grad
        if current is not None and current.untyped_storage().data_ptr() != storage.data_ptr():
            target = current  # the copy
        else:
            assert storage.nbytes() >= self.numel * leaf.element_size(), "a recycled gradient"
            target = torch.empty(0, dtype=leaf.dtype, device=leaf.device)
            target.set_(storage, 0, (self.numel,), (1,))
        with torch.no_grad():
            self.copy_in(grads, target)

    def take(self, flat: torch.Tensor, reads_places: bool) -> Places | None:
        """The leaf's gradient ``flat`` is taken off it for its reduction: where its elements
        lie if they were left and ``reads_places``, else None, with ``flat`` written (the
        flat gradient returned, or autograd's copy of it)."""
        task = torch._C._current_graph_task_id()
        if task < 0:  # outside backward: no task holds a flat gradient of the leaf now
            self._in_flight.clear()
        self._in_flight.discard(task)
        left, self._left = self._left, None
        if left is None:
            return None
        if reads_places and flat.untyped_storage().data_ptr() == left[1].data_ptr():
            return self.grad_places(left[0])
        with torch.no_grad():
            self.copy_in(left[0], flat)
        return None

    def drop(self) -> None:
        """The leaf's gradient is dropped (a failed step): so are the ones left for it."""
        self._left = None
        self._in_flight.clear()


class FlatLeftGrads(LeftGrads):
    """A flat layout's (``FullyShardedDataParallel``'s): its parameters back to back."""

    def __init__(self, numels: list[int]) -> None:
        super().__init__(sum(numels))
        self._numels = numels
        self._offsets = [sum(numels[:index]) for index in range(len(numels))]

    def copy_in(self, grads: Grads, flat: torch.Tensor) -> None:
        for grad, place in zip(grads, flat.split(self._numels)):
            if grad is None:
                place.zero_()
            else:
                place.copy_(grad)

    def grad_places(self, grads: Grads) -> Places:
        return [(at, grad) for at, grad in zip(self._offsets, grads) if grad is not None]
