"""The communication schedule: collective counts and bytes, resharding, accumulation."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard._comm.collectives import COUNTERS
from fullshard._engine.storage_pool import POOL
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import STRATEGY_NAMES, LinearBlock

STRATEGIES = STRATEGY_NAMES
Block = LinearBlock


class Stack(nn.Module):
    """An input layer in the root unit, then blocks that each become a unit."""

    def __init__(self, dim: int = 7, num_blocks: int = 3, root_params: bool = True) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim) if root_params else nn.Identity()
        self.blocks = nn.Sequential(*(Block(dim) for _ in range(num_blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.inp(x))


def _wrapped_stack(strategy: str, root_params: bool = True, **kwargs: Any) -> FSDP:
    torch.manual_seed(0)
    return FSDP(
        Stack(root_params=root_params),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kwargs,
    )


def _padded_bytes(model: FSDP) -> dict[str, int]:
    """Per unit label, bytes of its padded flat parameter."""
    return {
        unit._handle.label: sum(s.layout.padded_numel for s in unit._handle.segments) * 4
        for unit in FSDP.fsdp_modules(model)
        if unit._handle is not None
    }


def _count_one_step(strategy: str, root_params: bool, no_sync: bool) -> dict[str, Any]:
    model = _wrapped_stack(strategy, root_params)
    x = torch.randn(4, 7)
    model(x).sum().backward()  # lazy init, so labels are the units' names
    COUNTERS.reset()
    context = model.no_sync() if no_sync else torch.enable_grad()
    with context:
        model(x).sum().backward()
    return {
        "calls": dict(COUNTERS.calls),
        "bytes": dict(COUNTERS.bytes_sent),
        "labels": list(COUNTERS.labels),
        "padded": _padded_bytes(model),
    }


@pytest.mark.parametrize("root_params", [True, False])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_collectives_per_unit_match_the_schedule(strategy: str, root_params: bool) -> None:
    """One step issues the collectives DESIGN.md's schedule says, with its byte volume."""
    result = run_on_ranks(2, _count_one_step, strategy, root_params, False)[0]
    padded = result["padded"]
    num_units = len(padded)
    total = sum(padded.values())
    root = padded.get("(root)", 0)
    calls, sent = result["calls"], result["bytes"]
    ring = (2 - 1) / 2
    if strategy == "NO_SHARD":
        assert calls == {"all_reduce": num_units}
        assert sent["all_reduce"] == pytest.approx(2 * total * ring)
        return
    # Every unit gathers before forward; only FULL_SHARD gathers again before backward, and
    # not the root, which keeps its parameters (see [Note: the root keeps its parameters]).
    backward_gathers = (num_units - (1 if root else 0)) if strategy == "FULL_SHARD" else 0
    assert calls["all_gather"] == num_units + backward_gathers
    assert calls["reduce_scatter"] == num_units
    gathered = total + (total - root if strategy == "FULL_SHARD" else 0)
    assert sent["all_gather"] == pytest.approx(gathered * ring)
    assert sent["reduce_scatter"] == pytest.approx(total * ring)
    if strategy == "FULL_SHARD" and not root_params:
        assert sum(sent.values()) == pytest.approx(3 * total * ring)  # DESIGN.md's 3P(N-1)/N
    if strategy == "SHARD_GRAD_OP":
        assert sum(sent.values()) == pytest.approx(2 * total * ring)  # 2P(N-1)/N


def _next_unit_state_in_forward(forward_prefetch: bool) -> list[str]:
    """The state of block k+1's handle while block k computes, in the second step."""
    model = _wrapped_stack("FULL_SHARD", forward_prefetch=forward_prefetch)
    units = [unit for unit in FSDP.fsdp_modules(model) if unit is not model]
    seen: list[str] = []
    for index, unit in enumerate(units[:-1]):
        following = units[index + 1]

        def record(module: nn.Module, args: Any, following: FSDP = following) -> None:
            assert following._handle is not None
            seen.append(following._handle.state.name)

        unit.module.register_forward_pre_hook(record)
    for _ in range(2):
        seen.clear()
        model(torch.randn(4, 7)).sum().backward()
    return seen


@pytest.mark.parametrize("forward_prefetch", [False, True])
def test_forward_prefetch_gathers_next_unit_during_compute(forward_prefetch: bool) -> None:
    """forward_prefetch=True: while a unit computes, the next unit's all-gather is issued
    (the order comes from the previous step); without it, the next unit is still sharded."""
    seen = run_on_ranks(2, _next_unit_state_in_forward, forward_prefetch)[0]
    expected = {"UNSHARDING", "UNSHARDED"} if forward_prefetch else {"SHARDED"}
    assert len(seen) == 2 and set(seen) <= expected, seen


def _backward_labels(prefetch: str | None) -> list[tuple[str, str]]:
    from fullshard import BackwardPrefetch

    policy = BackwardPrefetch[prefetch] if prefetch else None
    model = _wrapped_stack("FULL_SHARD", root_params=False, backward_prefetch=policy)
    x = torch.randn(4, 7)
    model(x).sum().backward()
    loss = model(x).sum()
    COUNTERS.reset()
    loss.backward()
    return list(COUNTERS.labels)


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST", None])
def test_backward_prefetch_issues_next_gather_before_or_after_reduction(
    prefetch: str | None,
) -> None:
    """BACKWARD_PRE issues the next unit's all-gather before this unit's gradient (and so
    before its reduce-scatter); BACKWARD_POST and None issue it after the reduce-scatter."""
    labels = run_on_ranks(2, _backward_labels, prefetch)[0]
    gathers = [label for kind, label in labels if kind == "all_gather"]
    assert gathers == ["blocks.2", "blocks.1", "blocks.0"], labels
    for later, earlier in (("blocks.1", "blocks.2"), ("blocks.0", "blocks.1")):
        gather = labels.index(("all_gather", later))
        reduction = labels.index(("reduce_scatter", earlier))
        assert (gather < reduction) == (prefetch == "BACKWARD_PRE"), labels


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_reduction_inside_no_sync(strategy: str) -> None:
    """Inside no_sync() backward reduces nothing; parameters are still gathered as usual."""
    calls = run_on_ranks(2, _count_one_step, strategy, True, True)[0]["calls"]
    assert "reduce_scatter" not in calls and "all_reduce" not in calls
    if strategy != "NO_SHARD":
        assert calls["all_gather"] >= 4


def _check_resharded(model: FSDP, where: str) -> None:
    for unit in FSDP.fsdp_modules(model):
        handle = unit._handle
        if handle is None:
            continue
        flat_param = handle.flat_param
        assert flat_param._full_param_padded.untyped_storage().size() == 0, (where, handle.label)
        assert flat_param.data_ptr() == flat_param._local_shard.data_ptr(), (where, handle.label)
        assert not handle.has_unsharded_grad(), (where, handle.label)


def _reshard_checks(strategy: str, use_orig_params: bool) -> int:
    model = _wrapped_stack(strategy, use_orig_params=use_orig_params)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    checked = 0

    def after_unit_forward(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal checked
        assert isinstance(module, FSDP) and module._handle is not None
        assert module._handle.unsharded_storage_size() == 0, module._handle.label
        checked += 1

    for unit in FSDP.fsdp_modules(model):
        if unit is not model:
            unit.register_forward_hook(after_unit_forward)
    for step in range(3):
        model(torch.randn(4, 7)).sum().backward()
        _check_resharded(model, f"after backward {step}")
        optim.step()
        optim.zero_grad()
    return checked


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_units_hold_no_unsharded_storage_after_forward_and_backward(use_orig_params: bool) -> None:
    """FULL_SHARD frees each non-root unit after its forward, and every unit after backward."""
    checked = run_on_ranks(2, _reshard_checks, "FULL_SHARD", use_orig_params)
    assert checked == [9, 9]  # 3 blocks x 3 steps


@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "NO_SHARD"])
def test_units_resharded_after_backward_other_strategies(strategy: str) -> None:
    """After backward every strategy leaves parameters sharded and no unsharded grads."""
    run_on_ranks(2, _after_backward_only, strategy)


def _kept_bytes_through_a_step(use_orig_params: bool) -> dict[str, Any]:
    model = _wrapped_stack("FULL_SHARD", use_orig_params=use_orig_params)
    x = torch.randn(4, 7)
    model(x).sum().backward()  # lazy initialisation
    kept_at_block_forward: list[int] = []
    for unit in FSDP.fsdp_modules(model):
        if unit is not model:  # runs once the unit is unsharded
            unit.module.register_forward_pre_hook(
                lambda *_: kept_at_block_forward.append(POOL.kept_bytes())
            )
    loss = model(x).sum()
    at_block_forward = list(kept_at_block_forward)
    after_forward = POOL.kept_bytes()
    loss.backward()
    after_backward = POOL.kept_bytes()
    with torch.no_grad():
        model(x)
    return {
        "at_block_forward": at_block_forward,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_no_grad_forward": POOL.kept_bytes(),
        "block_bytes": _padded_bytes(model)["blocks.0"],
    }


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_unshard_takes_the_memory_the_previous_reshard_freed(use_orig_params: bool) -> None:
    """Each block's forward unshard takes the memory the previous block's reshard kept (see
    [Note: reusing unsharded memory]); after forward the last block's is kept for backward,
    and nothing is kept after backward or after a forward that no backward follows."""
    for seen in run_on_ranks(2, _kept_bytes_through_a_step, use_orig_params):
        assert seen["at_block_forward"] == [0, 0, 0], seen
        assert seen["after_forward"] == seen["block_bytes"] > 0, seen
        assert seen["after_backward"] == seen["after_no_grad_forward"] == 0, seen


def _after_backward_only(strategy: str) -> None:
    model = _wrapped_stack(strategy)
    for step in range(2):
        model(torch.randn(4, 7)).sum().backward()
        _check_resharded(model, f"after backward {step}")


def _ddp_and_fsdp(strategy: str, use_orig_params: bool) -> tuple[DDP, FSDP]:
    """The same Stack under DDP and under FSDP (one unit per Block)."""
    torch.manual_seed(0)
    local = Stack()
    ref = DDP(copy.deepcopy(local))
    model = _wrapped_stack(strategy, use_orig_params=use_orig_params)
    return ref, model


def _accumulation(strategy: str, use_orig_params: bool, use_no_sync: bool) -> None:
    """Two micro-batches accumulated, then one SGD step, against DDP on the concatenation."""
    rank = dist.get_rank()
    ref, model = _ddp_and_fsdp(strategy, use_orig_params)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        gen = torch.Generator().manual_seed(rank * 100 + step)
        micro = [torch.randn(3, 7, generator=gen) for _ in range(2)]
        ref(torch.cat(micro)).sum().backward()
        for i, x in enumerate(micro):
            if use_no_sync and i == 0:
                with model.no_sync():
                    model(x).sum().backward()
            else:
                model(x).sum().backward()
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
    with FSDP.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")  # noqa: B023


@pytest.mark.parametrize("use_no_sync", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradient_accumulation_equals_concatenated_batch(
    strategy: str, use_orig_params: bool, use_no_sync: bool
) -> None:
    """Accumulating two micro-batches (with or without no_sync) equals one larger batch."""
    run_on_ranks(2, _accumulation, strategy, use_orig_params, use_no_sync)


def _summon_with_grads(strategy: str) -> None:
    rank = dist.get_rank()
    ref, model = _ddp_and_fsdp(strategy, use_orig_params=True)
    x = torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))
    ref(x).sum().backward()
    model(x).sum().backward()
    with FSDP.summon_full_params(model, with_grads=True):
        for (name, p), q in zip(model.named_parameters(), ref.module.parameters()):
            assert p.grad is not None and p.grad.shape == q.shape, name
            torch.testing.assert_close(p.grad, q.grad, msg=lambda m: f"{name}: {m}")  # noqa: B023
    for p in model.parameters():  # back to sharded gradient views; none without a piece
        if p.numel() == 0:
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.shape == p.shape


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_summon_full_params_with_grads_matches_ddp_grads(strategy: str) -> None:
    """summon_full_params(with_grads=True) shows the full averaged gradients."""
    run_on_ranks(2, _summon_with_grads, strategy)
