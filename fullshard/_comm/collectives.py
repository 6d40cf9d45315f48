"""Asynchronous collectives over explicit tensors and a group, with byte counters.

Every function issues its collective and returns a `Pending`: callers issue early and wait
where the data is needed. Three transports carry them: on gloo groups whose ranks share a
host, all-gathers and reduce-scatters of CPU tensors go through shared memory
([Note: shared-memory transport] in ``shared_memory.py``); other gloo all-gathers and
reduce-scatters run as rings of ``isend``/``irecv`` ([Note: rings on gloo]); everything
else is c10d's own collective with ``async_op=True``. Each call is recorded in
``COUNTERS`` (one per process) with the bytes one rank sends, by the ring estimate:

- all-gather of a padded buffer of B bytes over N ranks: ``B * (N - 1) / N``
- reduce-scatter of B bytes over N ranks: ``B * (N - 1) / N``
- all-reduce of B bytes over N ranks: ``2 * B * (N - 1) / N``
- gather of shards of B bytes to one rank: ``B`` from every other rank, 0 from that rank

Reduce-scatter, worked example with 2 ranks and a 4-element input::

    before: rank0 [1, 2, 3, 4], rank1 [5, 6, 7, 8]
    after:  rank0 [6, 8],       rank1 [10, 12]
"""

from __future__ import annotations

import contextlib
import functools
import weakref
import zlib
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from .. import _switches as switches
from . import shared_memory as _shm
from .pieces import Places, Receiver

__all__: list[str] = []


# c10d's collectives, looked up at each call (as torch's FSDP does), so that code wrapping
# ``dist.all_gather_single`` (torch's tests count collectives so) sees fullshard's too. The
# ``*_tensor`` names are deprecated in newer torch in favour of ``*_single``.
def _all_gather_single(*args: Any, **kwargs: Any) -> dist.Work | None:
    c10d = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return c10d(*args, **kwargs)


def _reduce_scatter_single(*args: Any, **kwargs: Any) -> dist.Work | None:
    c10d = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return c10d(*args, **kwargs)


_KEPT_LABELS = 100_000


@dataclass
class CollectiveCounters:
    """Calls and bytes sent per rank, by collective kind, since the last ``reset``."""

    calls: Counter[str] = field(default_factory=Counter)
    bytes_sent: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    labels: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=_KEPT_LABELS))
    """``(kind, label)`` per call in issue order, e.g. ``("all_gather", "layers.3")``: the
    last ``_KEPT_LABELS`` calls, so a long run does not grow it without bound."""

    def record(self, kind: str, label: str, num_bytes: float) -> None:
        self.calls[kind] += 1
        self.bytes_sent[kind] += num_bytes
        self.labels.append((kind, label))

    def reset(self) -> None:
        self.calls.clear()
        self.bytes_sent.clear()
        self.labels.clear()

    @property
    def total_bytes(self) -> float:
        return float(sum(self.bytes_sent.values()))


COUNTERS = CollectiveCounters()


# [Note: bounded collectives]
# Every collective here returns a `Pending`, whose `wait()` ends within a bound: the process
# group's own timeout (``init_process_group(timeout=...)``; torch's default is 30 minutes
# for gloo, 10 for NCCL), or ``FULLSHARD_COLLECTIVE_TIMEOUT`` seconds where set. When it
# cannot complete, because a peer died (gloo sees the closed connection at once) or stopped
# participating (the bound runs out), every rank still waiting raises `CollectiveError`
# naming the operation, the unit and the peers, e.g. "all-gather of module blocks.3 on rank 0
# did not complete within 60 s: rank 1 is not responding". The process group is unusable afterwards: the
# error is meant to end the process (a launcher such as torchrun restarts the job).


class CollectiveError(RuntimeError):
    """A collective of fullshard's did not complete: a peer died or did not take part."""


_NAMES = {
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_reduce": "all-reduce",
    "gather": "gather",
}


def collective_timeout() -> timedelta | None:
    """``FULLSHARD_COLLECTIVE_TIMEOUT`` (seconds) as a bound on each wait, or None for the
    process group's own timeout (read as fullshard's switches are: see _switches.py)."""
    return switches.current().collective_timeout


class CollectiveMismatchError(RuntimeError):
    """Ranks were about to run different collectives (``FULLSHARD_DEBUG=1``)."""


# [Note: mismatch detection]
# Every rank must issue the same collectives in the same order: a rank that skips an FSDP
# unit (rank-dependent control flow), or that built another model, wrap policy, precision or
# strategy, pairs its collectives with the wrong ones on the other ranks, which then hang or
# silently mix tensors. With FULLSHARD_DEBUG=1 (or TORCH_DISTRIBUTED_DEBUG=DETAIL) each rank
# first all-gathers a signature of the collective it is about to issue (kind, module,
# element count, dtype) and compares: on any difference, every rank raises
# `CollectiveMismatchError` listing what each rank was doing. Checks pair with checks, so a
# rank that runs ahead is caught at its next collective. Cost: one small all-gather per
# collective (measured in docs/reliability.md).

_KINDS = ["all_gather", "reduce_scatter", "all_reduce", "gather"]


def debug_checks_enabled() -> bool:
    return switches.current().debug_checks


def _check_agreement(kind: str, label: str, tensor: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Raise `CollectiveMismatchError` on every rank unless all are about to issue the same
    collective (see [Note: mismatch detection])."""
    dtype_code = zlib.crc32(str(tensor.dtype).encode())
    signature = torch.tensor(
        [_KINDS.index(kind), zlib.crc32(label.encode()), tensor.numel(), dtype_code],
        dtype=torch.int64,
        device=tensor.device,
    )
    gathered = [torch.empty_like(signature) for _ in range(dist.get_world_size(group))]
    mine = f"{_describe(kind, label)} of {tensor.numel()} x {tensor.dtype}"
    with named(f"the FULLSHARD_DEBUG check before the {mine}", group):
        dist.all_gather(gathered, signature, group=group)
    if all(torch.equal(other, signature) for other in gathered):
        return
    everyone: list[Any] = [None] * len(gathered)
    with named(f"the FULLSHARD_DEBUG check before the {mine}", group):
        dist.all_gather_object(everyone, f"rank {dist.get_rank()}: {mine}", group=group)
    lines = "\n".join(f"  {line}" for line in everyone)
    raise CollectiveMismatchError(
        "fullshard (FULLSHARD_DEBUG): the ranks were about to run different collectives:\n"
        f"{lines}\nEvery rank must run the same FSDP units in the same order, with the same "
        "model, wrap policy, sharding strategy and precision: look for rank-dependent control "
        "flow around these modules, or configuration that differs between ranks."
    )


def _describe(kind: str, label: str) -> str:
    unit = "the root module" if label == "(root)" else f"module {label}"
    return f"{_NAMES.get(kind, kind)} of {unit}"


class Pending:
    """A collective in flight. ``wait()`` finishes it or raises `CollectiveError` (see
    [Note: bounded collectives])."""

    def __init__(self, kind: str, label: str, group: dist.ProcessGroup) -> None:
        self.kind, self.label, self.group = kind, label, group

    def wait(self) -> bool:
        raise NotImplementedError


class _WorkPending(Pending):
    """On c10d work handles: for a ring, ``wait()`` runs its remaining steps."""

    def __init__(
        self,
        kind: str,
        label: str,
        group: dist.ProcessGroup,
        steps: Iterator[list[dist.Work]],
        waits_on: list[int] | None = None,
    ) -> None:
        super().__init__(kind, label, group)
        self._waits_on = waits_on
        """Global ranks this rank receives from, where known (rings); else the group."""
        self._steps = steps
        self._pending: list[dist.Work] | None = self._next()

    def _next(self) -> list[dist.Work] | None:
        try:
            return next(self._steps, None)
        except RuntimeError as error:
            raise self._error(error, None) from error

    def wait(self) -> bool:
        timeout = collective_timeout()
        drain_transports()
        while self._pending is not None:
            for work in self._pending:
                try:
                    work.wait() if timeout is None else work.wait(timeout)
                except RuntimeError as error:
                    raise self._error(error, timeout) from error
            self._pending = self._next()
        return True

    def _error(self, error: Exception, timeout: timedelta | None) -> CollectiveError:
        return _named_error(
            error, _describe(self.kind, self.label), self.group, self._waits_on, timeout
        )


class _SharedMemoryPending(Pending):
    """On the shared-memory transport: ``wait()`` copies the pieces out as they arrive."""

    def __init__(
        self,
        kind: str,
        label: str,
        group: dist.ProcessGroup,
        transport: _shm.Transport,
        issue: Callable[[], _shm.Op],
    ) -> None:
        super().__init__(kind, label, group)
        self._transport = transport
        with _transport_errors(group, None):
            self._op = issue()

    def wait(self) -> bool:
        timeout = collective_timeout()
        with _transport_errors(self.group, timeout):
            self._transport.wait(self._op, _seconds(timeout))
        return True


def _seconds(timeout: timedelta | None) -> float | None:
    return None if timeout is None else timeout.total_seconds()


@contextlib.contextmanager
def _transport_errors(group: dist.ProcessGroup | None, timeout: timedelta | None) -> Iterator[None]:
    """The transport's failures as fullshard's public errors, naming the collective."""
    try:
        yield
    except _shm.TransportMismatchError as error:
        raise CollectiveMismatchError(str(error)) from None
    except _shm.TransportError as error:
        op = error.op
        what = _describe(op.kind, op.label) if op is not None else "a shared-memory collective"
        peers = [error.peer] if error.peer >= 0 else None
        raise _named_error(error, what, group, peers, timeout) from error


# [Note: draining]
# A rank that blocks in some other collective (gloo's, or fullshard's blocking exchanges)
# while pieces of its shared-memory collectives are still unposted or unread can deadlock
# ranks that wait for those pieces: with several groups (hybrid sharding) the waits form a
# cycle. So before fullshard blocks anywhere else (`_WorkPending.wait`, `named`, the
# FULLSHARD_DEBUG check), it finishes every outstanding shared-memory collective. Issuing
# never blocks, so collectives of the user's own inside a unit's forward pair up as usual.


def drain_transports() -> None:
    """Finish every outstanding shared-memory collective (see [Note: draining])."""
    timeout = collective_timeout()
    with _transport_errors(None, timeout):
        _shm.drain_all(_seconds(timeout))


def _named_error(
    error: Exception,
    what: str,
    group: dist.ProcessGroup | None,
    waits_on: list[int] | None,
    timeout: timedelta | None,
) -> CollectiveError:
    """A `CollectiveError` saying which operation failed on this rank, and why."""
    ranks = waits_on
    if ranks is None:
        me = dist.get_rank()
        members = dist.get_process_group_ranks(group or dist.group.WORLD)
        ranks = [r for r in members if r != me]
    if len(ranks) == 1:
        peers = f"rank {ranks[0]} is"
    elif len(ranks) <= 8:
        peers = f"one of ranks {', '.join(str(r) for r in ranks)} is"
    else:
        peers = f"one of the other {len(ranks)} ranks of the group is"
    text = str(error)
    if isinstance(error, _shm.TransportError) and error.reason == "gone":
        reason = f"failed: {peers} gone (its process died or exited)"
    elif "Timed out" in text or "timed out" in text or "Timeout" in text:
        bound = f"{timeout.total_seconds():g} s" if timeout else "the process group's timeout"
        reason = f"did not complete within {bound}: {peers} not responding"
    elif "closed" in text or "reset" in text or "Broken pipe" in text:
        reason = f"failed: {peers} gone (its process died or exited)"
    else:
        reason = "failed"
    return CollectiveError(
        f"fullshard: {what} on rank {dist.get_rank()} {reason}. Check that rank's log; "
        f"the job cannot continue. (Underlying error: {text.strip()})"
    )


@contextlib.contextmanager
def named(what: str, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """For fullshard's blocking ``torch.distributed`` calls (object exchanges, broadcasts,
    barriers: bounded by the process group's timeout): a failure that comes from a lost or
    silent peer becomes a `CollectiveError` naming ``what``; other errors pass unchanged."""
    try:
        drain_transports()
        yield
    except CollectiveError:
        raise
    except RuntimeError as error:
        if not lost_a_peer(error):
            raise
        raise _named_error(error, what, group, None, None) from error


PEER_LOST = ("Connection closed", "Connection reset", "Broken pipe", "Timed out", "timed out")
"""What gloo and NCCL say when a peer died or stopped taking part."""


def ranks_problem(problems: list[str]) -> str:
    """The one message every rank raises for ``problems`` (what each rank found, by rank;
    "" for none): the text itself where every rank found the same, else each text after the
    ranks that found it. "" if no rank found any."""
    found: dict[str, list[str]] = {}
    for rank, text in enumerate(problems):
        if text:
            found.setdefault(text, []).append(str(rank))
    if len(found) == 1 and len(next(iter(found.values()))) == len(problems):
        return next(iter(found))
    return "; ".join(f"rank {', '.join(ranks)}: {text}" for text, ranks in found.items())


def lost_a_peer(error: BaseException) -> bool:
    return any(text in str(error) for text in PEER_LOST)


def _tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def gathers_into_sink(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether ``all_gather_into`` over ``group`` can deliver ``tensor`` 's shards to a
    ``Receiver`` (the shared-memory transport copies each peer's piece out of its cell anyway,
    so it can copy it where the caller wants it; the rings receive each piece where it goes),
    and ``output`` is never written. Every rank of the group must ask at the same point (the
    transport may be set up here)."""
    return _shm.transport_for(group, tensor, named) is not None or _uses_ring(group, tensor)


def all_gather_into(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    receiver: Receiver | None = None,
) -> Pending:
    """All-gather equal ``shard`` s from every rank of ``group`` into ``output`` (rank order),
    or into ``receiver`` where ``gathers_into_sink`` said so (``output`` then only gives
    sizes)."""
    num_ranks = dist.get_world_size(group)
    if num_ranks == 1 and receiver is None:  # nothing to communicate (torch's FSDP2 calls none)
        output.copy_(shard.view(-1)[: output.numel()])
        return completed("all_gather", label, group)
    if debug_checks_enabled():
        _check_agreement("all_gather", label, output, group)
    COUNTERS.record("all_gather", label, _tensor_bytes(output) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::all_gather({label})"):
        transport = _shm.transport_for(group, output, named)
        if transport is not None:
            sink = receiver.receive if receiver is not None else None
            issue = functools.partial(transport.all_gather, output, shard, label, sink)
            return _SharedMemoryPending("all_gather", label, group, transport, issue)
        if _uses_ring(group, output):
            tag = _next_tag(group)
            if receiver is not None:
                steps = _ring_all_gather_into_places(receiver, shard, group, tag)
            else:
                steps = _ring_all_gather(output, shard, group, tag)
            return _WorkPending("all_gather", label, group, steps, [_neighbours(group)[3]])
        assert receiver is None, "a receiver needs fullshard's transports (gathers_into_sink)"
        work = _all_gather_single(output, shard, group=group, async_op=True)
    return issued("all_gather", label, group, work)


def issued(kind: str, label: str, group: dist.ProcessGroup, work: dist.Work | None) -> Pending:
    """A c10d collective issued with ``async_op=True``, as a ``Pending``."""
    assert work is not None
    return _WorkPending(kind, label, group, iter([[work]]))


class _Completed(Pending):
    def wait(self) -> bool:
        return True


def completed(kind: str, label: str, group: dist.ProcessGroup) -> Pending:
    """A collective that finished when it was issued (a synchronous custom one)."""
    return _Completed(kind, label, group)


def gather_to_first_rank(
    outputs: list[torch.Tensor] | None, shard: torch.Tensor, group: dist.ProcessGroup, label: str
) -> Pending:
    """Gather equal ``shard`` s to the group's first rank, into ``outputs`` (one per rank, in
    rank order; None on the other ranks, which only send)."""
    first = dist.get_global_rank(group, 0)
    if debug_checks_enabled():
        _check_agreement("gather", label, shard, group)
    sent = 0 if dist.get_rank(group) == 0 else _tensor_bytes(shard)
    COUNTERS.record("gather", label, sent)
    with record_function(f"fullshard::gather({label})"):
        work = dist.gather(shard, outputs, dst=first, group=group, async_op=True)
    return issued("gather", label, group, work)


def reduces_from_places(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    """Whether ``reduce_scatter_into`` over ``group`` can read ``tensor`` 's elements from
    ``places`` (the shared-memory transport copies them into its cells anyway); asked as
    ``gathers_into_sink`` is."""
    return _shm.transport_for(group, tensor, named) is not None


def reduce_scatter_into(
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    *,
    predivide: float = 1.0,
    places: Places | None = None,
) -> Pending:
    """Sum ``full / predivide`` over ``group`` and leave this rank's equal slice of the sum
    in ``output``. ``full`` may be overwritten. (The shared-memory transport divides while
    it copies, saving a pass over ``full``; either way each element is ``x / predivide``.)
    ``places``, where ``reduces_from_places`` said so, hold ``full`` 's elements instead
    (``full`` then only gives sizes)."""
    num_ranks = dist.get_world_size(group)
    assert places is None or num_ranks > 1, "places need the shared-memory transport"
    if num_ranks == 1:
        output.copy_(full.view(-1)[: output.numel()].div(predivide))
        return completed("reduce_scatter", label, group)
    if debug_checks_enabled():
        _check_agreement("reduce_scatter", label, full, group)
    COUNTERS.record("reduce_scatter", label, _tensor_bytes(full) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::reduce_scatter({label})"):
        transport = _shm.transport_for(group, full, named)
        if transport is not None:
            issue = functools.partial(
                transport.reduce_scatter, output, full, predivide, label, places
            )
            return _SharedMemoryPending("reduce_scatter", label, group, transport, issue)
        assert places is None, "places need the shared-memory transport (reduces_from_places)"
        if predivide != 1:
            full.div_(predivide)
        if _uses_ring(group, full):
            steps = _ring_reduce_scatter(output, full, group, _next_tag(group))
            return _WorkPending("reduce_scatter", label, group, steps, [_neighbours(group)[3]])
        work = _reduce_scatter_single(output, full, group=group, async_op=True)
    return issued("reduce_scatter", label, group, work)


def all_reduce(
    tensor: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Pending:
    """Reduce ``tensor`` in place over ``group`` (a sum unless ``op`` says otherwise)."""
    num_ranks = dist.get_world_size(group)
    if num_ranks == 1:
        return completed("all_reduce", label, group)
    if debug_checks_enabled():
        _check_agreement("all_reduce", label, tensor, group)
    COUNTERS.record("all_reduce", label, 2 * _tensor_bytes(tensor) * (num_ranks - 1) / num_ranks)
    with record_function(f"fullshard::all_reduce({label})"):
        work = dist.all_reduce(tensor, op=op, group=group, async_op=True)
    return issued("all_reduce", label, group, work)


# [Note: rings on gloo]
# gloo's all-gather and reduce-scatter are slow on the CPU, and its reduce-scatter sends the
# whole tensor, as an all-reduce would. Measured on this project's 2-core machine, 2 ranks,
# a 100 MB tensor: all_gather 0.108 s; reduce_scatter 0.112 s and 100 MB sent per rank;
# all_reduce 0.076 s. A ring of isend/irecv moves each byte once: all-gather 0.042 s,
# reduce-scatter 0.084 s, 50 MB sent per rank. So on gloo groups fullshard runs its own rings
# (N - 1 steps; each rank sends to the next and receives from the previous). The first step
# is issued at once and runs in gloo's transport threads while the caller computes; `wait()`
# runs the rest (none on 2 ranks): see `Pending`. Every rank issues the same collectives in the same order,
# so a per-group counter gives each ring a tag that matches across ranks.
# FULLSHARD_GLOO_RINGS=0 uses gloo's own collectives instead.
#
# Reduce-scatter, 3 ranks, chunk c of rank r written x_r[c]; at step s rank r sends its
# partial sum of chunk (r - s - 1) mod 3 and adds its own x_r to what it receives:
#   step 0: rank0 sends x0[2] -> rank1, which forms x0[2] + x1[2]
#   step 1: rank1 sends (x0[2] + x1[2]) -> rank2, which forms x0[2] + x1[2] + x2[2]: its chunk
# On 2 ranks it is one exchange: each sends the other's chunk and adds it to its own (a + b is
# the same in either order, so the result matches any other reduce-scatter bitwise).
#
# An all-gather with a `Receiver` (`fully_shard`'s parameters, whose unsharded rows of a
# rank are one range of each parameter, not one range of a buffer) moves each rank's shard
# as one message per place: the sender cuts the shard, or the rows it received at the step
# before, by the same places the receiver posts its receives into, and every rank computes
# them alike from the layout. Messages of one pair and tag arrive in the order they were sent.
# Nothing is copied out of a gathered buffer afterwards, and none is allocated.

_TAGS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()
"""Per live group, the rings issued on it so far. Keyed by the group itself, not its
``id``: a group made after another was destroyed may get the old one's ``id`` on some ranks
only, and would continue its count there while the other ranks start at 1 (the rings'
messages would then never match)."""


def _next_tag(group: dist.ProcessGroup) -> int:
    tag = _TAGS.get(group, 0) + 1
    _TAGS[group] = tag
    return tag


def _uses_ring(group: dist.ProcessGroup, tensor: torch.Tensor) -> bool:
    return (
        switches.current().gloo_rings
        and tensor.device.type == "cpu"
        and dist.get_world_size(group) > 1
        and dist.get_backend(group) == dist.Backend.GLOO
    )


def _neighbours(group: dist.ProcessGroup) -> tuple[int, int, int, int]:
    """This rank's group rank, the group size, and the global ranks of the next and previous."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    following = dist.get_global_rank(group, (rank + 1) % num_ranks)
    previous = dist.get_global_rank(group, (rank - 1) % num_ranks)
    return rank, num_ranks, following, previous


def _exchange(
    send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup, to: int, source: int, tag: int
) -> list[dist.Work]:
    works = [
        dist.isend(send, to, group=group, tag=tag),
        dist.irecv(recv, source, group=group, tag=tag),
    ]
    return [work for work in works if work is not None]


def _ring_all_gather(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, tag: int
) -> Iterator[list[dist.Work]]:
    rank, num_ranks, following, previous = _neighbours(group)
    chunks = output.chunk(num_ranks)  # (shard_numel,) each
    chunks[rank].copy_(shard)
    for step in range(num_ranks - 1):
        send, recv = chunks[(rank - step) % num_ranks], chunks[(rank - step - 1) % num_ranks]
        yield _exchange(send, recv, group, following, previous, tag)


def _ring_all_gather_into_places(
    receiver: Receiver, shard: torch.Tensor, group: dist.ProcessGroup, tag: int
) -> Iterator[list[dist.Work]]:
    """The ring all-gather with each rank's shard received where ``receiver`` places it: one
    message per place (the sender cuts a rank's shard by the same places), and nothing
    copied out of a gathered buffer afterwards."""
    rank, num_ranks, following, previous = _neighbours(group)
    for start, place in receiver.places(rank):
        place.copy_(shard[start : start + place.numel()])
    for step in range(num_ranks - 1):
        sent = receiver.places((rank - step) % num_ranks)
        received = receiver.places((rank - step - 1) % num_ranks)
        works = [dist.isend(place, following, group=group, tag=tag) for _, place in sent]
        works += [dist.irecv(place, previous, group=group, tag=tag) for _, place in received]
        yield [work for work in works if work is not None]


def _ring_reduce_scatter(
    output: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup, tag: int
) -> Iterator[list[dist.Work]]:
    rank, num_ranks, following, previous = _neighbours(group)
    chunks = full.chunk(num_ranks)  # (shard_numel,) each
    send = chunks[(rank - 1) % num_ranks]
    for step in range(num_ranks - 1):
        # The last partial sum is received straight into `output`: no extra buffer.
        received = output if step == num_ranks - 2 else torch.empty_like(output)
        yield _exchange(send, received, group, following, previous, tag)
        send = received.add_(chunks[(rank - step - 2) % num_ranks])
