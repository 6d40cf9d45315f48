"""Generation code on fullshard models: forwards inside ``summon_full_params`` and
``generate`` called on the wrapped model.

Before: a forward of the inner module inside ``summon_full_params(model)`` with nested units
resharded them under the summon (an internal assertion "expects state UNSHARDED, found
SHARDED" at exit), after which every summon raised "already active"; ``generate`` on the
wrapped model ran the inner model on sharded parameters.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import tiny_llama


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.scale


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _train_step(fsdp: nn.Module) -> float:
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    loss = fsdp(torch.randn(4, 8)).square().mean()
    loss.backward()
    optim.step()
    return loss.item()


def _check_forward_in_summon(use_orig_params: bool, recurse: bool) -> float:
    torch.manual_seed(0)
    model = Net()
    fsdp = FSDP(
        copy.deepcopy(model),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
    )
    _train_step(fsdp)  # lazy init and one step, as a training script would have done
    with FSDP.summon_full_params(fsdp, writeback=False):
        reference = copy.deepcopy(model)
        reference.load_state_dict({n: p.detach().clone() for n, p in fsdp.named_parameters()})
    x = torch.randn(3, 8)
    worst = 0.0
    for _ in range(2):  # twice: the first summon must leave the model as it found it
        with torch.no_grad(), FSDP.summon_full_params(fsdp, recurse=recurse, writeback=False):
            inner = fsdp.module(x)
            outer = fsdp(x)
        expected = reference(x)
        worst = max(worst, (inner - expected).abs().max().item())
        worst = max(worst, (outer - expected).abs().max().item())
    with FSDP.summon_full_params(fsdp, writeback=False):
        # Gradients of summoned parameters would be dropped at exit: no graph is built.
        assert not fsdp(x).requires_grad
    _train_step(fsdp)  # and training still works
    return worst


@pytest.mark.parametrize("recurse", [True, False], ids=["recurse", "root_only"])
@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_forward_inside_summon_uses_full_params(use_orig_params: bool, recurse: bool) -> None:
    """The inner module's (and the root's) forward inside summon_full_params computes with
    the full parameters and leaves the model usable: summon again, train again."""
    for worst in run_on_ranks(2, _check_forward_in_summon, use_orig_params, recurse):
        assert worst < 1e-6


def _check_error_in_summon(use_orig_params: bool) -> list[float]:
    torch.manual_seed(0)
    fsdp = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=use_orig_params)
    _train_step(fsdp)
    with pytest.raises(ValueError, match="user error"), FSDP.summon_full_params(fsdp):
        raise ValueError("user error")
    with FSDP.summon_full_params(fsdp):  # not "already active"
        shapes = [tuple(p.shape) for _, p in fsdp.named_parameters()]
    assert (8, 8) in shapes
    return [_train_step(fsdp) for _ in range(2)]


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_error_inside_summon_leaves_model_usable(use_orig_params: bool) -> None:
    """An exception raised inside summon_full_params restores every unit: summoning and
    training afterwards work."""
    losses = run_on_ranks(2, _check_error_in_summon, use_orig_params)
    assert all(len(rank_losses) == 2 for rank_losses in losses)


def _check_rank0_only_forward() -> str:
    torch.manual_seed(0)
    fsdp = FSDP(Net(), auto_wrap_policy=ModuleWrapPolicy({Block}))
    _train_step(fsdp)
    with FSDP.summon_full_params(fsdp, rank0_only=True, writeback=False):
        if dist.get_rank() == 0:
            fsdp(torch.randn(2, 8))
            return "ran"
        with pytest.raises(RuntimeError, match="does not hold the full parameters") as error:
            fsdp(torch.randn(2, 8))
        return str(error.value)


def test_forward_inside_rank0_only_summon_raises_on_other_ranks() -> None:
    """Inside summon_full_params(rank0_only=True), rank 0 computes; the others get an
    error naming the unit instead of computing on parameters they do not hold."""
    results = run_on_ranks(2, _check_rank0_only_forward)
    assert results[0] == "ran"
    assert "(root)" in results[1] and "rank 1" in results[1]


def _check_generate(use_orig_params: bool) -> list[list[int]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    model = tiny_llama().eval()
    fsdp = FSDP(
        copy.deepcopy(model),
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        use_orig_params=use_orig_params,
    )
    prompt = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(1))
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected = model.generate(prompt, **settings)
    direct = fsdp.generate(prompt, **settings)  # on the wrapped model
    with FSDP.summon_full_params(fsdp, writeback=False):
        summoned = fsdp.module.generate(prompt, **settings)  # on the inner model
        wrapped_in_summon = fsdp.generate(prompt, **settings)  # on the wrapped model
    assert torch.equal(direct, expected), (direct, expected)
    assert torch.equal(summoned, expected), (summoned, expected)
    assert torch.equal(wrapped_in_summon, expected), (wrapped_in_summon, expected)
    return direct.tolist()


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
def test_generate_matches_local_model(use_orig_params: bool) -> None:
    """transformers' generate, called on the wrapped model (also inside summon_full_params)
    or on the inner model inside summon_full_params, gives the unwrapped model's tokens."""
    pytest.importorskip("transformers")
    tokens = run_on_ranks(2, _check_generate, use_orig_params)
    assert tokens[0] == tokens[1]
