"""Run one function on N ranks of a gloo process group, in persistent worker processes.

Spawning a process and importing torch costs seconds, so the harness keeps a pool of N
workers per world size alive and reuses it across tests. Pools of the last
``KEPT_POOLS`` world sizes used stay alive (the suite alternates between 2, 3 and 4 ranks
from one parametrized test to the next, and each new pool costs seconds); an idle pool's
workers wait on their pipes and take no CPU, but keep their memory, the shared-memory
transports of groups tests never destroyed included: a pool whose workers map more than
``SHM_RECYCLE_BYTES`` of them is restarted before its next call.

Each worker initialises ``torch.distributed`` once (gloo, a ``FileStore`` in the pool's
temporary folder, a short default timeout so a stuck collective errors instead of hanging)
and then runs calls sent by :func:`run_on_ranks`. After a failed call the harness never
reuses the default group: a failed rank may leave unmatched collectives behind, which would
poison the next test. If every rank answered, each worker destroys the group and joins a
fresh one (cheap); if some rank is stuck (past the timeout, or past a short grace period
after another rank failed) or dead, the pool is killed and the next call starts a new one.

Worker stdout/stderr (Python and C++) go to one file per rank; after each call the
harness copies the new part to this process's stdout, so pytest shows it for failing
tests, and puts the tail of a failing rank's output into the error message.

Functions are pickled by reference, so they must be module-level functions of an importable
module; a script (not pytest) that calls :func:`run_on_ranks` needs the usual
``if __name__ == "__main__":`` guard, because spawned workers re-import the main module.

Usage::

    def _check_sum(scale: float) -> float:  # module level: pickled by reference
        t = torch.ones(2) * (dist.get_rank() + 1) * scale
        dist.all_reduce(t)
        return t[0].item()

    def test_sum_matches_formula_two_ranks() -> None:
        \"\"\"all_reduce sums the ranks' contributions.\"\"\"
        assert run_on_ranks(2, _check_sum, 0.5) == [1.5, 1.5]
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

    import pytest

__all__ = [
    "REPO_ROOT",
    "TESTS_DIR",
    "TEST_PATHS",
    "RankError",
    "RankTimeoutError",
    "pool_pids",
    "requires_cuda_gpus",
    "run_on_ranks",
    "shutdown_pool",
]

TESTS_DIR = Path(__file__).resolve().parent.parent
REPO_ROOT = TESTS_DIR.parent
TEST_GROUPS = ("support", "unit", "comm", "engine", "features", "interop", "seeds", "cli")
"""The folders of tests/, one per layer (tests/conftest.py says what each holds). Test modules
and helpers import each other by plain name (``from harness import ...``), so each folder is
on sys.path, here and in the workers (which unpickle test functions by module name)."""
TEST_PATHS = [str(TESTS_DIR / group) for group in TEST_GROUPS]

PG_TIMEOUT_S = float(os.environ.get("FULLSHARD_TEST_PG_TIMEOUT", "60"))
"""Timeout of the workers' default process group: a collective stuck longer raises."""
STARTUP_TIMEOUT_S = 180.0
"""How long a new pool may take to spawn, import torch and initialise the group."""
FAILURE_GRACE_S = 2.0
"""After one rank fails, how long to wait for the others before killing the pool."""
RESET_TIMEOUT_S = 20.0
"""After a failure every rank answered, how long re-creating the default group may take."""
STACK_DUMP_WAIT_S = 2.0
"""How long to wait for a stuck worker to write its stacks after SIGUSR1."""
OUTPUT_TAIL_CHARS = 4000
"""How much of a failing rank's output goes into the error message."""
KEPT_POOLS = 4
"""How many pools (one per world size, the most recently used) stay alive between calls."""


def _shm_budget() -> int:
    """2 GiB, or an eighth of /dev/shm where that is smaller (a container's)."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 2 * 2**30
    return min(2 * 2**30, stat.f_frsize * stat.f_blocks // 8)


SHM_RECYCLE_BYTES = _shm_budget()
"""A pool whose workers map more of fullshard's shared-memory files than this (the
transports of process groups that tests made and never destroyed, e.g. their device meshes'
groups) is restarted before its next call, which frees them: the kept pools together stay
at about half of /dev/shm (``KEPT_POOLS`` at an eighth each, plus what one call adds before
the next check)."""


class RankError(RuntimeError):
    """A call failed on one or more ranks; the message holds each failing rank's traceback.

    ``exc_types`` maps each rank that raised to its exception's type name;
    ``stuck_ranks`` lists the ranks that did not answer.
    """

    def __init__(self, message: str, exc_types: dict[int, str], stuck_ranks: list[int]) -> None:
        super().__init__(message)
        self.exc_types = exc_types
        self.stuck_ranks = stuck_ranks


class RankTimeoutError(RankError):
    """No rank raised, but some rank did not answer within the call's timeout."""


@dataclass
class _Reply:
    """One worker's answer to a call.

    kind: "ok" (payload holds the pickled result), "err" (exc_type, text),
    "skip" (text is the reason pytest.skip was called with) or "dead" (the worker exited).
    """

    kind: str
    payload: bytes = b""
    exc_type: str = ""
    text: str = ""


# ----------------------------------------------------------------------------------------
# Worker side


def _worker_main(rank: int, world_size: int, conn: Connection, workdir: str) -> None:
    """Entry point of a spawned worker: set up, then serve calls until told to stop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business
    for path in (str(REPO_ROOT), *TEST_PATHS):
        if path not in sys.path:
            sys.path.insert(0, path)
    _redirect_output(Path(workdir) / f"rank{rank}.out")
    stack_file = open(Path(workdir) / f"rank{rank}.stack", "w")  # noqa: SIM115 (lives forever)
    if hasattr(signal, "SIGUSR1"):
        import faulthandler

        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        faulthandler.enable(file=sys.stderr, all_threads=True)  # segfaults land in the output
    _install_assert_rewriting()
    try:
        store = _setup_torch(rank, world_size, workdir)
        conn.send(("ready", os.getpid()))
    except BaseException:
        conn.send(("err", "startup", traceback.format_exc()))
        return
    _serve(rank, world_size, conn, store)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's destructors may block on peers that are gone.
    os._exit(0)


def _redirect_output(path: Path) -> None:
    """Point fds 1 and 2 (Python and C++ writers alike) at ``path``, line buffered."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    for stream in (sys.stdout, sys.stderr):
        reconfigure = getattr(stream, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True)


class _AssertRewritingFinder:
    """Import test modules with pytest's assert rewriting, as pytest does in its process.

    Without it a bare ``assert x == y`` failing on a rank reports no values. Uses
    ``_pytest.assertion.rewrite.rewrite_asserts`` (private but long stable); without
    pytest the workers import test modules plainly.
    """

    PATTERNS = ("test_*.py", "*_test.py")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        import fnmatch
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path)
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            return None
        if not any(fnmatch.fnmatch(os.path.basename(spec.origin), p) for p in self.PATTERNS):
            return None
        spec.loader = self  # type: ignore[assignment]
        return spec

    def create_module(self, spec: Any) -> None:
        return None  # the default module object

    def exec_module(self, module: Any) -> None:
        import ast

        from _pytest.assertion.rewrite import rewrite_asserts

        origin = module.__spec__.origin
        source = Path(origin).read_bytes()
        tree = ast.parse(source, filename=origin)
        rewrite_asserts(tree, source, origin)
        exec(compile(tree, origin, "exec", dont_inherit=True), module.__dict__)


def _install_assert_rewriting() -> None:
    """Put :class:`_AssertRewritingFinder` first on ``sys.meta_path`` if pytest is here."""
    try:
        import _pytest.assertion.rewrite  # noqa: F401
    except ImportError:
        return
    sys.meta_path.insert(0, _AssertRewritingFinder())


def _setup_torch(rank: int, world_size: int, workdir: str) -> Any:
    """Import torch with one thread and join the default gloo group; return the store."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if sys.platform.startswith("linux"):
        # gloo otherwise binds to the address the hostname resolves to, which in
        # containers is sometimes not reachable; all ranks are on this machine.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    store_path = str(Path(workdir) / "store")
    store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined, unused-ignore]
    _init_default_group(store, rank, world_size, prefix="start")
    return store


def _init_default_group(store: Any, rank: int, world_size: int, prefix: str) -> None:
    """Initialise the default group; a fresh ``prefix`` keeps re-inits apart in the store."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        backend="gloo",
        store=dist.PrefixStore(prefix, store),  # type: ignore[attr-defined, unused-ignore]
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=PG_TIMEOUT_S),
    )


def _serve(rank: int, world_size: int, conn: Connection, store: Any) -> None:
    """Answer messages until ``("stop",)`` or EOF.

    ``("run", call_id, payload, env)`` runs a call; ``("reset", call_id)`` re-creates the
    default group after a failed call, so collectives a failing rank left unmatched
    cannot pair up with the next test's.
    """
    import torch.distributed as dist

    cwd = os.getcwd()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if message[0] == "stop":
            return
        if message[0] == "reset":
            reply = _reset_default_group(store, rank, world_size, prefix=f"reset{message[1]}")
        else:
            _, call_id, payload, env = message
            if not dist.is_initialized():  # a test destroyed the group; every rank sees that
                _init_default_group(store, rank, world_size, prefix=f"call{call_id}")
            reply = _run_call(payload, env)
            _reset_process_state(cwd)
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(reply)


def _reset_default_group(store: Any, rank: int, world_size: int, prefix: str) -> tuple[Any, ...]:
    """Destroy the default group (and any subgroups) and initialise a fresh one."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        _init_default_group(store, rank, world_size, prefix)
    except BaseException:
        return ("err", "reset", traceback.format_exc())
    return ("ready", os.getpid())


def _run_call(payload: bytes, env: dict[str, str] | None) -> tuple[Any, ...]:
    """Run one pickled ``(fn, args, kwargs)`` and build the reply message."""
    skip_exception = _pytest_skip_exception()
    with _temporary_env(env), warnings.catch_warnings():
        try:
            fn, args, kwargs = pickle.loads(payload)
            result = fn(*args, **kwargs)
        except BaseException as exc:
            if skip_exception is not None and isinstance(exc, skip_exception):
                return ("skip", str(getattr(exc, "msg", exc)))
            tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # skip this frame
            text = "".join(traceback.format_exception(type(exc), exc, tb))
            return ("err", type(exc).__qualname__, text)
    try:
        return ("ok", pickle.dumps(result))
    except Exception:
        text = f"the return value of type {type(result).__qualname__} is not picklable:\n"
        return ("err", "PicklingError", text + traceback.format_exc())


def _pytest_skip_exception() -> type[BaseException] | None:
    """pytest's Skipped exception if pytest is importable (it is, under pytest)."""
    try:
        import pytest
    except ImportError:
        return None
    return pytest.skip.Exception


@contextlib.contextmanager
def _temporary_env(env: dict[str, str] | None) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    _forget_switches()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _forget_switches()


def _forget_switches() -> None:
    """fullshard reads its environment switches once and keeps them (fullshard/_switches.py):
    drop them where the environment changes, so that the next test reads its own."""
    switches = sys.modules.get("fullshard._switches")
    if switches is not None:
        switches.forget()


def _reset_process_state(cwd: str) -> None:
    """Undo global torch settings a test may have changed, so the next test starts clean."""
    import torch

    torch.set_default_dtype(torch.float32)
    torch.set_default_device(None)
    torch.set_grad_enabled(True)
    torch.use_deterministic_algorithms(False)
    torch.autograd.set_detect_anomaly(False)
    torch.set_num_threads(1)
    os.chdir(cwd)


# ----------------------------------------------------------------------------------------
# Parent side


class _Pool:
    """``world_size`` spawned workers with one pipe each and a private temporary folder."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.workdir = tempfile.mkdtemp(prefix=f"fullshard-ranks{world_size}-")
        self.calls = 0
        self.alive = True
        self._out_offsets = [0] * world_size
        self.conns: list[Connection] = []
        self.procs: list[BaseProcess] = []
        try:
            self._start_workers()
        except BaseException:
            self.discard()
            raise

    def _start_workers(self) -> None:
        """Spawn one worker per rank, each with its end of a pipe."""
        context = multiprocessing.get_context("spawn")
        for rank in range(self.world_size):
            parent_conn, child_conn = context.Pipe()
            proc = context.Process(
                target=_worker_main,
                args=(rank, self.world_size, child_conn, self.workdir),
                name=f"fullshard-rank{rank}",
            )
            self.conns.append(parent_conn)
            proc.start()
            self.procs.append(proc)
            child_conn.close()  # so the parent sees EOF when the worker dies

    def all_alive(self) -> bool:
        """Whether every worker process is still running (none crashed between calls)."""
        return all(proc.is_alive() for proc in self.procs)

    @property
    def pids(self) -> list[int | None]:
        """Process ids of the workers, in rank order."""
        return [proc.pid for proc in self.procs]

    def wait_ready(self) -> None:
        """Block until every worker has joined the process group, or raise."""
        __tracebackhide__ = True
        replies = self._collect(STARTUP_TIMEOUT_S, ready_kind="ready")
        failed = {rank: r for rank, r in replies.items() if r.kind != "ok"}
        stuck = [rank for rank in range(self.world_size) if rank not in replies]
        if failed or stuck:
            raise self._failure("pool startup", replies, stuck, STARTUP_TIMEOUT_S, may_keep=False)

    def run(
        self, call_name: str, payload: bytes, env: dict[str, str] | None, timeout: float
    ) -> tuple[list[Any], str | None]:
        """Send one call to every worker; return (results by rank, skip reason), or raise.

        The skip reason is not None when some rank called ``pytest.skip`` and none failed.
        """
        __tracebackhide__ = True
        self.calls += 1
        for conn in self.conns:
            conn.send(("run", self.calls, payload, env))
        replies = self._collect(timeout)
        stuck = [rank for rank in range(self.world_size) if rank not in replies]
        failed = {rank: r for rank, r in replies.items() if r.kind in ("err", "dead")}
        if failed or stuck:
            raise self._failure(call_name, replies, stuck, timeout)
        self._echo_output(self._read_new_output())
        skipped = [r.text for r in replies.values() if r.kind == "skip"]
        if skipped:
            return [], skipped[0]
        return [pickle.loads(replies[rank].payload) for rank in range(self.world_size)], None

    def _collect(self, timeout: float, ready_kind: str = "") -> dict[int, _Reply]:
        """Gather replies until all ranks answer, the timeout passes, or a failure's grace ends."""
        deadline = time.monotonic() + timeout
        replies: dict[int, _Reply] = {}
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            for conn in wait(list(pending), remaining):
                rank = pending.pop(conn)  # type: ignore[call-overload]
                reply = self._receive(rank, ready_kind)
                replies[rank] = reply
                if reply.kind in ("err", "dead"):
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        return replies

    def _receive(self, rank: int, ready_kind: str) -> _Reply:
        """Read one worker's reply; EOF means the worker died."""
        try:
            message = self.conns[rank].recv()
        except (EOFError, OSError):
            self.procs[rank].join(timeout=1.0)
            code = self.procs[rank].exitcode
            return _Reply("dead", text=f"the worker process exited (exit code {code})")
        kind = message[0]
        if kind == ready_kind:
            return _Reply("ok")
        if kind == "ok":
            return _Reply("ok", payload=message[1])
        if kind == "skip":
            return _Reply("skip", text=message[1])
        if kind == "err":
            return _Reply("err", exc_type=message[1], text=message[2])
        return _Reply("err", exc_type="HarnessProtocolError", text=f"unexpected {message!r}")

    def _failure(
        self,
        call_name: str,
        replies: dict[int, _Reply],
        stuck: list[int],
        timeout: float,
        may_keep: bool = True,
    ) -> RankError:
        """Recover (reset the group, or kill the pool) and build the error to raise.

        If every rank answered (and ``may_keep``), the workers are kept and only the
        default group is re-created; a stuck or dead rank, or a failed reset, kills the pool.
        """
        stacks = self._dump_stacks(stuck)
        failed = {rank: r for rank, r in replies.items() if r.kind in ("err", "dead")}
        dead = any(r.kind == "dead" for r in failed.values())
        kept = may_keep and not stuck and not dead and self._reset_group()
        if not kept:
            self.kill()
        outputs = self._read_new_output()
        if not kept:
            self._remove_workdir()
        self._echo_output(outputs)
        recovery = (
            "the workers were kept and their default group re-created"
            if kept
            else "the worker pool was killed and will be restarted"
        )
        header = f"{call_name} failed on world size {self.world_size} ({recovery})"
        sections = [header]
        for ranks, reply in _group_identical(failed):
            what = reply.exc_type if reply.kind == "err" else "a dead worker"
            who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks} (identical)"
            sections.append(f"===== {who} failed with {what} =====\n{reply.text.rstrip()}")
        if stuck:
            sections.append(_stuck_summary(stuck, bool(failed), timeout))
        for rank in stuck:
            stack = stacks.get(rank) or "(no stack could be dumped)"
            sections.append(f"===== rank {rank} stack when killed =====\n{stack.rstrip()}")
        for rank in sorted(set(failed) | set(stuck)):
            if outputs[rank].strip():
                tail = outputs[rank][-OUTPUT_TAIL_CHARS:].rstrip()
                sections.append(f"===== rank {rank} output (tail) =====\n{tail}")
        error_cls = RankError if failed else RankTimeoutError
        exc_types = {rank: r.exc_type or "dead worker" for rank, r in failed.items()}
        return error_cls("\n".join(sections), exc_types, stuck)

    def _reset_group(self) -> bool:
        """Have every worker re-create its default group; True if all did in time."""
        self.calls += 1
        try:
            for conn in self.conns:
                conn.send(("reset", self.calls))
        except OSError:  # a worker died after answering
            return False
        replies = self._collect(RESET_TIMEOUT_S, ready_kind="ready")
        ranks_ok = [rank for rank, reply in replies.items() if reply.kind == "ok"]
        return len(ranks_ok) == self.world_size

    def _dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        """Ask stuck workers for their Python stacks (faulthandler on SIGUSR1)."""
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return {}
        paths = {rank: Path(self.workdir) / f"rank{rank}.stack" for rank in ranks}
        for rank in ranks:
            pid = self.procs[rank].pid
            if pid is not None and self.procs[rank].is_alive():
                os.kill(pid, signal.SIGUSR1)
        # The dump is written from the signal handler itself, even while the worker
        # blocks in C++; wait until every file has content and stopped growing.
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:
            time.sleep(0.1)
            new_sizes = {r: p.stat().st_size if p.exists() else 0 for r, p in paths.items()}
            if all(new_sizes.values()) and new_sizes == sizes:
                break
            sizes = new_sizes
        return {r: p.read_text(errors="replace") if p.exists() else "" for r, p in paths.items()}

    def _read_new_output(self) -> list[str]:
        """What each worker wrote to stdout/stderr since the last read."""
        outputs = []
        for rank in range(self.world_size):
            path = Path(self.workdir) / f"rank{rank}.out"
            if not path.exists():
                outputs.append("")
                continue
            with open(path, "rb") as file:
                file.seek(self._out_offsets[rank])
                data = file.read()
            self._out_offsets[rank] += len(data)
            outputs.append(data.decode(errors="replace"))
        return outputs

    def _echo_output(self, outputs: list[str]) -> None:
        """Copy worker output to our stdout, where pytest captures it per test."""
        for rank, text in enumerate(outputs):
            if text:
                sys.stdout.write(f"----- rank {rank} output -----\n{text}")
                if not text.endswith("\n"):
                    sys.stdout.write("\n")

    def close(self) -> None:
        """Ask the workers to exit, killing those that do not within two seconds."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        deadline = time.monotonic() + 2.0
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.discard()

    def kill(self) -> None:
        """Kill every worker now (the folder stays: failure reports read it)."""
        self.alive = False
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=5.0)
        for conn in self.conns:
            conn.close()

    def discard(self) -> None:
        """Kill the workers and delete the folder: for pools in an unknown state."""
        self.kill()
        self._remove_workdir()

    def _remove_workdir(self) -> None:
        """Delete the pool's temporary folder (store, output and stack files)."""
        shutil.rmtree(self.workdir, ignore_errors=True)


def _group_identical(failed: dict[int, _Reply]) -> list[tuple[list[int], _Reply]]:
    """Failed ranks grouped by identical reply, so N equal tracebacks print once."""
    groups: dict[tuple[str, str, str], list[int]] = {}
    for rank, reply in sorted(failed.items()):
        groups.setdefault((reply.kind, reply.exc_type, reply.text), []).append(rank)
    return [(ranks, failed[ranks[0]]) for ranks in groups.values()]


def _stuck_summary(stuck: list[int], after_failure: bool, timeout: float) -> str:
    """One line saying which ranks did not answer, and why we stopped waiting."""
    if after_failure:
        why = f"within {FAILURE_GRACE_S:g} s of another rank failing"
        hint = "probably waiting in a collective the failed rank never joined"
    else:
        why = f"within the timeout of {timeout:g} s"
        hint = "see the stacks below"
    return f"ranks {stuck} did not answer {why} ({hint})"


_POOLS: dict[int, _Pool] = {}
"""The live pools by world size, least recently used first."""
_LAST_WORLD_SIZE: int | None = None


def _get_pool(world_size: int) -> _Pool:
    """The live pool for ``world_size`` (started if there is none, if it died, or if it
    maps more than ``SHM_RECYCLE_BYTES`` of transports), keeping at most ``KEPT_POOLS``
    pools alive."""
    __tracebackhide__ = True
    global _LAST_WORLD_SIZE
    _LAST_WORLD_SIZE = world_size
    pool = _POOLS.pop(world_size, None)
    if pool is not None and not pool.all_alive():
        pool.discard()
        pool = None
    if pool is not None and max(map(_mapped_shm_bytes, pool.pids)) > SHM_RECYCLE_BYTES:
        pool.close()
        pool = None
    if pool is None:
        pool = _Pool(world_size)
        try:
            pool.wait_ready()
        except BaseException:
            pool.discard()
            raise
    _POOLS[world_size] = pool  # now the most recently used
    while len(_POOLS) > KEPT_POOLS:
        _stop_least_recently_used()
    return pool


def _stop_least_recently_used() -> None:
    _POOLS.pop(next(iter(_POOLS))).close()


def _mapped_shm_bytes(pid: int | None) -> int:
    """Bytes of fullshard's shared-memory transport files that process ``pid`` maps (0
    where /proc cannot tell)."""
    from fullshard._comm import shared_memory as shm

    prefix, total = os.path.join(shm._SHM_DIR, shm.FILE_PREFIX), 0
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and fields[5].startswith(prefix):
                    start, end = fields[0].split("-")
                    total += int(end, 16) - int(start, 16)
    except OSError:
        return 0
    return total


def _forget_pool(pool: _Pool) -> None:
    """Drop ``pool`` (dead, or in an unknown state): the next call of its size starts anew."""
    if _POOLS.get(pool.world_size) is pool:
        del _POOLS[pool.world_size]


def shutdown_pool() -> None:
    """Stop every live pool (at exit, at session end)."""
    while _POOLS:
        _stop_least_recently_used()


def pool_pids() -> list[int | None]:
    """Process ids of the workers of the last world size called, if its pool is alive (empty
    if not): lets tests check reuse."""
    pool = _POOLS.get(_LAST_WORLD_SIZE) if _LAST_WORLD_SIZE is not None else None
    return [] if pool is None else pool.pids


def _call_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of ``fn``, for messages."""
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _pickle_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    """Pickle the call, with a clear error for the usual mistakes."""
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(
            f"run_on_ranks needs a function importable by name, got {_call_name(fn)}: "
            "define it at module level in the test module"
        )
    try:
        return pickle.dumps((fn, args, kwargs))
    except Exception as exc:
        raise TypeError(
            f"run_on_ranks could not pickle the call to {_call_name(fn)}: {exc}; "
            "pass module-level functions and picklable arguments"
        ) from exc


def run_on_ranks(
    world_size: int,
    fn: Callable[..., Any],
    /,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the results by rank.

    ``fn`` runs in a persistent worker with the default gloo group initialised
    (``dist.get_rank()`` is the rank). It must be a module-level function of an importable
    module (a test module or ``tests/``), and arguments and results must be picklable.
    ``env`` sets environment variables in the workers for this call only. If some rank
    raises, or does not answer within ``timeout`` seconds, this raises :class:`RankError`
    (:class:`RankTimeoutError` for a pure timeout) whose message holds each failing rank's
    traceback, and the stacks of ranks that were stuck. ``pytest.skip`` called on the
    ranks skips the test. The keyword names ``timeout`` and ``env`` are the harness's.
    """
    __tracebackhide__ = True
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    payload = _pickle_call(fn, args, kwargs)
    pool = _get_pool(world_size)
    try:
        results, skip_reason = pool.run(_call_name(fn), payload, env, timeout)
    except RankError:
        if not pool.alive:
            _forget_pool(pool)
        raise
    except BaseException:
        # An interrupt mid-call: the workers' state is unknown, start afresh next time.
        _forget_pool(pool)
        pool.discard()
        raise
    if skip_reason is not None:
        import pytest

        pytest.skip(skip_reason)
    return results


def requires_cuda_gpus(n: int) -> pytest.MarkDecorator:
    """Skip marker for tests that need at least ``n`` CUDA GPUs."""
    import pytest
    import torch

    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return pytest.mark.skipif(found < n, reason=f"needs {n} CUDA GPUs, found {found}")


atexit.register(shutdown_pool)
