"""Where one rank's training step goes, per engine: time and peak memory of each phase
(forward, backward, optimizer step), the host's hottest functions (cProfile), and the calls
that make the host wait for the device (CUDA's sync debug mode).

One process, world size 1 (NCCL on CUDA, gloo on the CPU), the engines and models of
``fullshard bench``. At world size 1 no bytes move, so what differs between engines is each
engine's own host work and memory: what a device check can measure in seconds. Under
``torchrun --nproc-per-node N`` every rank steps and rank 0 reports (its phases then include
waiting for the others).

    python tools/step_profile.py --device cuda --config comm --engines fullshard-fsdp2,fsdp2 \
        --mixed-precision bf16 --profile 25 --sync-debug
"""

from __future__ import annotations

import argparse
import dataclasses
import cProfile
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fullshard.cli import bench
from fullshard.examples.gpt import GPT

PHASES = ("forward", "backward", "optimizer")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else float("nan")


def _step(model: Any, optim: Any, args: argparse.Namespace, engine: str, step: int) -> dict:
    """One step, timed and measured per phase. Each phase ends with a device sync, except
    with ``--whole-step``: then a phase's time is the host's, and ``step`` the whole step's
    wall time, with the device's work overlapping the host's as in training."""
    device = args.torch_device
    _sync(device)
    step_start = time.perf_counter()
    inputs, targets = bench._batch(_config(args), dist.get_rank(), step, device)
    out: dict[str, tuple[float, float]] = {}
    start_mib = torch.cuda.memory_allocated() / 2**20 if device.type == "cuda" else 0.0

    def phase(name: str, work: Any) -> Any:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        result = work()
        if not args.whole_step:
            _sync(device)
        out[name] = (time.perf_counter() - start, _peak_mib(device) - start_mib)
        return result

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, torch.bfloat16, enabled=bench._autocast(engine, args)):
            logits = model(inputs)
        return F.cross_entropy(logits.float().reshape(-1, 256), targets.reshape(-1))

    loss = phase("forward", forward)
    phase("backward", loss.backward)
    phase("optimizer", lambda: (optim.step(), optim.zero_grad(set_to_none=True)))
    _sync(device)
    out["step"] = (time.perf_counter() - step_start, 0.0)
    return out


def _config(args: argparse.Namespace) -> Any:
    """The bench's config ``--config``, with ``--layers`` / ``--d-model`` if given (the
    host-overhead probe: many small blocks, little compute)."""
    config = bench.CONFIGS[args.config]
    changes = {"n_layers": args.layers, "d_model": args.d_model}
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v})


def _profile_engine(engine: str, args: argparse.Namespace) -> None:
    device = args.torch_device
    torch.manual_seed(0)
    config = _config(args)
    model = bench._wrap(engine, GPT(config.gpt()).to(device), args, device)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3, foreach=args.foreach)
    for step in range(args.warmup):
        _step(model, optim, args, engine, step)
    rows = [_step(model, optim, args, engine, args.warmup + s) for s in range(args.steps)]
    summary = []
    for name in PHASES:
        median = statistics.median(row[name][0] for row in rows)
        peak = max(row[name][1] for row in rows)
        summary.append(f"{name} {median * 1000:.1f} ms, peak +{peak:.0f} MiB")
    total = statistics.median(row["step"][0] for row in rows)
    mode = f"foreach {args.foreach}, threads {torch.get_num_threads()}"
    mode += ", host times" if args.whole_step else ", phases synced"
    print(f"\n## {engine} ({mode}): step {total * 1000:.1f} ms ({'; '.join(summary)})")
    if args.sync_debug and device.type == "cuda":
        _report_syncs(model, optim, args, engine)
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for s in range(args.steps):
            _step(model, optim, args, engine, 1000 + s)
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("tottime")
        print(f"### {engine}: cProfile of {args.steps} steps, by own time", flush=True)
        stats.print_stats(args.profile)
        print(f"### {engine}: fullshard's functions by cumulative time", flush=True)
        stats.sort_stats("cumtime").print_stats("fullshard", args.profile)


def _report_syncs(model: Any, optim: Any, args: argparse.Namespace, engine: str) -> None:
    """Each place in two steps that synchronises the host with the device (CUDA's sync debug
    mode warns there), counted, with the innermost frames of its Python stack."""
    seen: dict[str, int] = {}

    def record(message: Any, *rest: Any, **kwargs: Any) -> None:
        if "synchroniz" in str(message):
            frames = traceback.extract_stack()[:-2][-args.sync_frames :]
            key = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames))
            seen[key] = seen.get(key, 0) + 1

    original = warnings.showwarning
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for step in range(2):
                _step(model, optim, args, engine, 2000 + step)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = original
    print(f"### {engine}: {sum(seen.values())} synchronising calls in 2 steps", flush=True)
    for key, count in sorted(seen.items(), key=lambda item: -item[1]):
        print(f"  {count:4d}  {key}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--config", default="comm", choices=sorted(bench.CONFIGS))
    parser.add_argument("--engines", default="local,fsdp1,fsdp2,fullshard,fullshard-fsdp2")
    parser.add_argument("--mixed-precision", default="bf16", choices=["none", "bf16"])
    parser.add_argument("--strategy", default="FULL_SHARD")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, help="print this many cProfile rows")
    parser.add_argument("--sync-debug", action="store_true")
    parser.add_argument("--layers", type=int, default=0, help="override the config's layers")
    parser.add_argument("--d-model", type=int, default=0, help="override the config's width")
    parser.add_argument(
        "--foreach",
        type=lambda v: {"on": True, "off": False}[v],
        default=None,
        help="Adam's foreach: on, off (default: torch's choice)",
    )
    parser.add_argument("--whole-step", action="store_true", help="no sync between phases")
    parser.add_argument("--threads", type=int, default=0, help="torch's CPU threads")
    parser.add_argument("--sync-frames", type=int, default=4, help="stack frames per sync")
    args = parser.parse_args()
    args.forward_prefetch, args.backward_prefetch = False, "BACKWARD_PRE"
    args.torch_device = (
        torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    )
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda":
        torch.cuda.set_device(args.torch_device)
    backend = "nccl" if args.device == "cuda" else "gloo"
    if "WORLD_SIZE" in os.environ:  # under torchrun: every rank steps, rank 0 reports
        dist.init_process_group(backend)
        if dist.get_rank() != 0:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    else:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(bench._free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
    try:
        for engine in args.engines.split(","):
            _profile_engine(engine, args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
