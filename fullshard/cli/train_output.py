"""What a ``fullshard train`` run leaves in ``--out``: its checkpoint and its report.

Checkpoints go to ``<out>/checkpoint`` through `fullshard.checkpoint` (atomic; either
``--api``: the same keys, so a run may resume under the other); whether a run
may start over one is decided here, by the launcher before any rank starts and by every
rank again (a restart after a failure resumes). The report is ``report.json`` and, with
matplotlib, ``report.png`` (loss curve, memory per rank).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._checkpoint_folder import previous, read_metadata
from .train_options import TrainConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

logger = logging.getLogger(__name__)


def out_dir(config: TrainConfig) -> Path:
    assert config.out is not None, "main() sets the output folder"
    return Path(config.out)


def checkpoint_path(config: TrainConfig) -> Path:
    return out_dir(config) / "checkpoint"


def has_checkpoint(config: TrainConfig) -> bool:
    """Whether ``<out>`` holds a checkpoint (or, after a crash mid-swap, its previous one)."""
    path = checkpoint_path(config)
    return path.exists() or previous(path).exists()


def checkpoint_problem(config: TrainConfig, resuming: bool) -> str | None:
    """Why this run cannot start over the checkpoint in ``<out>`` as asked, or None.
    ``resuming``: --resume was given, or the launcher restarted the ranks."""
    if not has_checkpoint(config):
        return None
    path = checkpoint_path(config)
    if not (resuming or config.overwrite):
        return (
            f"{path} already holds a checkpoint; pass --resume to continue that run, "
            "--overwrite to start afresh (the checkpoint is replaced at the first save), or "
            "another --out"
        )
    if not resuming:
        return None
    try:
        metadata = read_metadata(path)
    except ValueError as error:
        return f"--resume: {error}"
    saved = metadata["extra"].get("run")
    if any(".attn.qkv." in key for key in metadata.get("model", {})):
        return (
            f"--resume: the checkpoint in {path} holds the example GPT's fused attention "
            "projection (attn.qkv), which is now three (attn.q, attn.k, attn.v) so that --tp "
            "can split them; this version cannot resume it: start afresh (--overwrite or "
            "another --out), or resume it with the fullshard that wrote it (a plain state dict "
            "of the fused layout still loads: GPT.load_state_dict splits attn.qkv)"
        )
    if saved != config.run_identity():
        return (
            f"--resume: the checkpoint in {path} is from another model or run ({saved}); this "
            f"run is {config.run_identity()}: use the same --preset, --seq-len and --seed, or "
            "another --out"
        )
    return None


def resume_state(
    config: TrainConfig, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """Load ``<out>/checkpoint`` into the model and optimizer when resuming; returns its
    extras (step, history), or None to start afresh."""
    # The launcher restarting the ranks after a failure (--max-restarts) means: resume.
    resuming = config.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    problem = checkpoint_problem(config, resuming)
    if problem is not None:
        raise SystemExit(f"fullshard train: {problem}")
    if not has_checkpoint(config):
        if config.resume:
            logger.info("--resume: no checkpoint in %s yet, starting from step 0", config.out)
        return None
    if not resuming:
        return None  # --overwrite
    from .. import checkpoint

    path = checkpoint_path(config)
    extras = checkpoint.load(path, model, optimizer)
    logger.info("resumed from %s at step %d", path, extras["step"])
    return extras


def write_report(config: TrainConfig, report: dict[str, Any]) -> tuple[Path, Path | None]:
    """``report.json`` and, with matplotlib, ``report.png`` (loss curve, memory per rank)."""
    out = out_dir(config)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "report.json"
    partial = json_path.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=1))
    os.replace(partial, json_path)
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed: no report.png (pip install 'fullshard[plot]')")
        return json_path, None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_mem) = plt.subplots(1, 2, figsize=(11, 4))
    steps = list(range(1, len(report["losses"]) + 1))
    ax_loss.plot(steps, report["losses"], color="tab:blue", linewidth=1)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (nats per byte)")
    ax_loss.set_title(f"{config.preset}: heldout {report['heldout_loss']:.3f}")
    if report["resumed_at"]:
        for at in report["resumed_at"]:
            ax_loss.axvline(at + 0.5, color="gray", linestyle=":", linewidth=1)
    memory = report["peak_memory_mib"]  # per step, per rank
    # A run resumed on another number of ranks (another --ranks or --tp) has rows of two
    # lengths: a rank that did not exist for a step has no point there.
    for rank in range(max((len(row) for row in memory), default=0)):
        values = [row[rank] if rank < len(row) else float("nan") for row in memory]
        ax_mem.plot(steps, values, label=f"rank {rank}")
    ax_mem.set_xlabel("step")
    ax_mem.set_ylabel("peak memory (MiB)")
    ax_mem.set_title(report["memory_kind"])
    ax_mem.legend(fontsize=8)
    fig.suptitle(
        f"fullshard train --api {config.api}: {report['world_size']} ranks"
        f"{f' (tp {config.tp})' if config.tp > 1 else ''}, "
        f"{config.sharding_strategy}, "
        f"{report['params'] / 1e6:.2f}M params"
    )
    fig.tight_layout()
    png_path = out / "report.png"
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return json_path, png_path
