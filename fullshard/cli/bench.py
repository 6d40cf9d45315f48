"""``fullshard bench``: one training step under local, DDP, torch FSDP1, torch FSDP2 and
fullshard, alternated.

One invocation spawns ``--world-size`` ranks (gloo on CPU, NCCL on CUDA) that train the same
GPT (``fullshard.examples.gpt``), on the same data, with Adam, each engine wrapping one unit
per transformer block. Engines run in rounds (A B C A B C ...) so drift on the machine hits
them alike. Per engine it reports the median step time, per-rank peak memory added during
training (CPU: ``VmHWM`` after ``clear_refs``; CUDA: ``max_memory_allocated``), the bytes each
rank sent per step (CPU: loopback traffic / ranks, plus what fullshard wrote into its
shared-memory transport), and the
last loss, which must match DDP's. ``--transports shm,rings`` runs fullshard's engines over
both of its CPU transports (shared memory between ranks of one host, and the rings over
gloo's TCP, as between hosts: ``ENGINE@rings``). Each engine's run is a fresh set of processes, so no
engine inherits another's allocator state. Prints a table with ratios, writes JSON, and
with ``--plot`` a PNG.

    fullshard bench --config comm --world-size 2 --json out.json --plot out.png

torch's engines (FSDP1, FSDP2) are in ``benchmarks/torch_fsdp.py`` of the source checkout,
outside the package, which never imports torch's FSDP; without that file the benchmark runs
local, DDP and fullshard.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import os
import re
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from fullshard.cli.plan import ModelShape, gpt_shape, make_plan
from fullshard.examples.gpt import GPT, Block, GPTConfig, num_params

ENGINES = ["local", "ddp", "fsdp1", "fsdp2", "fullshard", "fullshard-fsdp2", "fullshard-fsdp2-int8"]
"""``fullshard-fsdp2-int8``: the FSDP2 door with compressed communication
(``fullshard.compress``: weights all-gathered as int8, gradients reduced in bf16); not in
the default list, as its numbers are not the same computation's."""
DEFAULT_ENGINES = ENGINES[:-1]
TORCH_ENGINES = ("fsdp1", "fsdp2")
"""Engines defined in `TORCH_ENGINES_FILE`."""
TORCH_ENGINES_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "torch_fsdp.py"
"""In the source checkout, beside the package: this file is ``fullshard/cli/bench.py``."""


def _torch_engines() -> Any:
    """``benchmarks/torch_fsdp.py``, loaded from the source checkout (once per process)."""
    module = sys.modules.get("fullshard_bench_torch_fsdp")
    if module is None:
        spec = importlib.util.spec_from_file_location(
            "fullshard_bench_torch_fsdp", TORCH_ENGINES_FILE
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


@dataclass(frozen=True)
class BenchConfig:
    """A model shape and a per-rank batch."""

    name: str
    n_layers: int
    d_model: int
    mlp_ratio: int
    batch: int
    seq_len: int
    n_heads: int = 8

    def gpt(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=256,
            seq_len=self.seq_len,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_layers=self.n_layers,
            mlp_ratio=self.mlp_ratio,
        )


CONFIGS = {
    "comm": BenchConfig("comm", n_layers=8, d_model=1024, mlp_ratio=4, batch=2, seq_len=64),
    "compute": BenchConfig("compute", n_layers=6, d_model=256, mlp_ratio=4, batch=8, seq_len=128),
    "tiny": BenchConfig(
        "tiny", n_layers=2, d_model=64, mlp_ratio=4, batch=2, seq_len=16, n_heads=4
    ),
}


@dataclass
class EngineResult:
    engine: str
    step_times: list[float] = field(default_factory=list)
    peak_mib: list[float] = field(default_factory=list)
    """Per rank, the largest peak seen over the rounds."""
    bytes_per_step: float = 0.0
    shared_memory_bytes_per_step: float = 0.0
    """Of ``bytes_per_step``, what went through fullshard's shared-memory transport."""
    loss: float = float("nan")

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_times) if self.step_times else float("nan")


# -- measurement ----------------------------------------------------------------------------


def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        match = re.search(rf"{field_name}:\s+(\d+) kB", status.read())
    return int(match.group(1)) if match else 0


def _reset_peak(device: torch.device) -> float:
    """Start a new peak; returns the current usage in MiB (the baseline)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _rss_kib("VmRSS") / 1024


def _peak(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return _rss_kib("VmHWM") / 1024


def _loopback_bytes() -> int:
    with open("/proc/net/dev") as dev:
        for line in dev:
            if line.strip().startswith("lo:"):
                return int(line.split(":")[1].split()[8])  # transmitted bytes
    return 0


# -- engines --------------------------------------------------------------------------------


def _wrap(
    engine: str, model: nn.Module, args: argparse.Namespace, device: torch.device
) -> nn.Module:
    bf16 = args.mixed_precision == "bf16"
    if engine == "local":
        return model
    if engine == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    if engine in TORCH_ENGINES:
        wrap = getattr(_torch_engines(), f"wrap_{engine}")
        return wrap(model, args, device, Block)
    import fullshard
    from fullshard.wrap import ModuleWrapPolicy as OurPolicy

    if engine.startswith("fullshard-fsdp2"):  # fullshard's fully_shard, as torch's FSDP2 is
        reshard = args.strategy == "FULL_SHARD"
        policy = fullshard.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if bf16 else None
        options: dict[str, Any] = {"reshard_after_forward": reshard}
        if engine == "fullshard-fsdp2-int8":
            from fullshard.compress import bf16_gradients, int8_all_gather

            int8_all_gather(model)
            policy = bf16_gradients(policy)
        if policy is not None:
            options["mp_policy"] = policy
        for module in [m for m in model.modules() if isinstance(m, Block)] + [model]:
            fullshard.fully_shard(module, **options)
        return model
    return fullshard.FullyShardedDataParallel(
        model,
        auto_wrap_policy=OurPolicy({Block}),
        sharding_strategy=fullshard.ShardingStrategy[args.strategy],
        mixed_precision=fullshard.MixedPrecision(torch.bfloat16, torch.bfloat16) if bf16 else None,
        device_id=device,
        forward_prefetch=args.forward_prefetch,
        backward_prefetch=_backward_prefetch(args, fullshard.BackwardPrefetch),
    )


def _backward_prefetch(args: argparse.Namespace, enum_type: Any) -> Any:
    return None if args.backward_prefetch == "none" else enum_type[args.backward_prefetch]


def _batch(
    config: BenchConfig, rank: int, step: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10_000 * step + rank)
    tokens = torch.randint(0, 256, (config.batch, config.seq_len + 1), generator=generator)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T) each


def _run_engine(
    engine: str, config: BenchConfig, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    rank = dist.get_rank()
    runs_here = engine != "local" or rank == 0
    result: dict[str, Any] = {"times": [], "peak_mib": 0.0, "bytes": 0.0, "loss": float("nan")}
    dist.barrier()
    if runs_here:
        torch.manual_seed(0)
        model = _wrap(engine, GPT(config.gpt()).to(device), args, device)
        optim = torch.optim.Adam(model.parameters(), lr=1e-3)
        baseline = _reset_peak(device)
        sent_before, shared_before, counted_before = 0, 0, 0.0
        for step in range(args.warmup + args.steps):
            if step == args.warmup:
                sent_before = _loopback_bytes()
                shared_before = _shared_memory_bytes()
                counted_before = _fullshard_bytes()
            inputs, targets = _batch(config, rank, step, device)
            if engine != "local":
                dist.barrier()
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.autocast(device.type, torch.bfloat16, enabled=_autocast(engine, args)):
                logits = model(inputs)  # (B, T, V)
            loss = F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))
            loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            if step >= args.warmup:
                result["times"].append(elapsed)
            result["loss"] = loss.item()
        result["peak_mib"] = _peak(device) - baseline
        if engine != "local":
            over_loopback = (_loopback_bytes() - sent_before) / dist.get_world_size()
            over_shared_memory = _shared_memory_bytes() - shared_before
            result["bytes"] = (over_loopback + over_shared_memory) / args.steps
            result["shared_memory_bytes"] = over_shared_memory / args.steps
            if engine.startswith("fullshard"):
                result["counted_bytes"] = (_fullshard_bytes() - counted_before) / args.steps
            total = torch.tensor([result["loss"]], device=device)
            dist.all_reduce(total)
            result["loss"] = total.item() / dist.get_world_size()
        del model, optim
    dist.barrier()
    return result


def _autocast(engine: str, args: argparse.Namespace) -> bool:
    """local and DDP get bf16 through autocast; the FSDP engines through their own policy."""
    return args.mixed_precision == "bf16" and engine in ("local", "ddp")


def _shared_memory_bytes() -> int:
    """Bytes this rank wrote into fullshard's shared-memory transport (its sends)."""
    if "fullshard._comm.shared_memory" not in sys.modules:
        return 0
    from fullshard._comm import shared_memory as _shared_memory

    return _shared_memory.BYTES_WRITTEN


def _fullshard_bytes() -> float:
    from fullshard._comm.collectives import COUNTERS

    return COUNTERS.total_bytes


def _worker(rank: int, args: argparse.Namespace, engine: str, port: int, out: str) -> None:
    """One engine's run on this rank, in a fresh process: every engine starts from a clean
    allocator, so one engine's leftovers do not count against the next."""
    torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if use_cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=args.world_size,
    )
    result = _run_engine(engine, CONFIGS[args.config], args, device)
    gathered: list[Any] = [None] * args.world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    # Skip the process group's teardown: about one run in six, gloo aborted in it here
    # ("terminate called without an active exception") after the results were written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _summarise(
    gathered: list[dict[str, list[dict[str, Any]]]], engines: list[str]
) -> list[EngineResult]:
    results = []
    for engine in engines:
        result = EngineResult(engine)
        rank0_runs = gathered[0][engine]
        for run in rank0_runs:
            result.step_times.extend(run["times"])
        result.peak_mib = [
            max(run["peak_mib"] for run in rank_runs[engine]) for rank_runs in gathered
        ]
        result.bytes_per_step = statistics.median(run["bytes"] for run in rank0_runs)
        result.shared_memory_bytes_per_step = statistics.median(
            run.get("shared_memory_bytes", 0.0) for run in rank0_runs
        )
        result.loss = rank0_runs[-1]["loss"]
        results.append(result)
    return results


def _table(
    results: list[EngineResult], config: BenchConfig, args: argparse.Namespace, params: int
) -> str:
    by_name = {r.engine: r for r in results}
    lines = [
        f"config {config.name}: {config.n_layers} layers, d_model {config.d_model}, ffn "
        f"{config.mlp_ratio * config.d_model}, {params / 1e6:.1f}M params, batch "
        f"{config.batch}x{config.seq_len} per rank; {args.world_size} ranks, {args.device}, "
        f"{args.strategy}, precision {args.mixed_precision}, {args.rounds} rounds x {args.steps} steps"
        + (f", transport {args.runs[0][2]}" if args.device == "cpu" else ""),
        "",
        "| engine | median step (s) | vs local | vs DDP | vs FSDP1 | vs FSDP2 | peak MiB per rank | MB sent per rank per step | final loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        ratios = []
        for other in ("local", "ddp", "fsdp1", "fsdp2"):
            base = by_name.get(other)
            ratios.append(f"{result.median_s / base.median_s:.2f}x" if base else "-")
        peaks = " / ".join(f"{p:.0f}" for p in result.peak_mib)
        lines.append(
            f"| {result.engine} | {result.median_s:.3f} | {' | '.join(ratios)} | {peaks} | "
            f"{result.bytes_per_step / 1e6:.1f} | {result.loss:.6f} |"
        )
    ddp = by_name.get("ddp")
    if ddp is not None:
        for result in results:
            if result.engine == "local":  # rank 0's data only: its own loss
                continue
            if abs(result.loss - ddp.loss) > 1e-4 * abs(ddp.loss):
                lines.append(
                    f"\nWARNING: {result.engine}'s loss {result.loss} differs from DDP's {ddp.loss}"
                )
    return "\n".join(lines)


def _predicted_mib(config: BenchConfig, args: argparse.Namespace, api: str = "fsdp1") -> float:
    """fullshard's analytical peak memory added by training (``fullshard plan``'s model)
    through the door ``api``: ``fsdp1`` (``FullyShardedDataParallel``) or ``fsdp2``."""
    plan = make_plan(
        bench_shape(config),
        args.world_size,
        args.strategy,
        mixed_precision=args.mixed_precision,
        batch=config.batch,
        device=args.device,
        api=api,
    )
    return plan.memory.peak_added / 2**20


def bench_shape(config: BenchConfig) -> ModelShape:
    """The `fullshard.cli.plan` shape of a benchmark configuration's GPT."""
    return gpt_shape(
        f"bench-{config.name}", config.n_layers, config.d_model, config.n_heads, config.seq_len
    )


def _plot(results: list[EngineResult], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r.engine for r in results]
    ax_time.bar(names, [r.median_s for r in results], color="tab:blue")
    ax_time.set_ylabel("median step time (s)")
    ax_mem.bar(names, [max(r.peak_mib) for r in results], color="tab:orange")
    ax_mem.set_ylabel("peak MiB added per rank (max over ranks)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    gathered = _run_rounds(args)
    config = CONFIGS[args.config]
    results = _summarise(gathered, [label for label, _, _ in args.runs])
    params = num_params(GPT(config.gpt()))
    print(_table(results, config, args, params))
    _report_memory_model(results, config, args)
    if args.json:
        _write_json(args.json, results, config, args, params)
    if args.plot:
        _plot(results, args.plot, f"{config.name}: {args.world_size} ranks, {args.device}")
    return 0


def _available_engines() -> list[str]:
    """The engines this installation can run: torch's need `TORCH_ENGINES_FILE`."""
    if TORCH_ENGINES_FILE.exists():
        return DEFAULT_ENGINES
    return [e for e in DEFAULT_ENGINES if e not in TORCH_ENGINES]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="fullshard bench", description="training step: local, DDP, torch FSDP1/2, fullshard"
    )
    parser.add_argument("--config", choices=sorted(CONFIGS), default="comm")
    available = _available_engines()
    parser.add_argument(
        "--engines",
        default=",".join(available),
        help=f"comma-separated, from {ENGINES} (default: {','.join(available)}); "
        "fullshard-fsdp2-int8 is the FSDP2 door with int8 weight all-gathers and bf16 "
        "gradient reductions (fullshard.compress)",
    )
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--strategy", choices=["FULL_SHARD", "SHARD_GRAD_OP"], default="FULL_SHARD")
    parser.add_argument("--mixed-precision", choices=["none", "bf16"], default="none")
    parser.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="forward_prefetch=True for torch FSDP1 and fullshard (FSDP2 always prefetches)",
    )
    parser.add_argument(
        "--backward-prefetch",
        choices=["BACKWARD_PRE", "BACKWARD_POST", "none"],
        default="BACKWARD_PRE",
        help="backward_prefetch for torch FSDP1 and fullshard (both default to BACKWARD_PRE)",
    )
    parser.add_argument(
        "--transports",
        default=None,
        help="comma-separated, from shm,rings (CPU): fullshard's engines between ranks of one "
        "host through shared memory, and through the rings over gloo's TCP as between hosts "
        "(FULLSHARD_SHM=0), listed as ENGINE@rings; default: the one FULLSHARD_SHM selects",
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per engine per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG chart here")
    args = parser.parse_args(argv)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"unknown engines {unknown}; choose from {ENGINES}")
    args.runs = _runs(parser, args)
    missing = sorted(set(args.engines) & set(TORCH_ENGINES) - set(available))
    if missing:
        parser.error(
            f"engines {missing} are torch's FSDP, defined in {TORCH_ENGINES_FILE}, which this "
            "installation lacks: run from a source checkout of fullshard"
        )
    return args


_TRANSPORTS = {"shm": "1", "rings": "0"}
"""``--transports``: the ``FULLSHARD_SHM`` each sets for its runs."""


def _runs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(label, engine, transport) of every run a round: each engine over the first transport,
    fullshard's also over the others (the rest never use fullshard's transport)."""
    default = "rings" if os.environ.get("FULLSHARD_SHM", "1") == "0" else "shm"
    transports = [t.strip() for t in (args.transports or default).split(",") if t.strip()]
    unknown = sorted(set(transports) - set(_TRANSPORTS))
    if unknown or not transports:
        parser.error(f"unknown transports {unknown}; choose from {sorted(_TRANSPORTS)}")
    if args.device == "cuda" and args.transports is not None:
        parser.error("--transports picks how CPU ranks meet; CUDA ranks use NCCL")
    runs = [(engine, engine, transports[0]) for engine in args.engines]
    for transport in transports[1:]:
        runs += [
            (f"{engine}@{transport}", engine, transport)
            for engine in args.engines
            if engine.startswith("fullshard")
        ]
    return runs


def _run_rounds(args: argparse.Namespace) -> list[dict[str, list[dict[str, Any]]]]:
    """Every run's results, per rank: ``gathered[rank][label]`` lists one result a round."""
    out = f"/tmp/fullshard-bench-{os.getpid()}.json"
    gathered: list[dict[str, list[dict[str, Any]]]] = [
        {label: [] for label, _, _ in args.runs} for _ in range(args.world_size)
    ]
    with mock.patch.dict(os.environ):  # the caller's FULLSHARD_SHM back, even on an error
        for _ in range(args.rounds):  # A B C ..., A B C ...: drift hits every engine alike
            for label, engine, transport in args.runs:
                os.environ["FULLSHARD_SHM"] = _TRANSPORTS[transport]  # the ranks inherit it
                worker_args = (args, engine, _free_port(), out)
                mp.spawn(_worker, args=worker_args, nprocs=args.world_size, join=True)
                for rank, result in enumerate(json.loads(Path(out).read_text())):
                    gathered[rank][label].append(result)
                os.remove(out)
    return gathered


_MODELLED_APIS = {"fullshard": "fsdp1", "fullshard-fsdp2": "fsdp2"}  # not the int8 variant


def _memory_model_rows(
    results: list[EngineResult], config: BenchConfig, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Per fullshard run: predicted and measured (max over ranks) MiB, error (None: not modelled)."""
    engines = {label: (engine, transport) for label, engine, transport in args.runs}
    rows = []
    for result in results:
        engine, transport = engines.get(result.engine, (result.engine, "shm"))
        api = _MODELLED_APIS.get(engine)  # the rings' staging (gloo's) is not modelled
        predicted = None
        if api and (transport == "shm" or args.device == "cuda"):
            predicted = _predicted_mib(config, args, api)
        peak = max(result.peak_mib)
        error = None if predicted is None else 100 * (predicted - peak) / peak
        if engine.startswith("fullshard"):
            rows.append({"engine": result.engine, "api": api, "predicted_mib": predicted,
                         "measured_mib": peak, "error_pct": error})  # fmt: skip
    return rows


def _report_memory_model(
    results: list[EngineResult], config: BenchConfig, args: argparse.Namespace
) -> None:
    """Each fullshard door's measured peak against ``fullshard plan``'s prediction."""
    for row in _memory_model_rows(results, config, args):
        measured = f"{row['measured_mib']:.0f} MiB measured (max over ranks)"
        if row["predicted_mib"] is None:
            print(f"\n{row['engine']} memory model: not modelled; {measured}")
        else:
            print(
                f"\n{row['engine']} memory model ({row['api']}): {row['predicted_mib']:.0f} "
                f"MiB added per rank predicted, {measured}: {row['error_pct']:+.1f}%"
            )


def _write_json(
    path: str,
    results: list[EngineResult],
    config: BenchConfig,
    args: argparse.Namespace,
    params: int,
) -> None:
    Path(path).write_text(
        json.dumps(
            {
                "config": asdict(config),
                "args": {k: v for k, v in vars(args).items()},
                "params": params,
                "predicted_fullshard_peak_mib": _predicted_mib(config, args),
                "memory_model": _memory_model_rows(results, config, args),
                "results": [{**asdict(r), "median_s": r.median_s} for r in results],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    sys.exit(main())
