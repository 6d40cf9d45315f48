"""The shared-memory transport: all-gather and reduce-scatter between ranks on one host.

[Note: shared-memory transport]
gloo moves every byte between two ranks on one host through the loopback TCP stack: the
kernel copies it into a socket buffer in the sender's thread and out again in the
receiver's, and gloo's own threads, which do that work, compete with the ranks' compute
threads for the cores. Measured on this project's 2-core machine (compute benchmark config):
sending one 1.5 MiB shard cost 0.82 ms of the caller's time, and fullshard's steps spent
~60 ms more than a local step issuing and waiting on collectives.

When every rank of a gloo group can map the same file in ``/dev/shm``, fullshard moves the
all-gathers and reduce-scatters of CPU tensors through that file instead. It has, per rank
and per slot (``_SLOTS`` slots used round-robin), a cell of ``FULLSHARD_SHM_CELL_MIB`` MiB
(default 4) that only that rank writes, and three flags per rank and slot that only that
rank writes:

- ``posted[q, s] = p + 1``: rank q wrote its part of piece p into its cell of slot s;
- ``signature[q, s]``: what that piece belongs to (kind, unit, element count, dtype),
  written first, so ranks that run different collectives get an error instead of each
  other's bytes;
- ``consumed[q, s] = p + 1``: rank q finished reading piece p from every cell of slot s.

A collective is cut into pieces that fit a cell (``pieces.py``); pieces are numbered in
issue order, which is the same on every rank, and piece p uses slot ``p % _SLOTS``. A rank
may write piece p once every rank has consumed piece ``p - _SLOTS`` (the slot's previous
use), and reads it once every rank has posted it. Issuing a collective posts the pieces
it can at once and returns; ``wait()`` makes progress on every outstanding piece, in order,
of every transport of the process (a peer may be waiting for this rank's pieces in another
group), until its own are read. A rank is only ever blocked on pieces every rank has
already issued or will issue before blocking itself, so there is no deadlock; before it
blocks anywhere else it drains the transport ([Note: draining] in ``collectives.py``). The
copies run in the caller's thread; there are no transport threads.

- all-gather: rank q writes its shard (a range of it per piece); every rank copies the
  others' ranges into its output.
- reduce-scatter: rank q writes, for every other rank d, the range of its chunk d; rank r
  sums chunk r over all ranks in rank order (on 2 ranks ``a + b == b + a`` bitwise, so the
  result equals gloo's and the rings').

Waits are bounded like every other collective (see [Note: bounded collectives]): a rank
holds a lock on one byte of the file for its lifetime, so a waiter tells a dead peer (the
lock is free) from a slow one (the bound runs out). The file is unlinked as soon as every
rank has mapped it, so a crash cannot leave it behind. The flags are plain aligned 8-byte
stores and loads, written after the data they publish: correct under x86-64's total store
order, so the transport is only used on x86-64; elsewhere, and with FULLSHARD_SHM=0, gloo
(with fullshard's rings, [Note: rings on gloo]) carries everything.

Memory: the file, ``_SLOTS * world_size * cell`` bytes (32 MiB for 2 ranks), is allocated
once for the host when the group first communicates; where ``/dev/shm`` cannot hold it, the
group uses gloo. Each rank maps all of it, and the pages it writes or reads count towards
its resident size: for collectives smaller than a cell only the part they touch
(`resident_bytes`; ``fullshard.memory`` counts it as ``staging``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import platform
import secrets
import time
import warnings
import weakref
import zlib
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .. import _switches as switches
from .constants import SHARED_MEMORY_SLOTS
from .pieces import AllGather, Op, Places, ReduceScatter, Sink

__all__: list[str] = []

_SLOTS = SHARED_MEMORY_SLOTS
_SPIN_S = 0.002
"""A waiting rank first yields its core in a loop this long (a peer is usually close)..."""
_SLEEP_S = 1e-4
"""...then sleeps this long between looks (the peer is far behind, or the host is busy)."""
_CHECK_S = 0.002
"""How often a waiting rank looks at its peers' locks: a dead peer is reported within this
(a launcher such as torchrun may stop the survivors soon after a death, before it prints)."""
_TOKEN_BYTES = 16
_PAGE = 4096
_SHM_DIR = "/dev/shm"
FILE_PREFIX = "fullshard-"
"""A transport's file in ``_SHM_DIR``: ``FILE_PREFIX``, its creator's pid, a random part."""
BYTES_WRITTEN = 0
"""Bytes this process has written into transports' files: what it sent to its peers."""
_ORDERED_STORES = platform.machine() in ("x86_64", "AMD64")
"""Whether this CPU keeps stores in order (x86-64's total store order): see the note."""


class TransportError(RuntimeError):
    """A piece did not arrive: ``reason`` is "timeout", "gone" or "failed" (an earlier
    collective of the group failed); ``peer`` the global rank (-1: unknown);
    ``op`` the collective being waited for."""

    def __init__(self, message: str, reason: str, peer: int) -> None:
        super().__init__(message)
        self.reason, self.peer = reason, peer
        self.op: Op | None = None


_EARLIER_FAILURE = (
    "an earlier collective of this group failed on this rank; the first error says why"
)


class TransportMismatchError(RuntimeError):
    """Ranks paired different collectives on the transport."""


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The process group's own timeout in seconds (torch's default where unreadable)."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return float(backend.options._timeout.total_seconds())
    except (AttributeError, RuntimeError):
        return 1800.0


# -- the transport of one group -------------------------------------------------------------


class Transport:
    """The shared file of one group, this rank's place in it, and its outstanding pieces."""

    def __init__(
        self,
        fd: int,
        mapping: mmap.mmap,
        rank: int,
        global_ranks: list[int],
        cell_bytes: int,
        timeout_s: float,
    ) -> None:
        self._fd, self._mapping = fd, mapping
        self.rank, self.global_ranks = rank, global_ranks
        self.num_ranks = len(global_ranks)
        self.cell_bytes, self.timeout_s = cell_bytes, timeout_s
        flags = np.frombuffer(
            mapping, dtype=np.int64, count=3 * self.num_ranks * _SLOTS, offset=_TOKEN_BYTES
        ).reshape(3, self.num_ranks, _SLOTS)
        self._posted, self._consumed, self._signature = flags[0], flags[1], flags[2]
        data = torch.frombuffer(mapping, dtype=torch.uint8, offset=_data_offset(self.num_ranks))
        # cells[s][q]: rank q's cell of slot s
        self._cells = [
            [
                data[
                    (s * self.num_ranks + q) * cell_bytes : (s * self.num_ranks + q + 1)
                    * cell_bytes
                ]
                for q in range(self.num_ranks)
            ]
            for s in range(_SLOTS)
        ]
        self._ops: deque[Op] = deque()
        """Issued ops with pieces not yet consumed here, in issue order."""
        self._issued = 0
        """Pieces issued so far (the next op's first piece)."""
        self._next_post = 0
        self._next_consume = 0
        self.failed = False
        """A collective failed: the process group is unusable, like gloo's after an error."""
        self.max_touched = [0] * _SLOTS
        """Per slot, the most bytes of a cell any piece used (for `resident_bytes`)."""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)

    # -- issuing and waiting ----------------------------------------------------------------

    def all_gather(
        self, output: torch.Tensor, shard: torch.Tensor, label: str, sink: Sink | None = None
    ) -> Op:
        op = AllGather(output, shard, self.rank, self.num_ranks, self.cell_bytes, sink)
        return self._issue(op, label)

    def reduce_scatter(
        self,
        output: torch.Tensor,
        full: torch.Tensor,
        predivide: float,
        label: str,
        places: Places | None = None,
    ) -> Op:
        op = ReduceScatter(
            output, full, predivide, self.rank, self.num_ranks, self.cell_bytes, places
        )
        return self._issue(op, label)

    def _issue(self, op: Op, label: str) -> Op:
        """Post what can be posted now, without blocking (see the note)."""
        op.label = label
        op.signature = zlib.crc32(f"{op.kind}/{label}/{op.numel}/{op.dtype}".encode())
        if self.failed:
            error = TransportError(_EARLIER_FAILURE, "failed", -1)
            error.op = op
            raise error
        op.first_piece = self._issued
        self._issued += op.num_pieces
        if op.num_pieces:
            self._ops.append(op)
            try:
                self._progress()
            except TransportMismatchError:
                self.failed = True
                raise
        return op

    def wait(self, op: Op, timeout_s: float | None) -> None:
        """Progress until every piece of ``op`` is read (see the note); raise
        `TransportError` after ``timeout_s`` (None: the group's timeout) or on a dead peer."""
        bound = self.timeout_s if timeout_s is None else timeout_s
        if self.failed and self._next_consume < op.first_piece + op.num_pieces:
            error = TransportError(_EARLIER_FAILURE, "failed", -1)
            error.op = op
            raise error
        try:
            self._wait(op, bound)
        except TransportError as error:
            error.op = op
            self.failed = True
            raise
        except TransportMismatchError:
            self.failed = True
            raise

    def drain(self, timeout_s: float | None) -> None:
        """Finish every outstanding collective (before this rank blocks elsewhere). A
        transport whose collective failed is left alone: its group cannot be used again."""
        if self._ops and not self.failed:
            self.wait(self._ops[-1], timeout_s)

    def _wait(self, op: Op, bound: float) -> None:
        end = op.first_piece + op.num_pieces
        if self._next_consume >= end:
            return
        started = idle_since = time.monotonic()
        next_check = started + _CHECK_S
        while True:
            # Every transport of this process moves: a peer blocked on another group's
            # pieces of ours must not wait for this one to finish first.
            if self._progress() | _progress_others(self):
                idle_since = time.monotonic()
            if self._next_consume >= end:
                return
            now = time.monotonic()
            if now - idle_since < _SPIN_S:
                os.sched_yield()
            else:
                time.sleep(_SLEEP_S)
            if now >= next_check:
                self._check_peers(now - started, bound)
                next_check = now + _CHECK_S

    def _progress(self) -> bool:
        """Post and read every piece that can be, in order; whether anything moved."""
        moved = False
        while self._next_post < self._issued and self._slot_free(self._next_post):
            self._post(self._next_post)
            self._next_post += 1
            moved = True
        while self._next_consume < self._next_post and self._arrived(self._next_consume):
            self._consume(self._next_consume)
            self._next_consume += 1
            moved = True
        return moved

    def _op_of(self, piece: int) -> Op:
        for op in self._ops:
            if op.first_piece <= piece < op.first_piece + op.num_pieces:
                return op
        raise AssertionError(f"fullshard internal error: no op holds piece {piece}")

    def _slot_free(self, piece: int) -> bool:
        previous = piece - _SLOTS
        return previous < 0 or bool((self._consumed[:, piece % _SLOTS] > previous).all())

    def _arrived(self, piece: int) -> bool:
        return bool((self._posted[:, piece % _SLOTS] > piece).all())

    def _post(self, piece: int) -> None:
        slot = piece % _SLOTS
        op = self._op_of(piece)
        op.post(piece, self._cells[slot][self.rank])
        self._signature[self.rank, slot] = op.signature
        self._posted[self.rank, slot] = piece + 1  # after the data: see the note
        global BYTES_WRITTEN
        BYTES_WRITTEN += op.piece_bytes(piece)

    def _consume(self, piece: int) -> None:
        slot = piece % _SLOTS
        op = self._op_of(piece)
        for peer in range(self.num_ranks):
            if self._signature[peer, slot] != op.signature:
                unit = "the root module" if op.label == "(root)" else f"module {op.label}"
                mine = f"{op.kind.replace('_', '-')} of {unit} of {op.full_numel} x {op.dtype}"
                raise TransportMismatchError(
                    f"fullshard: rank {self.global_ranks[peer]} ran a different collective "
                    f"than this rank (rank {self.global_ranks[self.rank]}: {mine}) at the same "
                    "point. Every rank must run the same FSDP units in the same order, with "
                    "the same model, wrap policy, sharding strategy and precision; "
                    "FULLSHARD_DEBUG=1 names the collectives each rank ran"
                )
        op.consume(piece, self._cells[slot])
        self.max_touched[slot] = max(self.max_touched[slot], op.piece_bytes(piece))
        self._consumed[self.rank, slot] = piece + 1
        if piece + 1 == op.first_piece + op.num_pieces:
            self._ops.remove(op)

    def _check_peers(self, waited_s: float, bound_s: float) -> None:
        """Raise `TransportError` for a dead peer, or once the bound has run out."""
        behind: set[int] = set()
        if self._next_post < self._issued:  # the slot's previous piece is still being read
            previous = self._next_post - _SLOTS
            behind.update(np.nonzero(self._consumed[:, self._next_post % _SLOTS] <= previous)[0])
        if self._next_consume < self._next_post:  # the piece is not written everywhere yet
            piece = self._next_consume
            behind.update(np.nonzero(self._posted[:, piece % _SLOTS] <= piece)[0])
        behind.discard(self.rank)
        for peer in sorted(int(q) for q in behind):
            if not self._alive(peer):
                raise TransportError(
                    f"rank {self.global_ranks[peer]}'s process ended (shared-memory transport)",
                    "gone",
                    self.global_ranks[peer],
                )
        if waited_s >= bound_s:
            peers = [self.global_ranks[int(q)] for q in sorted(behind)]
            raise TransportError(
                f"timed out after {waited_s:.1f} s waiting for rank(s) {peers} "
                "(shared-memory transport)",
                "timeout",
                peers[0] if peers else -1,
            )

    def _alive(self, peer: int) -> bool:
        """Whether ``peer`` still holds its lock byte (see the note)."""
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, peer)
        except OSError:
            return True
        fcntl.lockf(self._fd, fcntl.LOCK_UN, 1, peer)
        return False

    def resident_bytes(self) -> int:
        """Bytes of the file this rank has touched, by the largest piece seen per slot."""
        return sum(-(-used // _PAGE) * _PAGE for used in self.max_touched) * self.num_ranks


def _data_offset(num_ranks: int) -> int:
    header = _TOKEN_BYTES + 3 * num_ranks * _SLOTS * 8
    return -(-header // _PAGE) * _PAGE


# -- setup ----------------------------------------------------------------------------------

_TRANSPORTS: weakref.WeakKeyDictionary[dist.ProcessGroup, Transport | None] = (
    weakref.WeakKeyDictionary()
)


Guard = Callable[[str, dist.ProcessGroup], AbstractContextManager[None]]
"""Wraps the setup's blocking exchanges: ``collectives.named``, which drains the other
transports first and names a lost peer (passed in, so this module imports nothing of the
collectives built on it)."""


def transport_for(group: dist.ProcessGroup, tensor: torch.Tensor, guard: Guard) -> Transport | None:
    """The transport for a collective over ``group`` on ``tensor``, or None to use gloo: for
    CUDA tensors, with FULLSHARD_SHM=0, off x86-64, for NCCL groups, and where the ranks
    cannot share a file (other hosts, no /dev/shm). Set up at the group's first eligible
    collective, which every rank reaches at the same point, its exchanges under ``guard``."""
    if tensor.device.type != "cpu" or not switches.current().shared_memory:
        return None
    try:
        return _TRANSPORTS[group]
    except KeyError:
        pass
    transport = None
    if dist.get_world_size(group) > 1 and dist.get_backend(group) == dist.Backend.GLOO:
        transport = _set_up(group, guard)
    _TRANSPORTS[group] = transport
    if transport is not None:
        weakref.finalize(group, transport.close)
    return transport


def _live_transports() -> list[Transport]:
    return [t for t in list(_TRANSPORTS.values()) if t is not None and not t.failed]


def _progress_others(waiting: Transport) -> bool:
    moved = False
    for transport in _live_transports():
        if transport is not waiting and transport._ops:
            try:
                moved |= transport._progress()
            except TransportMismatchError:
                transport.failed = True
                raise
    return moved


def drain_all(timeout_s: float | None) -> None:
    """Finish every outstanding collective of every transport of this process: called
    before fullshard blocks in any other collective (see [Note: draining]). Each wait moves
    every transport, so the order of the groups here cannot deadlock."""
    for transport in _live_transports():
        transport.drain(timeout_s)


_SETUP = (
    "the shared-memory transport's setup (every rank must set FULLSHARD_SHM and "
    "FULLSHARD_SHM_CELL_MIB alike)"
)


def _set_up(group: dist.ProcessGroup, named: Guard) -> Transport | None:
    """Create the group's file on its first rank, map it everywhere, unlink it. A first
    vote makes sure every rank is here before the file exists (so a rank that never arrives
    cannot leave it behind); where any rank cannot take part, every rank gets None."""
    rank, num_ranks = dist.get_rank(group), dist.get_world_size(group)
    global_ranks = dist.get_process_group_ranks(group)
    cell_bytes = switches.current().shm_cell_bytes  # each rank's, checked; rank 0's is used
    ready = torch.tensor([1 if _ORDERED_STORES else 0])
    with named(_SETUP, group):
        dist.all_reduce(ready, op=dist.ReduceOp.MIN, group=group)
    if not ready.item():
        return None
    size = _data_offset(num_ranks) + _SLOTS * num_ranks * cell_bytes
    offer: list[Any] = [None, None, cell_bytes]
    fd = -1
    path = None
    try:
        if rank == 0:
            path = os.path.join(_SHM_DIR, f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
            fd = _create(path, size, num_ranks, cell_bytes)
            if fd < 0:
                path = None
            else:
                token = secrets.token_bytes(_TOKEN_BYTES)
                os.pwrite(fd, token, 0)
                offer = [os.path.basename(path), token, cell_bytes]
        with named(_SETUP, group):
            dist.broadcast_object_list(offer, src=global_ranks[0], group=group)
        name, token, cell_bytes = offer
        size = _data_offset(num_ranks) + _SLOTS * num_ranks * cell_bytes
        mapping = None
        if name is not None:
            try:
                if rank != 0:
                    fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDWR)
                mapping = mmap.mmap(fd, size)
                if mapping[:_TOKEN_BYTES] != token:  # a file of that name on another host
                    raise OSError("cannot share the file")
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, rank)
            except (OSError, ValueError):
                mapping = None
        ok = torch.tensor([0 if mapping is None else 1])
        with named(_SETUP, group):
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=group)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    finally:
        if path is not None:  # every rank has it open, gave up, or failed
            with contextlib.suppress(OSError):
                os.unlink(path)
    if not ok.item():
        if fd >= 0:
            os.close(fd)
        return None
    assert mapping is not None
    timeout = _group_timeout(group)
    return Transport(fd, mapping, rank, global_ranks, cell_bytes, timeout)


def _create(path: str, size: int, num_ranks: int, cell_bytes: int) -> int:
    """The new file's descriptor with every page reserved, or -1 (a warning says why where
    /dev/shm is too small: containers default to 64 MiB). Reserving now means a full
    /dev/shm sends the group to gloo instead of killing a rank with SIGBUS later."""
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, size)
        return fd
    except OSError as error:
        if error.errno == errno.ENOSPC:
            warnings.warn(
                f"fullshard: {_SHM_DIR} cannot hold the shared-memory transport's "
                f"{size / 2**20:.0f} MiB for a group of {num_ranks} ranks, so its "
                "collectives go over gloo (slower). Give the host or container more shared "
                "memory (docker run --shm-size=1g) or set FULLSHARD_SHM_CELL_MIB lower "
                f"(now {cell_bytes / 2**20:g})",
                stacklevel=4,
            )
        if fd >= 0:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
        return -1
