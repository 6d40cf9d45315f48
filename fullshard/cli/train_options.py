"""``fullshard train``'s options: parsed, validated and frozen into a `TrainConfig`.

The launcher (`fullshard.cli.launch`) checks them before any rank starts; every rank
(`fullshard.cli.train`) parses the same arguments again. Errors exit through argparse,
naming the flag. This module imports no torch, so the launcher refuses bad options in a
fraction of a second.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import reshard_flag
from .plan import PRESETS, tp_problem

if TYPE_CHECKING:
    from ..examples.gpt import GPTConfig

_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD")
APIS = ("fsdp1", "fsdp2")
"""fsdp1: ``FullyShardedDataParallel``; fsdp2: ``fully_shard`` (`fullshard.cli.train_model`)."""
TRAIN_PRESETS = ("tiny", "small", "medium", "100m")
"""`fullshard.cli.plan.PRESETS` that are GPTs the ranks build."""
PRECISIONS = ("none", "bf16")
"""``--mixed-precision``'s choices (`fullshard.cli.train_model` maps them to each API's
policy). fp16 needs loss scaling (ShardedGradScaler), which the ranks do not do yet."""


@dataclass(frozen=True)
class TrainConfig:
    """Validated command-line options."""

    preset: str
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
    sharding_strategy: str
    use_orig_params: bool
    api: str
    """"fsdp1" or "fsdp2" (`APIS`)."""
    device: str
    data: str | None
    eval_batches: int
    out: str | None
    """None until `fullshard.cli.train.main` has every rank agree on rank 0's default."""
    checkpoint_every: int
    resume: bool
    overwrite: bool
    sample_bytes: int
    timeout_s: float = 300.0
    reshard_after_forward: bool | int | None = None
    """fsdp2's ``--reshard-after-forward``; None: from the strategy (`fsdp2_reshard`)."""
    tp: int = 1
    """fsdp2's ``--tp``: tensor-parallel ranks inside each data-parallel rank (1: none)."""
    compress_comm: tuple[str, ...] = ()
    """fsdp2's ``--compress-comm``: a subset of `COMPRESSIONS` (``fullshard.compress``)."""

    @property
    def fsdp2_reshard(self) -> bool | int:
        """fully_shard's ``reshard_after_forward``: the flag's, else SHARD_GRAD_OP's False and
        the other strategies' True."""
        if self.reshard_after_forward is not None:
            return self.reshard_after_forward
        return self.sharding_strategy != "SHARD_GRAD_OP"

    def gpt(self) -> GPTConfig:
        from ..examples.gpt import GPTConfig

        shape = PRESETS[self.preset]
        return GPTConfig(
            seq_len=self.seq_len,
            d_model=shape.d_model,
            n_heads=shape.n_heads,
            n_layers=shape.n_layers,
        )

    def run_identity(self) -> dict[str, Any]:
        """What a checkpoint must agree on to be resumed by this run."""
        return {"preset": self.preset, "seq_len": self.seq_len, "seed": self.seed}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The training options (``fullshard train`` adds the launcher's own)."""
    _add_model_arguments(parser)
    _add_training_arguments(parser)
    _add_fsdp_arguments(parser)
    _add_output_arguments(parser)


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and data")
    model.add_argument("--preset", choices=TRAIN_PRESETS, default="small", help="model size")
    model.add_argument(
        "--data",
        default=None,
        help="text file, or folder of files, to train on (default: the corpus shipped)",
    )
    model.add_argument("--seq-len", type=int, default=None, help="default: the preset's")


def _add_training_arguments(parser: argparse.ArgumentParser) -> None:
    run = parser.add_argument_group("training")
    run.add_argument("--steps", type=int, default=600)
    run.add_argument("--batch-size", type=int, default=16, help="sequences per rank a step")
    run.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    run.add_argument("--warmup-steps", type=int, default=20)
    run.add_argument("--weight-decay", type=float, default=0.01)
    run.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="max grad norm (fsdp1: FullyShardedDataParallel.clip_grad_norm_; fsdp2: "
        "torch.nn.utils.clip_grad_norm_ over the DTensor parameters); 0 disables",
    )
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank")


def _add_fsdp_arguments(parser: argparse.ArgumentParser) -> None:
    fsdp = parser.add_argument_group("FSDP")
    fsdp.add_argument(
        "--api",
        choices=APIS,
        default="fsdp1",
        help="fsdp1: wrap with FullyShardedDataParallel (default); fsdp2: fully_shard each "
        "block, then the root (FULL_SHARD: reshard_after_forward=True, SHARD_GRAD_OP: False, "
        "HYBRID_SHARD: a 2-D (replicate, shard) mesh)",
    )
    fsdp.add_argument(
        "--sharding-strategy", "--strategy", choices=_STRATEGIES, default="FULL_SHARD"
    )
    fsdp.add_argument("--use-orig-params", action="store_true", help="fsdp1 only")
    reshard_flag.add_argument(
        fsdp,
        help="fsdp2 only, with FULL_SHARD or HYBRID_SHARD (default true): false keeps each "
        "block unsharded from forward to backward; an int K (a factor of the shard group's "
        "ranks) keeps it sharded over K ranks, whose all-gathers then run within those ranks",
    )
    fsdp.add_argument(
        "--tp",
        type=int,
        default=1,
        help="fsdp2: tensor-parallel ranks inside each data-parallel rank (default 1, none); "
        "a 2-D (dp, tp) mesh of (ranks / T, T): each block's linears split over tp "
        "(parallelize_module), then fully_shard over dp; the T ranks of one dp row read "
        "the same batches",
    )
    fsdp.add_argument(
        "--compress-comm",
        type=_compressions,
        default=(),
        help="fsdp2: compressed communication, comma-separated from "
        f"{', '.join(COMPRESSIONS)} (fullshard.compress): int8-weights all-gathers weight "
        "matrices as int8 (float32 scales per column of each rank's rows; the fp32 shard "
        "stays the master copy; with --reshard-after-forward K, kept as int8 over K ranks "
        "for backward), bf16-grads reduces gradients in bf16",
    )
    fsdp.add_argument(
        "--mixed-precision",
        choices=PRECISIONS,
        default="none",
        help="compute and communicate in this dtype; the fp32 shard stays the master copy",
    )
    fsdp.add_argument(
        "--cpu-offload", action="store_true", help="keep sharded params and grads on the CPU"
    )
    fsdp.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    fsdp.add_argument(
        "--timeout",
        type=float,
        default=300.0,
        help="seconds any collective may wait before the job fails naming it (default 300)",
    )


def _add_output_arguments(parser: argparse.ArgumentParser) -> None:
    out = parser.add_argument_group("output and checkpoints")
    out.add_argument(
        "--out",
        default=None,
        help="folder for the report and checkpoints (default: runs/<date>-<time>)",
    )
    out.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between checkpoints; 0: none"
    )
    out.add_argument(
        "--resume", action="store_true", help="continue from <out>/checkpoint if there is one"
    )
    out.add_argument(
        "--overwrite", action="store_true", help="start afresh even if <out> has a checkpoint"
    )
    out.add_argument("--sample-bytes", type=int, default=200, help="text to generate at the end")


def config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> TrainConfig:
    seq_len = args.seq_len or PRESETS[args.preset].seq_len
    positive = ("steps", "batch_size", "eval_batches", "warmup_steps", "sample_bytes")
    for name in positive:
        if getattr(args, name) < (0 if name in ("warmup_steps", "sample_bytes") else 1):
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if seq_len <= 0:
        parser.error(f"--seq-len must be positive, got {seq_len}")
    if args.lr <= 0 or not math.isfinite(args.lr):
        parser.error(f"--lr must be a positive number, got {args.lr}")
    if args.checkpoint_every < 0:
        parser.error(
            f"--checkpoint-every must be 0 (no checkpoints) or more, got {args.checkpoint_every}"
        )
    if not args.timeout > 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    _check_api_options(args, parser)
    if args.resume and args.overwrite:
        parser.error("--resume and --overwrite contradict each other; pick one")
    if args.device == "cuda" and not _cuda_available():
        parser.error("--device cuda was given but CUDA is not available on this machine")
    if args.data is not None:
        data = Path(args.data)
        if not data.exists():
            parser.error(f"--data {args.data}: no such file or folder")
        if data.is_dir() and not any(p.is_file() for p in data.rglob("*")):
            parser.error(f"--data {args.data}: the folder holds no files")
    return TrainConfig(
        preset=args.preset,
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=seq_len,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        mixed_precision=args.mixed_precision,
        cpu_offload=args.cpu_offload,
        seed=args.seed,
        sharding_strategy=args.sharding_strategy,
        use_orig_params=args.use_orig_params,
        api=args.api,
        device=args.device,
        data=args.data,
        eval_batches=args.eval_batches,
        out=args.out,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        overwrite=args.overwrite,
        sample_bytes=args.sample_bytes,
        timeout_s=args.timeout,
        reshard_after_forward=args.reshard_after_forward,
        tp=args.tp,
        compress_comm=args.compress_comm,
    )


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _check_api_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse the options the chosen ``--api`` does not take."""
    _check_tp(args, parser)
    _check_compress(args, parser)
    if args.api == "fsdp2":
        _check_fsdp2(args, parser)
    elif args.reshard_after_forward is not None:
        parser.error(
            "--reshard-after-forward is fully_shard's option: add --api fsdp2, or with --api "
            "fsdp1 use --sharding-strategy FULL_SHARD (true) or SHARD_GRAD_OP (false)"
        )


COMPRESSIONS = ("int8-weights", "bf16-grads")


def _compressions(value: str) -> tuple[str, ...]:
    """``--compress-comm``'s value: known names, each once, in `COMPRESSIONS`' order."""
    names = {name.strip() for name in value.split(",") if name.strip()}
    unknown = sorted(names - set(COMPRESSIONS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown compression {unknown}: choose a comma-separated subset of "
            f"{', '.join(COMPRESSIONS)}"
        )
    return tuple(name for name in COMPRESSIONS if name in names)


def _check_compress(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--compress-comm`` is fully_shard's (its all-gather extension and reduce dtype)."""
    if not args.compress_comm:
        return
    if args.api != "fsdp2":
        parser.error(
            "--compress-comm needs --api fsdp2: it is built on fully_shard's all-gather "
            "extension and MixedPrecisionPolicy(reduce_dtype); add --api fsdp2"
        )
    if "int8-weights" in args.compress_comm and (args.tp > 1 or args.cpu_offload):
        parser.error(
            "--compress-comm int8-weights with --tp or --cpu-offload is not supported by "
            "fullshard train yet: drop int8-weights (bf16-grads works with both), or drop "
            "--tp / --cpu-offload"
        )


def _check_fsdp2(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse the FSDP1 options that mean nothing to ``fully_shard``."""
    if args.sharding_strategy == "NO_SHARD":
        parser.error(
            "--sharding-strategy NO_SHARD has no --api fsdp2 equivalent: fully_shard always "
            "shards the parameters. For replicated parameters and all-reduced gradients use "
            "--api fsdp1 --sharding-strategy NO_SHARD; with --api fsdp2 pick FULL_SHARD, "
            "SHARD_GRAD_OP or HYBRID_SHARD"
        )
    if args.use_orig_params:
        parser.error(
            "--use-orig-params has no --api fsdp2 meaning: fully_shard always keeps the "
            "original parameters (as DTensors sharded on dim 0). Drop --use-orig-params, or "
            "use --api fsdp1"
        )
    if args.sharding_strategy == "SHARD_GRAD_OP" and args.reshard_after_forward is not None:
        parser.error(
            "--sharding-strategy SHARD_GRAD_OP already means --reshard-after-forward false: "
            "drop one (--reshard-after-forward applies to FULL_SHARD and HYBRID_SHARD)"
        )


def _check_tp(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """``--tp`` with the model's heads and MLP (the same rule as ``fullshard plan --tp``) and
    the options it works with; the world size is checked by the launcher and the ranks."""
    problem = tp_problem(PRESETS[args.preset], None, args.tp, args.api)
    if problem:
        parser.error(problem)
    if args.tp == 1:
        return
    if args.sharding_strategy == "HYBRID_SHARD":
        parser.error(
            f"--tp {args.tp} with --sharding-strategy HYBRID_SHARD would need a 3-D "
            "(replicate, shard, tp) mesh, which fullshard train does not build: with --tp use "
            "FULL_SHARD or SHARD_GRAD_OP (fully_shard over all data-parallel ranks), or drop --tp"
        )
    k = args.reshard_after_forward
    if isinstance(k, int) and not isinstance(k, bool):
        parser.error(
            f"--reshard-after-forward {k} with --tp {args.tp}: fully_shard cannot keep "
            "tensor-parallel parameters sharded over fewer ranks between forward and backward "
            "(torch's fully_shard refuses it too): use --reshard-after-forward true or false "
            "with --tp, or drop --tp"
        )
