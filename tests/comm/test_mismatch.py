"""FULLSHARD_DEBUG=1: ranks about to run different collectives are caught, on every rank,
with an error that lists what each rank was doing. Five planted mismatches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import CollectiveMismatchError, MixedPrecision, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks

DEBUG = {"FULLSHARD_DEBUG": "1"}


class Block(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, width)
        self.fc2 = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    def __init__(self, width: int = 16, skip_on_rank: int | None = None) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.skip_on_rank = skip_on_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.blocks):
            if index == 1 and dist.get_rank() == self.skip_on_rank:
                continue  # rank-dependent control flow: this rank skips blocks.1
            x = block(x)
        return x


def _train_expecting_mismatch(kind: str) -> str:
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = ModuleWrapPolicy({Block})
    if kind == "skipped_unit":
        model = FSDP(Net(skip_on_rank=1), auto_wrap_policy=policy)
    elif kind == "different_model":
        model = FSDP(Net(width=16 if rank == 0 else 24), auto_wrap_policy=policy)
    elif kind == "different_wrap_policy":
        model = FSDP(
            Net(), auto_wrap_policy=ModuleWrapPolicy({Block} if rank == 0 else {nn.Linear})
        )
    elif kind == "different_precision":
        precision = MixedPrecision(param_dtype=torch.bfloat16) if rank == 0 else None
        model = FSDP(Net(), auto_wrap_policy=policy, mixed_precision=precision)
    elif kind == "different_strategy":
        strategy = ShardingStrategy.FULL_SHARD if rank == 0 else ShardingStrategy.NO_SHARD
        model = FSDP(Net(), auto_wrap_policy=policy, sharding_strategy=strategy)
    else:
        raise AssertionError(kind)
    with pytest.raises(CollectiveMismatchError) as info:
        for _ in range(2):
            model(torch.randn(4, 16)).sum().backward()
    return str(info.value)


@pytest.mark.parametrize(
    ("kind", "rank0", "rank1"),
    [
        ("skipped_unit", "all-gather of module blocks.1 of 544 x", "all-gather of module blocks.2"),
        ("different_model", "all-gather of module blocks.0 of 544 x", "of 808 x torch.float32"),
        ("different_wrap_policy", "all-gather of module blocks.0 of 544", "module blocks.0.fc1"),
        ("different_precision", "blocks.0 of 544 x torch.bfloat16", "544 x torch.float32"),
        ("different_strategy", "all-gather of module blocks.0", "all-reduce of module blocks.2"),
    ],
)
def test_mismatch_is_caught_on_every_rank(kind: str, rank0: str, rank1: str) -> None:
    """Each rank raises CollectiveMismatchError listing both ranks' next collective."""
    messages = run_on_ranks(2, _train_expecting_mismatch, kind, env=DEBUG)
    for message in messages:
        assert "the ranks were about to run different collectives" in message
        line0, line1 = (line.strip() for line in message.splitlines()[1:3])
        assert line0.startswith("rank 0: ") and rank0 in line0, message
        assert line1.startswith("rank 1: ") and rank1 in line1, message
    assert messages[0] == messages[1]


def _train_matching() -> float:
    torch.manual_seed(0)
    model = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    loss = model(torch.randn(4, 16)).sum()
    loss.backward()
    return loss.item()


def test_debug_checks_pass_when_ranks_agree() -> None:
    """Matching ranks train normally with the checks on (TORCH_DISTRIBUTED_DEBUG=DETAIL too)."""
    for env in (DEBUG, {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}):
        assert len(run_on_ranks(2, _train_matching, env=env)) == 2
