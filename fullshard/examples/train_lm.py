"""Train a small byte-level GPT with fullshard's FullyShardedDataParallel.

Launch (one process per rank; gloo on CPU, NCCL with ``--device cuda``)::

    torchrun --standalone --nproc-per-node=2 -m fullshard.examples.train_lm

Every `Block` of the model becomes one FSDP unit; the embeddings, the final norm and the
tied output head stay in the root unit. Each rank draws its own batches (the sampler is
seeded with the rank), so the ranks together see ``world_size * batch_size`` sequences a
step. Rank 0 logs one line per step, then the first loss, the final loss (mean of the last
10 steps), a held-out loss and the wall time. The script exits with status 1 when the final
loss is not below the first one, so it can serve as an end-to-end check.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from importlib import resources

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fullshard import CPUOffload, MixedPrecision, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.examples.gpt import GPT, Block, GPTConfig, num_params
from fullshard.wrap import ModuleWrapPolicy

logger = logging.getLogger(__name__)

_FINAL_WINDOW = 10
"""The final loss is the mean over this many last steps, which smooths batch noise."""
_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")


@dataclass(frozen=True)
class TrainConfig:
    """Validated command-line options."""

    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    mixed_precision: str
    cpu_offload: bool
    seed: int
    sharding_strategy: ShardingStrategy
    use_orig_params: bool
    device: str
    data: str | None
    eval_batches: int
    d_model: int
    n_layers: int
    n_heads: int


_PRECISIONS: dict[str, MixedPrecision | None] = {
    "none": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16),
}
"""fp16 needs loss scaling (ShardedGradScaler), which this example does not do yet."""


def parse_args(argv: list[str] | None) -> TrainConfig:
    """Parse and validate the command line; errors exit through argparse."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank a step")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="max grad norm for FullyShardedDataParallel.clip_grad_norm_; 0 disables",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=tuple(_PRECISIONS),
        default="none",
        help="compute and communicate in this dtype; the fp32 shard stays the master copy",
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="keep sharded params and grads on the CPU"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sharding-strategy", choices=_STRATEGIES, default="FULL_SHARD")
    parser.add_argument("--use-orig-params", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--data", default=None, help="text file to train on (default: shipped)")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--n-layers", type=int, default=4)
    parser.add_argument("--n-heads", type=int, default=4)
    args = parser.parse_args(argv)
    positive = ("steps", "batch_size", "seq_len", "eval_batches", "d_model", "n_layers", "n_heads")
    for name in positive:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was given but CUDA is not available")
    return TrainConfig(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        mixed_precision=args.mixed_precision,
        cpu_offload=args.cpu_offload,
        seed=args.seed,
        sharding_strategy=ShardingStrategy[args.sharding_strategy],
        use_orig_params=args.use_orig_params,
        device=args.device,
        data=args.data,
        eval_batches=args.eval_batches,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
    )


def load_corpus(path: str | None) -> torch.Tensor:
    """The training text as a 1-D uint8 tensor of bytes (the shipped corpus by default)."""
    if path is None:
        raw = resources.files("fullshard").joinpath("data/corpus.txt").read_bytes()
    else:
        with open(path, "rb") as f:
            raw = f.read()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`: inputs (B, T) and next-byte targets (B, T), as int64."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)  # (T + 1,)
    windows = data[starts[:, None] + offsets].long()  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def lr_at(step: int, config: TrainConfig) -> float:
    """Linear warmup to `config.lr`, then cosine decay to a tenth of it at the last step."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    span = max(1, config.steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / span)
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def init_distributed(config: TrainConfig) -> torch.device:
    """Join the torchrun process group; returns this rank's compute device."""
    if config.device == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl")
        return torch.device("cuda", local_rank)
    dist.init_process_group("gloo")
    return torch.device("cpu")


def hybrid_mesh(device: torch.device) -> DeviceMesh:
    """A (replicate, shard) mesh that shards inside a node and replicates across nodes."""
    world_size = dist.get_world_size()
    shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if world_size % shard_size != 0:
        raise ValueError(
            f"HYBRID_SHARD needs world size ({world_size}) divisible by the ranks per node "
            f"({shard_size})"
        )
    return init_device_mesh(
        device.type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def build_model(config: TrainConfig, device: torch.device) -> FSDP:
    """The GPT wrapped with one FSDP unit per `Block`; every rank builds the same init."""
    torch.manual_seed(config.seed)
    gpt_config = GPTConfig(
        seq_len=config.seq_len,
        d_model=config.d_model,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
    )
    model = GPT(gpt_config)
    logger.info("model: %s parameters, %s", f"{num_params(model):,}", gpt_config)
    is_hybrid = config.sharding_strategy == ShardingStrategy.HYBRID_SHARD
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=config.sharding_strategy,
        use_orig_params=config.use_orig_params,
        mixed_precision=_PRECISIONS[config.mixed_precision],
        cpu_offload=CPUOffload(offload_params=config.cpu_offload),
        device_id=device,
        device_mesh=hybrid_mesh(device) if is_hybrid else None,
    )


def global_mean(value: torch.Tensor) -> float:
    """Mean of a scalar over all ranks (gloo has no AVG, so SUM and divide)."""
    total = value.detach().clone().float()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dist.get_world_size()


def train_step(
    model: FSDP,
    optimizer: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    config: TrainConfig,
) -> torch.Tensor:
    """One forward, backward, clip and optimizer step; returns the local loss."""
    inputs, targets = batch  # (B, T), (B, T)
    logits = model(inputs)  # (B, T, V)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip > 0:
        model.clip_grad_norm_(config.grad_clip)
    optimizer.step()
    return loss


@torch.no_grad()
def evaluate(model: FSDP, data: torch.Tensor, config: TrainConfig, device: torch.device) -> float:
    """Mean loss on held-out bytes, over `config.eval_batches` batches on every rank."""
    model.eval()
    generator = torch.Generator().manual_seed(config.seed + 1_000_003 + dist.get_rank())
    losses = []
    for _ in range(config.eval_batches):
        inputs, targets = (
            t.to(device) for t in sample_batch(data, config.batch_size, config.seq_len, generator)
        )
        logits = model(inputs)  # (B, T, V)
        losses.append(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
    model.train()
    return global_mean(torch.stack(losses).mean())


def train(config: TrainConfig, device: torch.device) -> int:
    """Run the training loop; returns the process exit status."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    corpus = load_corpus(config.data)
    split = int(corpus.numel() * 0.95)
    train_data, heldout_data = corpus[:split], corpus[split:]
    if heldout_data.numel() <= config.seq_len + 1:
        raise ValueError(
            f"the corpus ({corpus.numel()} bytes) is too small for --seq-len {config.seq_len}: "
            "its last 5% is held out and must hold one sequence; pass a larger --data file"
        )
    model = build_model(config, device)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=config.weight_decay
    )
    generator = torch.Generator().manual_seed(config.seed * 1_000 + rank)
    tokens_per_step = config.batch_size * config.seq_len * world_size
    logger.info(
        "%d ranks, %s, use_orig_params=%s, mixed precision %s, cpu offload %s, grad clip %s, "
        "%s train bytes, %d tokens/step",
        world_size,
        config.sharding_strategy.name,
        config.use_orig_params,
        config.mixed_precision,
        config.cpu_offload,
        config.grad_clip,
        f"{train_data.numel():,}",
        tokens_per_step,
    )
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(config.steps):
        step_start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, config)
        batch = sample_batch(train_data, config.batch_size, config.seq_len, generator)
        loss = train_step(model, optimizer, (batch[0].to(device), batch[1].to(device)), config)
        losses.append(global_mean(loss))
        tokens_per_s = tokens_per_step / (time.perf_counter() - step_start)
        logger.info(
            "step %4d/%d | loss %.4f | %8.0f tok/s",
            step + 1,
            config.steps,
            losses[-1],
            tokens_per_s,
        )
    wall_s = time.perf_counter() - start
    heldout_loss = evaluate(model, heldout_data, config, device)
    return report(losses, heldout_loss, wall_s)


def report(losses: list[float], heldout_loss: float, wall_s: float) -> int:
    """Log the summary; 0 when the final loss is below the first, else 1."""
    first = losses[0]
    final = sum(losses[-_FINAL_WINDOW:]) / len(losses[-_FINAL_WINDOW:])
    logger.info("first loss %.4f", first)
    logger.info("final loss %.4f (mean of last %d steps)", final, min(_FINAL_WINDOW, len(losses)))
    logger.info("held-out loss %.4f", heldout_loss)
    logger.info("wall time %.1f s", wall_s)
    if final < first:
        return 0
    logger.error("FAILED: final loss %.4f is not below first loss %.4f", final, first)
    return 1


def main(argv: list[str] | None = None) -> int:
    """Entry point for ``torchrun -m fullshard.examples.train_lm``."""
    config = parse_args(argv)
    torch.set_num_threads(1)
    device = init_distributed(config)
    logging.basicConfig(
        level=logging.INFO if dist.get_rank() == 0 else logging.WARNING,
        format="%(message)s",
        stream=sys.stdout,
    )
    try:
        status = train(config, device)
        # Let every rank finish its last collective before the group is torn down.
        dist.barrier()
        return status
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
