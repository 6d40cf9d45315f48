"""Gradient bytes per rank for a frozen base with small adapters (LoRA): fullshard vs torch.

A GPT (``fullshard.examples.gpt``) whose block linears get rank-``r`` adapters
(``base(x) + up(down(x))``), everything else frozen, one FSDP unit per block (FULL_SHARD,
fp32, CPU ranks on gloo). Each engine runs in fresh processes, one per rank, and reports per
rank:

- unsharded grad: what autograd accumulates for the largest unit before its reduction
  (read under ``no_sync()``, where it stays): fullshard's trainable leaf, torch's flat
  parameter ``.grad``;
- sharded grad: the ``.grad`` storage a rank holds after a synchronised backward;
- reduce-scatter: the bytes it sends reducing one step's gradients (ring estimate, input
  bytes x (N - 1) / N, as ``fullshard._comm.collectives`` counts);
- Adam state: ``exp_avg`` and ``exp_avg_sq`` after one step;
- predicted: ``fullshard.memory.estimate``'s gradient bytes with ``trainable_numels``.

torch FSDP1 refuses such units with ``use_orig_params=False`` (pytorch#100945), so it runs
with ``use_orig_params=True``; its row for False records the refusal.

    python benchmarks/frozen_grad_bytes.py --world-size 2 --json frozen.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from fullshard.examples.gpt import GPT, Block, GPTConfig

ENGINES = ["fullshard-flat", "fullshard-orig", "torch-fsdp1-orig", "torch-fsdp1-flat"]
"""fullshard and torch FSDP1, with use_orig_params False ("flat") and True ("orig")."""
MIB = 2**20


class LoRALinear(nn.Module):
    """A frozen ``base`` linear plus a trainable rank-``r`` update ``up(down(x))``."""

    def __init__(self, base: nn.Linear, rank: int) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Linear(base.in_features, rank, bias=False)
        self.up = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.up.weight)  # LoRA's start: the update is zero

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.up(self.down(x))  # (B, T, out)


def lora_gpt(config: GPTConfig, rank: int) -> GPT:
    """The GPT with every block linear given an adapter and everything else frozen."""
    torch.manual_seed(0)
    model = GPT(config).requires_grad_(False)
    for block in model.blocks:
        for parent in (block.attn, block.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LoRALinear(child, rank))
    return model


def _unit_counts(model: nn.Module) -> dict[str, Any]:
    """``fullshard.memory.estimate``'s arguments: per block (one unit each) its elements and
    trainable elements, and the root unit's (the embeddings, the final norm)."""
    blocks = [block for block in model.modules() if isinstance(block, Block)]
    sizes = [sum(p.numel() for p in block.parameters()) for block in blocks]
    trainable = [sum(p.numel() for p in b.parameters() if p.requires_grad) for b in blocks]
    everything = sum(p.numel() for p in model.parameters())
    trains = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {
        "unit_numels": sizes,
        "trainable_numels": trainable,
        "root_numel": everything - sum(sizes),
        "root_trainable_numel": trains - sum(trainable),
    }


def _wrap(engine: str, model: nn.Module) -> tuple[nn.Module, list[Any]]:
    """The wrapped model and each unit's handle (fullshard's, or torch's FlatParamHandle)."""
    use_orig_params = engine.endswith("orig")
    if engine.startswith("fullshard"):
        from fullshard import FullyShardedDataParallel as FSDP
        from fullshard.wrap import ModuleWrapPolicy

        wrapped: nn.Module = FSDP(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params
        )
        units = FSDP.fsdp_modules(wrapped)
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

        wrapped = TorchFSDP(
            model,
            auto_wrap_policy=TorchPolicy({Block}),
            use_orig_params=use_orig_params,
            device_id=torch.device("cpu"),
        )
        units = TorchFSDP.fsdp_modules(wrapped)
    return wrapped, [unit._handle for unit in units if unit._handle is not None]


def _unsharded_grad_numel(engine: str, handle: Any) -> int:
    """The unit's unsharded gradient, as accumulated under ``no_sync()``."""
    if engine.startswith("fullshard"):
        grad = handle._unsharded_flat_param.grad
    else:
        grad = handle.flat_param.grad
    return 0 if grad is None else int(grad.numel())


def _grad_storage_bytes(model: nn.Module, handles: list[Any]) -> int:
    """Bytes of the distinct storages behind every ``.grad`` (flat parameters included)."""
    tensors = list(model.parameters())
    for handle in handles:
        tensors.extend(getattr(handle, "flat_params", [handle.flat_param]))
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor.grad is not None:
            storage = tensor.grad.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _ReduceScatterBytes:
    """Counts the bytes torch's FSDP sends in ``dist.reduce_scatter_single`` (ring estimate)."""

    def __init__(self) -> None:
        self.sent = 0.0
        self._original = dist.reduce_scatter_single

    def __enter__(self) -> _ReduceScatterBytes:
        def counting(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            num_ranks = dist.get_world_size(kwargs.get("group"))
            self.sent += input.numel() * input.element_size() * (num_ranks - 1) / num_ranks
            return self._original(output, input, *args, **kwargs)

        dist.reduce_scatter_single = counting
        return self

    def __exit__(self, *exc: object) -> None:
        dist.reduce_scatter_single = self._original


def _step(model: nn.Module, idx: torch.Tensor) -> None:
    logits = model(idx)  # (B, T, V)
    nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()


def _measure(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    config = GPTConfig(d_model=args.d_model, n_layers=args.layers, seq_len=args.seq_len)
    model = lora_gpt(config, args.lora_rank)
    counts = _unit_counts(model)
    try:
        wrapped, handles = _wrap(engine, model)
    except ValueError as error:
        return {"refused": str(error).splitlines()[0]}
    optim = torch.optim.Adam([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    generator = torch.Generator().manual_seed(dist.get_rank())
    idx = torch.randint(0, config.vocab_size, (args.batch, args.seq_len), generator=generator)
    _step(wrapped, idx)  # lazy initialisation
    optim.step()
    optim.zero_grad(set_to_none=True)
    with wrapped.no_sync():  # type: ignore[operator]
        _step(wrapped, idx)
    unsharded = max(_unsharded_grad_numel(engine, handle) for handle in handles) * 4
    from fullshard._comm.collectives import COUNTERS

    COUNTERS.reset()
    with _ReduceScatterBytes() as torch_sent:
        _step(wrapped, idx)
    sharded = _grad_storage_bytes(wrapped, handles)
    optim.step()
    adam = sum(s["exp_avg"].nbytes + s["exp_avg_sq"].nbytes for s in optim.state.values())
    from fullshard.memory import estimate

    predicted = estimate(world_size=dist.get_world_size(), **counts).grads
    return {
        "unsharded_grad": unsharded,
        "sharded_grad": sharded,
        "reduce_scatter": COUNTERS.bytes_sent.get("reduce_scatter", 0.0) + torch_sent.sent,
        "adam_state": adam,
        "predicted_grad": predicted,
        "params": sum(counts["unit_numels"]) + counts["root_numel"],
        "trainable": sum(counts["trainable_numels"]) + counts["root_trainable_numel"],
    }


def _worker(rank: int, args: argparse.Namespace, engine: str, port: int, out: str) -> None:
    torch.set_num_threads(1)
    # torch FSDP1 lists every frozen and trainable parameter of each mixed unit it wraps.
    warnings.filterwarnings("ignore", message=".*requires_grad", category=UserWarning)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.world_size
    )
    result = _measure(engine, args)
    gathered: list[Any] = [None] * args.world_size
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo's teardown (see fullshard.cli.bench._worker)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _table(results: dict[str, list[dict[str, Any]]]) -> str:
    first = next(r[0] for r in results.values() if "params" in r[0])
    lines = [
        f"{first['params'] / 1e6:.2f}M parameters, {first['trainable'] / 1e3:.1f}k trainable "
        f"({100 * first['trainable'] / first['params']:.1f}%); MiB per rank (rank 0 / rank 1 ...)",
        "",
        "| engine | unsharded grad (largest unit) | sharded grad | reduce-scatter sent "
        "| Adam state | model's grad estimate |",
        "|---|---|---|---|---|---|",
    ]
    for engine, per_rank in results.items():
        if "refused" in per_rank[0]:
            lines.append(f"| {engine} | refused: {per_rank[0]['refused']} | | | | |")
            continue
        cells = [
            " / ".join(f"{r[key] / MIB:.3f}" for r in per_rank)
            for key in ("unsharded_grad", "sharded_grad", "reduce_scatter", "adam_state")
        ]
        predicted = " / ".join(f"{r['predicted_grad'] / MIB:.3f}" for r in per_rank)
        lines.append(f"| {engine} | {' | '.join(cells)} | {predicted} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--engines", nargs="+", default=ENGINES, choices=ENGINES)
    parser.add_argument("--json", default=None, help="write the per-rank results here")
    args = parser.parse_args(argv)
    out = f"/tmp/fullshard-frozen-{os.getpid()}.json"
    results: dict[str, list[dict[str, Any]]] = {}
    for engine in args.engines:
        mp.spawn(_worker, args=(args, engine, _free_port(), out), nprocs=args.world_size)
        results[engine] = json.loads(Path(out).read_text())
        os.remove(out)
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
