"""Behaviours of a training step that torch FSDP users rely on, checked against DDP or a
local copy of the model.

Each test runs a module-level ``_check_*`` function on gloo ranks (2 unless the name says
otherwise) through ``harness.run_on_ranks``; the assertions run on every rank. Models are
small, so the whole file stays fast on two CPU cores.
"""

from __future__ import annotations

import collections
import functools
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard
from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard.flat_param import FlatParamHandle
from fullshard.wrap import ModuleWrapPolicy, always_wrap_policy
from harness import REPO_ROOT, run_on_ranks
from models import (
    MLP,
    STRATEGIES,
    NestedWrappedModule,
    NonUniformReqGradNWM,
    ParityModel,
    TransformerWithSharedParams,
    input_generator,
    nested_wrap,
)
from parity import check_ddp_parity

SHARDED_STRATEGIES = STRATEGIES[:2]

each_strategy = pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
each_sharded_strategy = pytest.mark.parametrize(
    "strategy", SHARDED_STRATEGIES, ids=lambda s: s.name
)
each_use_orig_params = pytest.mark.parametrize(
    "use_orig_params", [False, True], ids=["flat_param", "orig_params"]
)

# ----------------------------------------------------------------------------------------
# Models (module level: the ranks build them by name)


class TanhBlock(nn.Module):
    """Linear then tanh, square: a unit that can be applied any number of times."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x))  # (B, dim)


class ReusedBlockModel(ParityModel):
    """One TanhBlock applied four times per forward: thrice in a chain, once on a side branch."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.in_proj = nn.Linear(8, 8)
        self.block = TanhBlock(8)
        self.out_proj = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        side = self.block(x)  # (B, 8)
        h = self.in_proj(x)
        for _ in range(3):
            h = self.block(h)
        return self.out_proj(h + side)  # (B, 4)

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        return (torch.rand(4, 8, generator=input_generator(rank, step)).to(device),)


class TwoOutputs(nn.Module):
    """Returns two tensors, each from its own Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.first(x), self.second(x)


class SideBranch(nn.Module):
    """A Linear whose output the model computes and then drops."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class UnusedOutputsModel(ParityModel):
    """Uses only the first of TwoOutputs' outputs, and none of SideBranch's."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(8, 8)
        self.heads = TwoOutputs()
        self.side = SideBranch()
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.trunk(x))  # (B, 8)
        used, _unused = self.heads(h)
        self.side(h)  # computed, never used
        return self.head(used)  # (B, 4)

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        return (torch.rand(4, 8, generator=input_generator(rank, step)).to(device),)


class TwoLinears(nn.Module):
    """torch's test_fsdp_module_no_compute_grad model: ``b`` may not reach the loss."""

    def __init__(self, call_b: bool, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.call_b = call_b
        self.a = nn.Linear(10, 10)
        self.b = nn.Linear(10, 10)

    def forward(self, x: Tensor, y: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        out_a = self.a(x)  # (B, 10)
        if self.call_b:
            return out_a, self.b(y)
        return out_a


Pair = collections.namedtuple("Pair", ["left", "right"])


class PairBlock(nn.Module):
    """Takes a Pair namedtuple and returns one."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(8, 8)
        self.right = nn.Linear(8, 8)

    def forward(self, pair: Pair) -> Pair:
        return Pair(torch.tanh(self.left(pair.left)), self.right(pair.right))


class DictBlock(nn.Module):
    """Takes a tuple of two tensors and returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, tensors: tuple[Tensor, Tensor]) -> dict[str, Tensor]:
        a, b = tensors
        return {"sum": self.proj(a + b), "prod": self.proj(a) * b}


class ListBlock(nn.Module):
    """Takes a dict (as a keyword argument) and returns a list."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 4)

    def forward(self, features: dict[str, Tensor]) -> list[Tensor]:
        return [self.proj(features["sum"]), self.proj(features["prod"])]


class StructuredIOModel(nn.Module):
    """Takes a dict and a Pair; returns a dict holding a list and a Pair."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.pair_block = PairBlock()
        self.dict_block = DictBlock()
        self.list_block = ListBlock()

    def forward(self, batch: dict[str, Tensor], pair: Pair) -> dict[str, Any]:
        mixed = self.pair_block(Pair(batch["x"] + pair.left, pair.right))
        features = self.dict_block((mixed.left, mixed.right))
        logits = self.list_block(features=features)
        return {"logits": logits, "pair": mixed}

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Any, ...]:
        gen = input_generator(rank, step)
        batch = {"x": torch.rand(4, 8, generator=gen).to(device)}
        pair = Pair(torch.rand(4, 8, generator=gen), torch.rand(4, 8, generator=gen))
        return (batch, Pair(pair.left.to(device), pair.right.to(device)))

    def get_loss(self, input: tuple[Any, ...], output: dict[str, Any]) -> Tensor:
        return sum(t.sum() for t in output["logits"]) + output["pair"].left.sum()


STRUCTURED_UNITS = {PairBlock, DictBlock, ListBlock}


class NormDropBlock(nn.Module):
    """Linear, BatchNorm, ReLU, Dropout: train and eval modes give different outputs."""

    def __init__(self, dim_in: int, dim_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim_in, dim_out)
        self.norm = nn.BatchNorm1d(dim_out)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(torch.relu(self.norm(self.linear(x))))


class NormDropModel(ParityModel):
    """Two NormDropBlocks and a head."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.block1 = NormDropBlock(8, 16)
        self.block2 = NormDropBlock(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block2(self.block1(x)))

    def get_input(
        self, device: torch.device | str, rank: int = 0, step: int = 0
    ) -> tuple[Tensor, ...]:
        return (torch.rand(6, 8, generator=input_generator(rank, step)).to(device),)


def three_linears(seed: int = 0) -> nn.Sequential:
    """Sizes 54 + 56 + 36 = 146 elements: over 3 ranks (shards of 49) every rank's shard
    misses some parameter entirely and cuts others in the middle."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 8), nn.Linear(8, 4))


class SummonInForward(nn.Module):
    """Calls summon_full_params on the FSDP module it is given, from inside its forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor, fsdp_root: nn.Module) -> Tensor:
        with FSDP.summon_full_params(fsdp_root):
            pass
        return self.linear(x)


# ----------------------------------------------------------------------------------------
# Helpers run on the ranks


def _fsdp(
    module: nn.Module, strategy: ShardingStrategy, use_orig_params: bool, **kwargs: Any
) -> FSDP:
    return FSDP(module, sharding_strategy=strategy, use_orig_params=use_orig_params, **kwargs)


def _nested_fsdp(
    model: NestedWrappedModule, strategy: ShardingStrategy, use_orig_params: bool
) -> FSDP:
    """common_fsdp's RECURSIVE NestedWrappedModule: three inner units and the root."""
    wrap = functools.partial(_fsdp, strategy=strategy, use_orig_params=use_orig_params)
    nested_wrap(model, wrap)
    return wrap(model)


def _handle_of(unit: object) -> FlatParamHandle:
    """The handle of an FSDP unit that owns parameters."""
    assert isinstance(unit, FSDP), f"{type(unit).__name__} is not an FSDP unit"
    assert unit._handle is not None, "the unit owns no parameters"
    return unit._handle


def _units_with_params(model: nn.Module) -> list[tuple[str, FlatParamHandle]]:
    """(name, handle) of every FSDP unit in ``model`` that owns parameters."""
    units = [(name, m) for name, m in model.named_modules() if isinstance(m, FSDP)]
    return [(name or "(root)", unit._handle) for name, unit in units if unit._handle is not None]


def _assert_resharded(model: nn.Module, when: str) -> None:
    """Every unit holds only its shard, and no unsharded gradient is left over."""
    rank = dist.get_rank()
    units = _units_with_params(model)
    assert units, "the model has no FSDP unit with parameters"
    for name, handle in units:
        flat_param = handle.flat_param
        if handle.uses_sharded_strategy:
            assert handle.unsharded_storage_size() == 0, (
                f"rank {rank}: unit {name} still holds {handle.unsharded_storage_size()} "
                f"unsharded bytes {when}"
            )
        assert flat_param.data_ptr() == flat_param._local_shard.data_ptr(), (
            f"rank {rank}: unit {name}'s flat_param does not point at its local shard {when}"
        )
        assert not handle.has_unsharded_grad(), (
            f"rank {rank}: unit {name} still holds an unsharded gradient {when}"
        )


def _averaged_grads(
    model: nn.Module, inputs: tuple[Any, ...], loss: Callable[..., Tensor]
) -> list[Tensor | None]:
    """DDP's gradients, by hand: backward on this rank's inputs, then average over ranks."""
    loss(inputs, model(*inputs)).backward()
    grads: list[Tensor | None] = []
    for param in model.parameters():
        if param.grad is None:
            grads.append(None)
            continue
        grad = param.grad.detach().clone()
        dist.all_reduce(grad)
        grads.append(grad / dist.get_world_size())
    return grads


def _shard_range(numel: int, sharded: bool) -> tuple[int, int]:
    """This rank's [start, end) of a flat buffer of ``numel`` elements, padded as torch does."""
    if not sharded:
        return 0, numel
    world_size = dist.get_world_size()
    shard_numel = -(-numel // world_size)
    start = dist.get_rank() * shard_numel
    return start, start + shard_numel


def _expected_flat_grad(
    params: list[nn.Parameter], grads: list[Tensor | None], sharded: bool
) -> Tensor:
    """This rank's piece of the flat (padded) gradient of ``params``, missing grads as zeros."""
    flat = torch.cat(
        [(g if g is not None else torch.zeros_like(p)).reshape(-1) for p, g in zip(params, grads)]
    )
    start, end = _shard_range(flat.numel(), sharded)
    flat = nn.functional.pad(flat, (0, max(0, end - flat.numel())))
    return flat[start:end]


def _sum_loss(inputs: tuple[Any, ...], output: Any) -> Tensor:
    return output.sum()


def _first_output_loss(inputs: tuple[Any, ...], output: Any) -> Tensor:
    return (output[0] if isinstance(output, tuple) else output).sum()


# ----------------------------------------------------------------------------------------
# 1. A unit called several times in one forward


def _check_reused_unit_parity(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    check_ddp_parity(
        ReusedBlockModel,
        lambda m: _fsdp(
            m, strategy, use_orig_params, auto_wrap_policy=ModuleWrapPolicy({TanhBlock})
        ),
        num_steps=3,
    )


@each_strategy
@each_use_orig_params
def test_reused_unit_matches_ddp_when_called_four_times(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """A unit applied four times in one forward trains like DDP over 3 Adam steps."""
    run_on_ranks(2, _check_reused_unit_parity, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# 2. Outputs not all used in the loss


def _wrap_unused_outputs(m: nn.Module, strategy: ShardingStrategy, use_orig_params: bool) -> FSDP:
    policy = ModuleWrapPolicy({TwoOutputs, SideBranch})
    return _fsdp(m, strategy, use_orig_params, auto_wrap_policy=policy)


def _check_unused_outputs(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    wrap = functools.partial(
        _wrap_unused_outputs, strategy=strategy, use_orig_params=use_orig_params
    )
    check_ddp_parity(
        UnusedOutputsModel, wrap, num_steps=3, ddp_kwargs={"find_unused_parameters": True}
    )
    fsdp = wrap(UnusedOutputsModel())
    (x,) = UnusedOutputsModel().get_input("cpu", rank=dist.get_rank())
    fsdp(x).sum().backward()
    _assert_resharded(fsdp, "after backward")
    assert _handle_of(fsdp.module.heads).flat_param.grad is not None
    assert _handle_of(fsdp.module.side).flat_param.grad is None


@each_strategy
@each_use_orig_params
def test_unused_outputs_match_ddp_and_reshard_when_not_in_loss(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """Unused unit outputs train like DDP and every unit is resharded after backward."""
    run_on_ranks(2, _check_unused_outputs, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# 3. Parameters that get no gradient


def _check_no_compute_grad(strategy: ShardingStrategy, use_orig_params: bool, call_b: bool) -> None:
    rank = dist.get_rank()
    local = TwoLinears(call_b)
    fsdp = _fsdp(
        TwoLinears(call_b),
        strategy,
        use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    gen = input_generator(rank, 0)
    inputs = (torch.rand(3, 10, generator=gen), torch.rand(3, 10, generator=gen))
    ref_grads = _averaged_grads(local, inputs, _first_output_loss)
    _first_output_loss(inputs, fsdp(*inputs)).backward()
    handle_a, handle_b = _handle_of(fsdp.module.a), _handle_of(fsdp.module.b)
    a_grad = handle_a.flat_param.grad
    assert a_grad is not None, f"rank {rank}: the used unit 'a' has no gradient"
    expected = _expected_flat_grad(
        list(local.a.parameters()), ref_grads[:2], handle_a.uses_sharded_strategy
    )
    torch.testing.assert_close(a_grad, expected)
    assert handle_b.flat_param.grad is None, (
        f"rank {rank}: unit 'b' is not in the loss but its flat_param has a gradient"
    )
    if use_orig_params:
        assert all(p.grad is None for p in handle_b.orig_params)
        assert handle_a.orig_params[0].grad is not None  # a.weight has a piece on each rank
    _assert_resharded(fsdp, "after backward")


@each_strategy
@each_use_orig_params
@pytest.mark.parametrize("call_b", [True, False], ids=["b_output_unused", "b_not_called"])
def test_unit_without_grad_keeps_grad_none_when_not_in_loss(
    strategy: ShardingStrategy, use_orig_params: bool, call_b: bool
) -> None:
    """A unit outside the loss ends backward with grad None; a used one gets DDP's grad."""
    run_on_ranks(2, _check_no_compute_grad, strategy, use_orig_params, call_b)


# ----------------------------------------------------------------------------------------
# 4. Structured inputs and outputs


def _assert_same_structure(actual: Any, expected: Any) -> None:
    assert type(actual) is type(expected), f"{type(actual)} is not {type(expected)}"
    if isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            _assert_same_structure(actual[key], expected[key])
    elif isinstance(expected, (tuple, list)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_same_structure(a, e)
    else:
        torch.testing.assert_close(actual, expected)
        assert actual.requires_grad == expected.requires_grad


def _wrap_structured(m: nn.Module, strategy: ShardingStrategy, use_orig_params: bool) -> FSDP:
    return _fsdp(m, strategy, use_orig_params, auto_wrap_policy=ModuleWrapPolicy(STRUCTURED_UNITS))


def _check_structured_io(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    local = StructuredIOModel()
    fsdp = _wrap_structured(StructuredIOModel(), strategy, use_orig_params)
    batch, pair = local.get_input("cpu", rank=dist.get_rank())
    _assert_same_structure(fsdp(batch, pair=pair), local(batch, pair=pair))
    # SGD with lr 1: the parameters after one step differ from DDP's by the gradient error.
    wrap = functools.partial(_wrap_structured, strategy=strategy, use_orig_params=use_orig_params)
    check_ddp_parity(StructuredIOModel, wrap, num_steps=1, optim_cls=torch.optim.SGD, lr=1.0)


@each_strategy
@each_use_orig_params
def test_structured_io_matches_local_and_ddp_when_dict_namedtuple_list(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """Dict/namedtuple/tuple inputs and dict/list/namedtuple outputs: local outputs, DDP grads."""
    run_on_ranks(2, _check_structured_io, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# 5. Forward under torch.no_grad()


def _check_no_grad_forward(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    ref = DDP(NestedWrappedModule())
    fsdp = _nested_fsdp(NestedWrappedModule(), strategy, use_orig_params)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    fsdp_optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    (x,) = NestedWrappedModule().get_input("cpu", rank=rank)
    # First forward (lazy init) under no_grad, then a training step, then no_grad again.
    for when in ("first forward", "after a training step"):
        with torch.no_grad():
            out = fsdp(x)
            ref_out = ref.module(x)
        torch.testing.assert_close(out, ref_out)
        assert not out.requires_grad
        _assert_resharded(fsdp, f"after a no_grad forward ({when})")
        for model, optim in ((ref, ref_optim), (fsdp, fsdp_optim)):
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()


@each_strategy
@each_use_orig_params
def test_no_grad_forward_matches_local_and_reshards_when_no_grad(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """A forward under no_grad gives the local output and leaves every unit (root too) sharded."""
    run_on_ranks(2, _check_no_grad_forward, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# 6. Eval mode


def _check_eval_mode(strategy: ShardingStrategy, use_orig_params: bool, grad_enabled: bool) -> None:
    local = NormDropModel()
    fsdp = _fsdp(
        NormDropModel(),
        strategy,
        use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({NormDropBlock}),
    )
    (x,) = local.get_input("cpu", rank=dist.get_rank())
    # A train-mode forward with the same dropout masks moves BatchNorm's running stats.
    with torch.no_grad():
        torch.manual_seed(1)
        train_out = fsdp(x)
        torch.manual_seed(1)
        torch.testing.assert_close(train_out, local(x))
    fsdp.eval()
    local.eval()
    assert not any(m.training for m in fsdp.modules())
    with torch.set_grad_enabled(grad_enabled):
        for _ in range(2):  # twice: a forward with no backward must not break the next one
            out = fsdp(x)
            torch.testing.assert_close(out, local(x))
            assert out.requires_grad == grad_enabled


@each_strategy
@each_use_orig_params
@pytest.mark.parametrize("grad_enabled", [True, False], ids=["grad", "no_grad"])
def test_eval_outputs_match_local_when_eval_mode(
    strategy: ShardingStrategy, use_orig_params: bool, grad_enabled: bool
) -> None:
    """In eval mode (BatchNorm, Dropout) outputs equal the local model's, grad on or off."""
    run_on_ranks(2, _check_eval_mode, strategy, use_orig_params, grad_enabled)


# ----------------------------------------------------------------------------------------
# 7. Frozen and trainable parameters in one unit


def _wrap_nonuniform(
    model: nn.Module, wrapping: str, strategy: ShardingStrategy, use_orig_params: bool
) -> FSDP:
    if wrapping == "policy":
        return _fsdp(
            model, strategy, use_orig_params, auto_wrap_policy=ModuleWrapPolicy({nn.Sequential})
        )
    assert isinstance(model, NestedWrappedModule)
    return _nested_fsdp(model, strategy, use_orig_params)


def _check_frozen_params(strategy: ShardingStrategy, wrapping: str, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    wrap = functools.partial(
        _wrap_nonuniform, wrapping=wrapping, strategy=strategy, use_orig_params=use_orig_params
    )
    check_ddp_parity(NonUniformReqGradNWM, wrap, num_steps=3)
    model = NonUniformReqGradNWM()
    params = dict(model.named_parameters())
    fsdp = wrap(model)
    (x,) = model.get_input("cpu", rank=rank)
    fsdp(x).sum().backward()
    for fqn, param in params.items():
        if not param.requires_grad:
            assert param.grad is None, f"rank {rank}: frozen parameter {fqn} got a gradient"
        elif not use_orig_params:
            continue  # the flat parameter holds the gradient (see tests/engine/test_frozen.py)
        elif param.numel() > 0:
            assert param.grad is not None and param.grad.shape == param.shape, (
                f"rank {rank}: trainable {fqn} has grad {param.grad!r}"
            )
        else:
            assert param.grad is None or param.grad.numel() == 0
    _assert_resharded(fsdp, "after backward")


@each_strategy
@each_use_orig_params
@pytest.mark.parametrize("wrapping", ["policy", "by_hand"])
def test_frozen_params_match_ddp_when_mixed_in_one_unit(
    strategy: ShardingStrategy, wrapping: str, use_orig_params: bool
) -> None:
    """A unit mixing frozen and trainable params trains like DDP, with either
    use_orig_params (torch refuses use_orig_params=False)."""
    run_on_ranks(2, _check_frozen_params, strategy, wrapping, use_orig_params)


# ----------------------------------------------------------------------------------------
# 9. Tied embeddings


def _check_tied_always_wrap(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    wrap = functools.partial(
        _fsdp,
        strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap_policy=always_wrap_policy,
    )
    check_ddp_parity(TransformerWithSharedParams, wrap, num_steps=3)
    fsdp = wrap(TransformerWithSharedParams())
    with FSDP.summon_full_params(fsdp):
        params = dict(fsdp.named_parameters(remove_duplicate=False))
        assert params["output_proj.weight"] is params["embed_tokens.weight"]


@each_strategy
@each_use_orig_params
def test_tied_embedding_matches_ddp_when_always_wrap(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """Tied embedding and output projection under always_wrap_policy train like DDP."""
    run_on_ranks(2, _check_tied_always_wrap, strategy, use_orig_params)


def _check_tied_split_rejected(use_orig_params: bool) -> None:
    model = TransformerWithSharedParams()
    embed = _fsdp(model.embed_tokens, ShardingStrategy.FULL_SHARD, use_orig_params)
    model.embed_tokens = embed  # type: ignore[assignment]
    with pytest.raises(ValueError, match=r"output_proj\.weight|embed_tokens\.weight"):
        _fsdp(model, ShardingStrategy.FULL_SHARD, use_orig_params)


@each_use_orig_params
def test_tied_embedding_raises_when_split_across_units(use_orig_params: bool) -> None:
    """Wrapping only embed_tokens, then the root, is a ValueError naming the tied parameter."""
    run_on_ranks(2, _check_tied_split_rejected, use_orig_params)


# ----------------------------------------------------------------------------------------
# 10. summon_full_params


def _full_params(fsdp: nn.Module) -> dict[str, Tensor]:
    with FSDP.summon_full_params(fsdp):
        return {fqn: p.detach().clone() for fqn, p in fsdp.named_parameters()}


def _edit_params(model: nn.Module) -> None:
    """Fill one root parameter and one nested unit's parameter with constants."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        params["module.0.weight"].fill_(1.0)
        params["module.2.bias"].fill_(-0.5)


def _check_summon_writeback(
    strategy: ShardingStrategy, use_orig_params: bool, writeback: bool
) -> None:
    local = NestedWrappedModule()
    fsdp = _nested_fsdp(NestedWrappedModule(), strategy, use_orig_params)
    (x,) = local.get_input("cpu", rank=dist.get_rank())
    with torch.no_grad():
        before = fsdp(x)  # initialises the root; a no_grad forward leaves every unit sharded
    with FSDP.summon_full_params(fsdp, writeback=writeback):
        names = [fqn for fqn, _ in fsdp.named_parameters()]
        assert names == [fqn for fqn, _ in local.named_parameters()]
        _edit_params(fsdp)
    if writeback:
        _edit_params(local)
    expected = {fqn: p.detach() for fqn, p in local.named_parameters()}
    torch.testing.assert_close(_full_params(fsdp), expected)
    out = fsdp(x)
    torch.testing.assert_close(out, local(x))
    if not writeback:
        torch.testing.assert_close(out.detach(), before)


@pytest.mark.parametrize(
    "strategy, writeback",
    [(s, True) for s in STRATEGIES] + [(s, False) for s in SHARDED_STRATEGIES],
    ids=lambda v: v.name if isinstance(v, ShardingStrategy) else f"writeback={v}",
)
@each_use_orig_params
def test_summon_edits_persist_when_writeback(
    strategy: ShardingStrategy, use_orig_params: bool, writeback: bool
) -> None:
    """Edits inside summon_full_params persist with writeback=True and vanish without."""
    run_on_ranks(2, _check_summon_writeback, strategy, use_orig_params, writeback)


def _check_summon_after_forward(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    local = NestedWrappedModule()
    fsdp = _nested_fsdp(NestedWrappedModule(), strategy, use_orig_params)
    (x,) = local.get_input("cpu", rank=dist.get_rank())
    torch.testing.assert_close(fsdp(x), local(x))  # grad enabled, never backpropagated
    expected = {fqn: p.detach() for fqn, p in local.named_parameters()}
    full = _full_params(fsdp)
    assert list(full) == list(expected), (
        "names under summon_full_params differ from the local model's"
    )
    torch.testing.assert_close(full, expected)
    loss = fsdp(x).sum()
    loss.backward()
    torch.testing.assert_close(loss, local(x).sum())
    _assert_resharded(fsdp, "after backward")


@each_strategy
@each_use_orig_params
def test_summon_shows_all_params_when_forward_had_no_backward(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """After a forward with no backward (units left unsharded), summon shows every parameter."""
    run_on_ranks(2, _check_summon_after_forward, strategy, use_orig_params)


def _check_summon_rank0_only(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    local = NestedWrappedModule()
    fsdp = _nested_fsdp(NestedWrappedModule(), strategy, use_orig_params)
    with torch.no_grad():
        fsdp(local.get_input("cpu", rank=rank)[0])  # every unit goes through unshard/reshard
    sharded_shapes = [p.shape for p in fsdp.parameters()]
    # Observe inside, assert after: a rank failing inside would strand its peer's all-gather.
    with FSDP.summon_full_params(fsdp, rank0_only=True, writeback=False):
        shapes = {fqn: p.shape for fqn, p in fsdp.named_parameters()}
        storage = {name: h.unsharded_storage_size() for name, h in _units_with_params(fsdp)}
    full_after = _full_params(fsdp)
    if rank == 0:
        assert shapes == {fqn: p.shape for fqn, p in local.named_parameters()}
    else:
        problems = []
        if list(shapes.values()) != sharded_shapes:
            problems.append(f"parameter shapes {list(shapes.values())}, not {sharded_shapes}")
        local_names = [fqn for fqn, _ in local.named_parameters()]
        if use_orig_params and list(shapes) != local_names:  # torch cleans names on every rank
            problems.append(f"names {list(shapes)}, not the local model's {local_names}")
        if set(storage.values()) != {0}:
            problems.append(f"unsharded bytes held per unit {storage}")
        assert not problems, "rank 1 should keep only its shards: " + "; ".join(problems)
    refused = FSDP.summon_full_params(fsdp, rank0_only=True, writeback=True)
    with pytest.raises(ValueError, match="rank0_only"), refused:
        pass
    torch.testing.assert_close(full_after, {fqn: p.detach() for fqn, p in local.named_parameters()})


@each_sharded_strategy
@each_use_orig_params
def test_summon_full_shapes_on_rank0_only_when_rank0_only(
    strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """rank0_only=True: rank 0 sees full shapes, rank 1 keeps its shards; writeback is refused."""
    run_on_ranks(2, _check_summon_rank0_only, strategy, use_orig_params)


def _check_summon_in_forward(strategy: ShardingStrategy) -> None:
    fsdp = _fsdp(SummonInForward(), strategy, False)
    with pytest.raises(RuntimeError):
        fsdp(torch.ones(2, 4), fsdp)


@each_strategy
def test_summon_raises_when_called_during_forward(strategy: ShardingStrategy) -> None:
    """summon_full_params from inside the model's forward is a RuntimeError."""
    run_on_ranks(2, _check_summon_in_forward, strategy)


# ----------------------------------------------------------------------------------------
# 12. No dependency on torch's FSDP


def test_import_loads_no_torch_fsdp_when_imported() -> None:
    """No module of the package loads torch's FSDP (the benchmark's torch engines live in
    benchmarks/torch_fsdp.py, outside it). torch's own DCP imports parts of torch's FSDP, so
    the checkpoint modules may load exactly what ``import torch.distributed.checkpoint`` does,
    nothing more."""
    code = (
        "import sys\n"
        "prefixes = ('torch.distributed.fsdp', 'torch.distributed._composable.fsdp')\n"
        "def loaded(): return {k for k in sys.modules if k.startswith(prefixes)}\n"
        "import fullshard, fullshard.wrap, fullshard.cli, fullshard.cli.bench, fullshard.cli.plan\n"
        "print(sorted(loaded()))\n"
        "import torch.distributed.checkpoint\n"
        "by_dcp = loaded()\n"
        "import fullshard.checkpoint, fullshard.cli.train\n"
        "print(sorted(loaded() - by_dcp))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["[]", "[]"], f"torch FSDP modules loaded: {result.stdout}"
    pattern = re.compile(r"^\s*(from|import)\s+torch\.distributed\.(fsdp|_composable\.fsdp)\b")
    offenders = [
        f"{path.name}:{number}"
        for path in sorted((REPO_ROOT / "fullshard").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.match(line)
    ]
    assert offenders == [], f"the package imports torch's FSDP at {offenders}"


# ----------------------------------------------------------------------------------------
# 13. Misuse


def _check_double_wrap() -> None:
    fsdp = FSDP(MLP(8))
    with pytest.raises(ValueError):
        FSDP(fsdp)


def test_wrap_raises_when_already_fsdp() -> None:
    """Wrapping an FSDP instance in FSDP again is a ValueError."""
    run_on_ranks(2, _check_double_wrap)


def _check_inner_no_sync() -> None:
    fsdp = _nested_fsdp(NestedWrappedModule(), ShardingStrategy.FULL_SHARD, False)
    (x,) = NestedWrappedModule().get_input("cpu", rank=dist.get_rank())
    fsdp(x).sum().backward()
    inner = fsdp.get_submodule("_fsdp_wrapped_module.module.2")
    assert isinstance(inner, FSDP)
    with pytest.raises(RuntimeError, match="no_sync"), inner.no_sync():
        pass
    with fsdp.no_sync():  # the root may
        fsdp(x).sum().backward()


def test_no_sync_raises_when_called_on_inner_unit() -> None:
    """no_sync() on a non-root unit is a RuntimeError; on the root it works."""
    run_on_ranks(2, _check_inner_no_sync)


# ----------------------------------------------------------------------------------------
# 8. use_orig_params on 3 ranks


def _overlap(start: int, end: int, shard_start: int, shard_end: int) -> tuple[int, int]:
    lo, hi = max(start, shard_start), min(end, shard_end)
    return (lo, hi) if lo < hi else (0, 0)


def _check_orig_params_outside_shard(strategy: ShardingStrategy) -> None:
    rank = dist.get_rank()
    local = three_linears()
    model = three_linears()
    originals = list(model.named_parameters())
    fsdp = _fsdp(model, strategy, True)
    x = torch.rand(2, 8, generator=input_generator(rank, 0))
    ref_grads = _averaged_grads(local, (x,), _sum_loss)
    fsdp(x).sum().backward()
    numel = sum(p.numel() for p in local.parameters())
    shard_start, shard_end = _shard_range(numel, sharded=True)
    offset = 0
    num_empty = 0
    for (fqn, param), full, ref_grad in zip(originals, local.parameters(), ref_grads):
        start, offset = offset, offset + full.numel()
        lo, hi = _overlap(start, offset, shard_start, shard_end)
        assert param.numel() == hi - lo, f"rank {rank}: {fqn} has {param.numel()} elements"
        if hi == lo:
            num_empty += 1
            assert param.grad is None or param.grad.numel() == 0, (
                f"rank {rank}: {fqn} lies in another rank's shard but has grad {param.grad!r}"
            )
            continue
        piece = slice(lo - start, hi - start)  # this rank's elements of the parameter
        torch.testing.assert_close(param.detach().reshape(-1), full.detach().reshape(-1)[piece])
        assert param.grad is not None and ref_grad is not None, f"rank {rank}: {fqn} has no grad"
        torch.testing.assert_close(param.grad.reshape(-1), ref_grad.reshape(-1)[piece])
    assert num_empty > 0, f"rank {rank}: the model should leave some parameter off this rank"


@each_sharded_strategy
def test_orig_param_is_empty_when_in_other_ranks_shard_three_ranks(
    strategy: ShardingStrategy,
) -> None:
    """A parameter entirely in another rank's shard is 0-numel here, with no gradient."""
    run_on_ranks(3, _check_orig_params_outside_shard, strategy)


def _wrap_keeping_identity(model: nn.Module, strategy: ShardingStrategy, kept: list[Any]) -> FSDP:
    """Wrap with use_orig_params, check the parameters are the original objects, keep both."""
    originals = list(model.parameters())
    fsdp = _fsdp(model, strategy, True, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    wrapped = list(fsdp.parameters())
    assert len(wrapped) == len(originals)
    assert all(w is o for w, o in zip(wrapped, originals)), "parameters are not the originals"
    kept.extend([fsdp, originals])
    return fsdp


def _check_orig_params_identity(strategy: ShardingStrategy) -> None:
    kept: list[Any] = []
    wrap = functools.partial(_wrap_keeping_identity, strategy=strategy, kept=kept)
    check_ddp_parity(lambda: MLP(8, dim_multiplier=2), wrap, num_steps=3)
    fsdp, originals = kept
    assert all(w is o for w, o in zip(fsdp.parameters(), originals))


@each_strategy
def test_orig_params_are_optimizer_params_when_use_orig_params_three_ranks(
    strategy: ShardingStrategy,
) -> None:
    """With use_orig_params the optimizer steps the original nn.Parameter objects, like DDP."""
    run_on_ranks(3, _check_orig_params_identity, strategy)


def _check_set_to_none_then_summon(strategy: ShardingStrategy, set_to_none: bool) -> None:
    torch.manual_seed(0)
    local = three_linears()
    model = FSDP(
        three_linears(), sharding_strategy=strategy, use_orig_params=True,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )  # fmt: skip
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    local_optim = torch.optim.SGD(local.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    for step in range(3):
        inp = torch.randn(4, 8)
        model(inp).sum().backward()
        local(inp).sum().backward()
        for param in local.parameters():
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= dist.get_world_size()
        optim.step()
        local_optim.step()
        optim.zero_grad(set_to_none=set_to_none)
        local_optim.zero_grad(set_to_none=set_to_none)
        # Leaving summon re-derives the original grads from the sharded gradient: it must
        # see what zero_grad() did to them, or the next step adds a stale gradient.
        with FSDP.summon_full_params(model):
            for (name, p), q in zip(model.named_parameters(), local.parameters(), strict=True):
                torch.testing.assert_close(p, q, msg=f"{name} after step {step}")
        for param in model.parameters():
            if set_to_none or param.numel() == 0:  # no piece of it on this rank: no grad
                assert param.grad is None
            else:
                assert param.grad is not None and not param.grad.any()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD])
def test_zero_grad_then_summon_keeps_grads_cleared(
    strategy: ShardingStrategy, set_to_none: bool
) -> None:
    """use_orig_params: optim.zero_grad() (set_to_none or not) followed by
    summon_full_params leaves no stale gradient for the next step (parity with a local model
    stepping averaged gradients, 3 SGD steps)."""
    run_on_ranks(2, _check_set_to_none_then_summon, strategy, set_to_none)


def test_public_names_load_on_first_use() -> None:
    """``import fullshard`` loads no torch (``fullshard plan`` relies on it); every name in
    ``__all__`` resolves, to the same object as its defining module's."""
    code = (
        "import sys, fullshard\n"
        "assert 'torch' not in sys.modules, 'import fullshard loaded torch'\n"
        "from fullshard import *\n"
        "import fullshard.api, fullshard.fully_sharded_data_parallel as f\n"
        "assert fullshard.ShardingStrategy is fullshard.api.ShardingStrategy\n"
        "assert fullshard.FullyShardedDataParallel is f.FullyShardedDataParallel\n"
        "print(sorted(n for n in fullshard.__all__ if getattr(fullshard, n, None) is None))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    with pytest.raises(AttributeError, match="has no attribute 'FullyShardedDataParalel'"):
        _ = fullshard.FullyShardedDataParalel  # type: ignore[attr-defined]
