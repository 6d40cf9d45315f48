"""CUDA/NCCL: the same engine on GPUs. Skipped, with the reason, where GPUs are missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness import requires_cuda_gpus

REPO = Path(__file__).resolve().parents[2]


@requires_cuda_gpus(2)
@pytest.mark.parametrize(
    "extra", [[], ["--mixed-precision", "bf16", "--cpu-offload"]], ids=["fp32", "bf16_offload"]
)
def test_main_job_trains_on_two_gpus_with_nccl(extra: list[str], tmp_path: Path) -> None:
    """``fullshard train`` trains under NCCL on 2 GPUs with FULL_SHARD and its loss falls,
    also with bf16 mixed precision and parameters offloaded to the CPU (pinned, async)."""
    cmd = [
        sys.executable, "-m", "fullshard", "train", "--device", "cuda", "--steps", "40",
        "--out", str(tmp_path), "--checkpoint-every", "20", *extra,
    ]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ)
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "final loss" in result.stdout
