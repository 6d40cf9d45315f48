"""CUDA/NCCL: the same engine on GPUs. Skipped, with the reason, where GPUs are missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fullshard import CPUOffloadPolicy, fully_shard
from harness import requires_cuda_gpus, run_on_ranks

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


def _offloaded_dtensors_stay_on_the_cpu() -> None:
    torch.cuda.set_device(0)
    mesh = DeviceMesh.from_group(dist.new_group(backend="nccl"), "cuda")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).cuda()
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.to_local().device.type == "cpu", name
    # Loaded before the first forward (as a resumed run does): the values must reach the
    # shards the all-gathers read, not a copy of them.
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)).cuda()
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, reference.state_dict(), options=options)
    x = torch.randn(4, 8, device="cuda")
    torch.testing.assert_close(model(x), reference(x))


@requires_cuda_gpus(1)
def test_fully_shard_cpu_offload_keeps_the_shards_on_the_cpu() -> None:
    """``fully_shard(..., offload_policy=CPUOffloadPolicy())`` on a CUDA mesh: each DTensor
    parameter's local tensor is its CPU shard itself (``DTensor.from_local`` would copy it
    to the GPU, and a state dict loaded before the first forward would then be dropped)."""
    run_on_ranks(1, _offloaded_dtensors_stay_on_the_cpu, timeout=300)
