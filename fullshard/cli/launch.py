"""``fullshard train`` in the calling process: validate the options, then launch the ranks.

The options are checked here, before any rank starts; then the ranks start through torch's
elastic launcher (``torch.distributed.run``, the agent behind ``torchrun``), each running
`fullshard.cli.train`. On one machine the rendezvous is bound to 127.0.0.1 on a free port
(``--master-port`` picks one). Multi-node jobs run the same command on every machine:
``--nnodes``, ``--node-rank``, ``--rdzv-endpoint``, ``--rdzv-backend`` (c10d when an
endpoint is given), ``--rdzv-id``, ``--master-addr``, ``--master-port`` and
``--max-restarts`` pass through to the launcher.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import reshard_flag

if TYPE_CHECKING:
    from .train_options import TrainConfig

__all__ = ["main"]


def _launcher_parser() -> argparse.ArgumentParser:
    # No abbreviations: this parser splits the launcher's flags from the ranks' own, and
    # both must read a flag the same way.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    group = parser.add_argument_group("launcher (torch.distributed.run)")
    group.add_argument(
        "--nproc-per-node",
        "--ranks",
        dest="nproc_per_node",
        type=int,
        default=2,
        help="ranks on this machine (default 2)",
    )
    group.add_argument("--nnodes", default="1", help="machines, or MIN:MAX (default 1)")
    group.add_argument("--node-rank", type=int, default=None, help="this machine's index")
    group.add_argument(
        "--rdzv-backend",
        default=None,
        help="default: c10d (static with --master-addr and no --rdzv-endpoint)",
    )
    group.add_argument(
        "--rdzv-endpoint",
        default=None,
        help="HOST:PORT of the rendezvous (multi-node); default 127.0.0.1:<free port>",
    )
    group.add_argument("--rdzv-id", default=None, help="job id shared by every machine")
    group.add_argument(
        "--master-addr", default=None, help="static rendezvous host (with --node-rank)"
    )
    group.add_argument("--master-port", type=int, default=None, help="rendezvous port")
    group.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the ranks this many times after a failure; restarts resume from the "
        "last checkpoint",
    )
    return parser


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError as error:
            if error.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launcher_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """torch.distributed.run's options for these launcher arguments."""
    if args.nproc_per_node <= 0:
        parser.error(f"--nproc-per-node must be positive, got {args.nproc_per_node}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.master_port is not None and not 0 < args.master_port < 65536:
        parser.error(f"--master-port must be in 1..65535, got {args.master_port}")
    argv = [
        f"--nproc-per-node={args.nproc_per_node}",
        f"--nnodes={args.nnodes}",
        f"--max-restarts={args.max_restarts}",
        "--monitor-interval=0.5",
    ]
    if _multi_node(args):
        return argv + _multi_node_argv(args, parser)
    # One machine: a c10d rendezvous on loopback, never reachable from the network; the
    # agent's store for the ranks is hosted at --local-addr (by default this machine's
    # FQDN), so that is loopback too.
    port = args.master_port
    if port is None:
        port = _free_port()
    elif not _port_free("127.0.0.1", port):
        parser.error(
            f"--master-port {port} is in use on 127.0.0.1 (another job?); pass another port, "
            "or leave --master-port out to pick a free one"
        )
    if args.node_rank is not None:
        argv.append(f"--node-rank={args.node_rank}")
    argv += [
        f"--rdzv-backend={args.rdzv_backend or 'c10d'}",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id={args.rdzv_id or uuid.uuid4().hex[:12]}",
        "--local-addr=127.0.0.1",
    ]
    return argv


def _multi_node(args: argparse.Namespace) -> bool:
    return bool(args.nnodes != "1" or args.rdzv_endpoint or args.master_addr)


def _multi_node_argv(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The rendezvous of a job over several machines, as every machine's launcher gives it:
    c10d at ``--rdzv-endpoint`` (the default when one is given; the first launcher there
    hosts the store), else torch's static rendezvous at ``--master-addr:--master-port``,
    where each machine needs its ``--node-rank``."""
    backend = args.rdzv_backend or ("c10d" if args.rdzv_endpoint else "static")
    try:
        max_nodes = int(args.nnodes.split(":")[-1])
    except ValueError:
        parser.error(f"--nnodes must be N or MIN:MAX, got {args.nnodes!r}")
    if backend == "static" and args.node_rank is None and max_nodes > 1:
        # Left to torch, every machine would be node 0 and host its own store: the second
        # fails on its port (on one machine) or waits for peers that never come (on many).
        parser.error(
            f"--nnodes {args.nnodes} with the static rendezvous (--master-addr, "
            "--master-port) needs --node-rank on every machine: 0 on the one at "
            "--master-addr, 1 to N-1 on the others; or give every machine the same "
            "--rdzv-endpoint HOST:PORT (c10d), which needs no --node-rank"
        )
    argv = [f"--rdzv-backend={backend}"]
    for flag, value in (
        ("--node-rank", args.node_rank),
        ("--master-addr", args.master_addr),
        ("--master-port", args.master_port),
        ("--rdzv-endpoint", args.rdzv_endpoint),
        ("--rdzv-id", args.rdzv_id),
    ):
        if value not in (None, ""):
            argv.append(f"{flag}={value}")
    if backend == "c10d" and args.rdzv_endpoint:
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        try:
            host, _ = parse_rendezvous_endpoint(args.rdzv_endpoint, default_port=29400)
        except ValueError as error:
            parser.error(f"--rdzv-endpoint {args.rdzv_endpoint!r}: {error}")
        if host in _LOOPBACK:
            # Every node is on this machine (a rehearsal): the agent's store stays on loopback
            # too (its host is --local-addr, by default the machine's FQDN).
            argv.append("--local-addr=127.0.0.1")
    return argv


def main(argv: list[str]) -> int:
    """``fullshard train``: the ranks' options are checked here, then the launcher starts them."""
    from dataclasses import replace

    from .train_options import add_arguments, config_from_args
    from .train_output import checkpoint_problem

    launcher = _launcher_parser()
    parser = argparse.ArgumentParser(
        prog="fullshard train",
        parents=[launcher],
        allow_abbrev=False,
        description="Train a byte-level GPT with fullshard's FSDP; rank 0 shows progress, "
        "writes report.json and report.png into --out, and checkpoints there.",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args, parser)
    if config.out is None:
        if _multi_node(args):
            parser.error(
                f"--nnodes {args.nnodes}: give every machine the same --out, a folder on a "
                "filesystem they share (the checkpoint is one folder written by every rank; "
                "without --out each machine would name its own from its clock)"
            )
        config = replace(config, out=time.strftime("runs/%Y%m%d-%H%M%S"))
    problem = (
        checkpoint_problem(config, config.resume)
        or _tp_world_problem(config, args)
        or _reshard_problem(config, args)
    )
    if problem is not None:  # refused before any rank starts
        parser.error(problem)
    launch_args, worker_argv = launcher.parse_known_args(argv)
    worker_argv = [*worker_argv, "--out", str(config.out)]  # the last --out wins
    launch = [*_launcher_argv(launch_args, parser), "-m", "fullshard.cli.train", *worker_argv]
    return _launch(launch, Path(str(config.out)))


def _tp_world_problem(config: TrainConfig, args: argparse.Namespace) -> str | None:
    """``--tp`` that does not divide the ranks (an elastic ``--nnodes MIN:MAX`` world is
    left to the ranks, which raise the same)."""
    if config.tp == 1 or not args.nnodes.isdigit():
        return None
    world_size = args.nproc_per_node * int(args.nnodes)
    if world_size % config.tp == 0:
        return None
    nodes = f" x --nnodes {args.nnodes}" if int(args.nnodes) > 1 else ""
    return (
        f"--tp {config.tp} must divide the {world_size} ranks (--ranks {args.nproc_per_node}"
        f"{nodes}): each data-parallel rank is --tp ranks; pick --ranks so that it does, or "
        "another --tp"
    )


def _reshard_problem(config: TrainConfig, args: argparse.Namespace) -> str | None:
    """An int ``--reshard-after-forward`` that fully_shard would refuse on every rank: not a
    factor of the shard group's ranks (a node's for HYBRID_SHARD, else the world's; an
    elastic ``--nnodes MIN:MAX`` world is left to the ranks)."""
    shard_ranks = args.nproc_per_node
    if config.sharding_strategy != "HYBRID_SHARD":
        if not args.nnodes.isdigit():
            return None
        shard_ranks *= int(args.nnodes)
    problem = reshard_flag.factor_problem(config.reshard_after_forward, shard_ranks)
    if problem is None:
        return None
    where = "ranks per node" if config.sharding_strategy == "HYBRID_SHARD" else "ranks"
    return f"--reshard-after-forward: {problem} (the shard group's {where})"


def _loopback_listener(host_name: str, port: int) -> tuple[int, int]:
    """A socket listening on loopback at ``port`` (0: a free one): its descriptor and port.

    Raises what ``TCPStore(is_master=True)`` raises where the port is taken
    (`torch.distributed.DistNetworkError`): torch's c10d rendezvous then joins as a client,
    which is how the second launcher on a machine finds the first one's store."""
    import torch.distributed as dist

    family, address = (
        (socket.AF_INET6, "::1") if host_name == "::1" else (socket.AF_INET, "127.0.0.1")
    )
    with socket.socket(family) as listener:
        # As TCPStore's own server does: a port whose last connections are in TIME_WAIT
        # (a restarted job's) can be listened on again.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((address, port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise dist.DistNetworkError(
                f"fullshard train: the store at {host_name}:{port} cannot listen on "
                f"{address}:{port}, which another process holds (address already in use)"
            ) from error
        listener.listen(4096)
        port = listener.getsockname()[1]
        return listener.detach(), port  # the store owns the descriptor (and closes it)


@contextlib.contextmanager
def _stores_on_loopback() -> Iterator[None]:
    """Inside, TCPStore servers for a loopback host listen on loopback only.

    torch's elastic agent creates its stores (the rendezvous store, the agent's store for
    the ranks) with ``TCPStore(host, port, is_master=True)``, which listens on every
    interface whatever ``host`` is. A server for a loopback host is given a socket bound to
    loopback instead (``master_listen_fd``); other hosts (multi-node across machines) are
    left alone. Where the port is taken, the store fails as torch's would, so a c10d
    rendezvous decides server or client exactly as under ``torchrun``: every launcher whose
    host is the endpoint's tries to host the store, and all but the first connect to it.
    See [Note: two launchers on one machine]."""
    import torch.distributed as dist
    import torch.distributed.elastic.rendezvous.c10d_rendezvous_backend as c10d_backend

    original = dist.TCPStore

    class LoopbackTCPStore(original):  # type: ignore[misc, valid-type]
        def __init__(self, host_name: str, port: int, *args: Any, **kwargs: Any) -> None:
            names = ("world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant")
            options = dict(zip(names, args), **kwargs)
            if (
                options.get("is_master")
                and host_name in _LOOPBACK
                and options.get("master_listen_fd") is None
            ):
                options["master_listen_fd"], port = _loopback_listener(host_name, port)
            super().__init__(host_name, port, **options)

    dist.TCPStore = LoopbackTCPStore  # type: ignore[misc]
    c10d_backend.TCPStore = LoopbackTCPStore  # type: ignore[misc]
    try:
        yield
    finally:
        dist.TCPStore = original  # type: ignore[misc]
        c10d_backend.TCPStore = original  # type: ignore[misc]


# Note: two launchers on one machine
# ``--nnodes 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.1:P`` run twice on one machine
# (a multi-node job rehearsed on loopback): both launchers see the endpoint as their own
# host (`_matches_machine_hostname`), so both try ``TCPStore(is_master=True)``. torch's
# c10d backend retries as a client when that raises a ValueError, RuntimeError or
# TimeoutError; a plain OSError from binding is none of those and ended the second
# launcher ("Address already in use") while the first waited for it until the join
# timeout. `_loopback_listener` raises `DistNetworkError` (a RuntimeError), the type
# TCPStore itself raises for a port in use, and the retry connects the second launcher.
# tests/cli/test_cli.py::test_two_launchers_on_loopback_train_as_two_nodes.


def _launch(launch: list[str], out: Path) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one compute thread per rank, no warning
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        with _stores_on_loopback():
            run(parse_args(launch))
    except SignalException as stop:
        print(
            f"\nfullshard train: stopped by {stop.sigval.name}; every rank was stopped. The last "
            f"complete checkpoint in {out}/checkpoint is intact: continue with the same "
            "command plus --resume",
            file=sys.stderr,
        )
        return 128 + int(stop.sigval)
    except ChildFailedError as failure:
        print(f"\nfullshard train: a rank failed:\n{failure.format_msg()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\nfullshard train: interrupted; the last complete checkpoint in {out}/checkpoint "
            "is intact: continue with --resume",
            file=sys.stderr,
        )
        return 130
    return 0
