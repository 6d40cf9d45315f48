"""The reduce-scatter of either door reading the parameters' gradients where autograd left
them, over the shared-memory transport ([Note: gradients reduced where autograd left them]
in ``fullshard/_engine/left_grads.py``): the same bits as the copy it replaces, in the
cases where the flat gradient it skips is read by something else."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from harness import run_on_ranks


class Block(nn.Module):
    """Rows that do not split evenly, one weight with fewer rows than ranks, and a
    parameter no forward uses (it gets no gradient)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim + 1)
        self.down = nn.Linear(2 * dim + 1, dim)
        self.gate = nn.Linear(dim, 1)  # 1 row
        self.unused = nn.Parameter(torch.randn(3, dim))
        self.recompute = ""

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        return x + self._inner(x) * torch.sigmoid(self.gate(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "reentrant":  # the gate's gradient in backward, the rest's in a
            inner = checkpoint(self._inner, x, use_reentrant=True)  # nested backward
            return x + inner * torch.sigmoid(self.gate(x))
        if self.recompute:
            return checkpoint(self._body, x, use_reentrant=False)
        return self._body(x)


class Net(nn.Module):
    def __init__(self, dim: int, twice: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim), Block(dim)])
        self.head = nn.Linear(dim, 2)
        self.twice = twice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.twice:  # one unit's forward twice: two autograd nodes on its one leaf
            x = self.blocks[0](x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(door: str, places: bool, case: str, steps: int) -> dict[str, Any]:
    """``steps`` steps of ``case``; this rank's sharded gradients after each, and how many
    reductions read the gradients where autograd left them."""
    from fullshard._engine.grads import GradReduction
    from fullshard._engine.left_grads import LeftGrads

    read = [0]
    reduces_from_places, take = GradReduction._reduces_from_places, LeftGrads.take

    def able(self: Any, grad: torch.Tensor, left: Any) -> bool:
        return places and reduces_from_places(self, grad, left)

    def counted(self: Any, flat: torch.Tensor, reads_places: bool) -> Any:
        found = take(self, flat, reads_places)
        read[0] += found is not None
        return found

    flat_grad, held = LeftGrads.flat_grad, []

    def held_elsewhere(self: Any, grads: Any, leaf: torch.Tensor) -> torch.Tensor:
        flat = flat_grad(self, grads, leaf)
        held.append(flat)  # autograd copies a gradient referenced elsewhere
        return flat

    GradReduction._reduces_from_places = able  # type: ignore[method-assign]
    LeftGrads.take = counted  # type: ignore[method-assign]
    if case == "copied by autograd":
        LeftGrads.flat_grad = held_elsewhere  # type: ignore[method-assign]
    try:
        return {"grads": _steps(door, case, steps), "read": read[0]}
    finally:
        GradReduction._reduces_from_places = reduces_from_places  # type: ignore[method-assign]
        LeftGrads.take, LeftGrads.flat_grad = take, flat_grad  # type: ignore[method-assign]


def _wrap(door: str, case: str) -> nn.Module:
    torch.manual_seed(0)
    model = Net(7, twice=case in ("used twice", "used twice, reentrant"))
    for block in model.blocks:
        block.recompute = {"recomputed": "non-reentrant"}.get(case, "")
        block.recompute = "reentrant" if "reentrant" in case else block.recompute
    if door.startswith("fully_shard"):
        from fullshard import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        bf16 = MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16)  # reduced in bf16: uncast
        options: dict[str, Any] = {"mp_policy": bf16} if door.endswith("bf16") else {}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **options)
        return fully_shard(model, mesh=mesh, **options)
    from fullshard import FullyShardedDataParallel, ShardingStrategy
    from fullshard.wrap import ModuleWrapPolicy

    strategy = ShardingStrategy.SHARD_GRAD_OP if door == "FSDP1, SHARD_GRAD_OP" else None
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy or ShardingStrategy.FULL_SHARD,
        use_orig_params=door == "FSDP1, use_orig_params",
    )


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    if grad is None:
        return None
    return (grad.to_local() if isinstance(grad, DTensor) else grad).clone()


def _steps(door: str, case: str, steps: int) -> list[dict[str, torch.Tensor | None]]:
    model = _wrap(door, case)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for step in range(steps):
        generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
        micro_batches = 3 if case == "accumulated" else 1
        for micro in range(micro_batches):
            last = micro == micro_batches - 1
            if door.startswith("fully_shard"):
                model.set_requires_gradient_sync(last)  # type: ignore[operator]
                context: Any = contextlib.nullcontext()
            else:
                context = contextlib.nullcontext() if last else model.no_sync()  # type: ignore[operator]
            anomaly = torch.autograd.detect_anomaly() if case == "anomaly mode" else None
            inputs = torch.randn(5, 7, generator=generator).requires_grad_()  # reentrant's
            with context, anomaly or contextlib.nullcontext():
                loss = model(inputs).square().mean()
                if case == "retained":
                    loss.backward(retain_graph=True)
                    (2 * loss).backward()
                else:
                    loss.backward()
        seen.append({name: _local(p.grad) for name, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    return seen


def _compare(door: str, case: str) -> int:
    steps = 3
    flat = _train(door, False, case, steps)
    direct = _train(door, True, case, steps)
    assert flat["read"] == 0
    for step, (want, got) in enumerate(zip(flat["grads"], direct["grads"])):
        assert want.keys() == got.keys()
        for name, value in want.items():
            if value is None:
                assert got[name] is None, (case, step, name)
            else:
                assert torch.equal(got[name], value), (case, step, name, got[name] - value)
    return int(direct["read"])


READS = {
    "plain": 6,
    "used twice": 4,
    "retained": 15,
    "accumulated": 0,
    "recomputed": 6,
    "copied by autograd": 0,
    "reentrant": 12,
    "used twice, reentrant": 12,
    "anomaly mode": 0,
}
"""Per case, the reductions over 3 steps that read the gradients where autograd left them:
one per unit (3) and backward, from the first backward after a reduction found out that it
can (so, with 2 backwards a step, from the first step's second). A leaf that two forwards
fed (the first block's, "used twice"), or that holds a gradient already (accumulated
micro-batches), gets the flat copy; so does one whose unwritten flat gradient autograd
copied onto the leaf instead of keeping it (it does where another reference holds it), and
anomaly mode (it reads every node's output). With reentrant checkpointing each block
reduces twice a backward (the gate's gradient, then the nested backward's), 5 reductions a
step; "used twice, reentrant" interleaves the nested backwards with the two forwards'
nodes of the first block, which a flag per leaf (not per backward call) got wrong."""


DOORS = [
    "fully_shard",
    "fully_shard, bf16",
    "FSDP1",
    "FSDP1, use_orig_params",
    "FSDP1, SHARD_GRAD_OP",
]


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("case", list(READS))
@pytest.mark.parametrize("door", DOORS)
def test_gradients_reduced_where_autograd_left_them_match_the_flat_copy(
    door: str, case: str, world_size: int
) -> None:
    """Bit for bit this rank's gradients of the flat copy's path, every step."""
    reads = run_on_ranks(world_size, _compare, door, case, env={"FULLSHARD_SHM": "1"})
    assert reads == [READS[case]] * world_size, reads


@pytest.mark.parametrize("case", ["plain", "used twice, reentrant"])
@pytest.mark.parametrize("door", DOORS)
def test_on_three_ranks(door: str, case: str) -> None:
    """3 ranks: other chunk boundaries and padding."""
    reads = run_on_ranks(3, _compare, door, case, env={"FULLSHARD_SHM": "1"})
    assert reads == [READS[case]] * 3, reads
