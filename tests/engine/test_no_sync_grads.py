"""FSDP1's gradients inside ``no_sync()`` ([Note: gradients accumulated under no_sync] in
``_engine/accumulated_grads.py``): shown as torch's FSDP1 shows them, taken back when the
user edits or drops them, and reduced correctly once a backward synchronises.

Each test runs a module-level ``_check_*`` function on 2 gloo ranks; the reference is a
local copy of the model fed every rank's batches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks

STRATEGY_NAMES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]


def _model() -> nn.Module:
    """Odd sizes (7, 5, 3: shards of unequal length on 2 ranks), and an inner unit."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Sequential(nn.Linear(5, 3)))


def _batch(rank: int, step: int) -> Tensor:
    return torch.randn(4, 7, generator=torch.Generator().manual_seed(100 * step + rank))


def _local_grads(model: nn.Module, batches: list[Tensor]) -> dict[str, Tensor]:
    """The gradients of the summed loss over ``batches`` (each its own backward)."""
    local = copy.deepcopy(model)
    for batch in batches:
        local(batch).sum().backward()
    return {name: p.grad.clone() for name, p in local.named_parameters()}  # type: ignore[union-attr]


def _wrap(model: nn.Module, strategy: str, use_orig_params: bool) -> FSDP:
    return FSDP(
        copy.deepcopy(model),
        auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
    )


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "")


def _unit_flat_grads(fsdp: FSDP) -> dict[str, Tensor]:
    """Per unit (``_flat_param``, ``2._flat_param``), its flat parameter's ``.grad``."""
    grads = {}
    for name, param in fsdp.named_parameters():
        assert param.grad is not None, f"{name} has no .grad inside no_sync()"
        grads[_clean(name)] = param.grad
    return grads


def _expected_flat(local: dict[str, Tensor], unit_name: str) -> Tensor:
    """A unit's unsharded flat gradient: its own parameters' gradients, in order (the inner
    unit ``2.`` holds ``2.0.*``, the root the rest)."""
    inner = unit_name.startswith("2.")
    own = [g for n, g in local.items() if n.startswith("2.") == inner]
    return torch.cat([g.reshape(-1) for g in own])


def _shard(flat: Tensor, numel: int) -> Tensor:
    """This rank's shard (``numel`` elements) of an unsharded flat tensor, padded at the end."""
    world = dist.get_world_size() if numel < flat.numel() else 1
    padded = torch.nn.functional.pad(flat, (0, numel * world - flat.numel()))
    rank = dist.get_rank() if world > 1 else 0
    return padded[rank * numel : (rank + 1) * numel]


def _check_shown_inside_no_sync(strategy: str, use_orig_params: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    fsdp = _wrap(model, strategy, use_orig_params)
    with fsdp.no_sync():
        for step in range(2):
            fsdp(_batch(rank, step)).sum().backward()
    mine = _local_grads(model, [_batch(rank, 0), _batch(rank, 1)])  # this rank's, unreduced
    if use_orig_params:
        for name, param in fsdp.named_parameters():
            assert param.grad is not None, f"{name}: no .grad inside no_sync()"
            torch.testing.assert_close(param.grad, mine[_clean(name)])  # full shape
    else:
        for unit_name, grad in _unit_flat_grads(fsdp).items():
            expected = _expected_flat(mine, unit_name)
            assert grad.numel() >= expected.numel()  # unsharded, while the parameter is not
            torch.testing.assert_close(grad[: expected.numel()], expected)
    fsdp(_batch(rank, 2)).sum().backward()  # synchronises: the three batches, averaged
    every = [_batch(r, s) for r in range(world) for s in range(3)]
    reference = {n: g / world for n, g in _local_grads(model, every).items()}
    _check_reduced(fsdp, reference, use_orig_params)


def _check_reduced(fsdp: FSDP, reference: dict[str, Tensor], use_orig_params: bool) -> None:
    """After a synchronising backward: each rank's shard of the ``reference`` gradients."""
    if use_orig_params:
        with FSDP.summon_full_params(fsdp, with_grads=True):
            for name, param in fsdp.named_parameters():
                torch.testing.assert_close(param.grad, reference[_clean(name)])
        return
    for unit_name, grad in _unit_flat_grads(fsdp).items():
        shard = _shard(_expected_flat(reference, unit_name), grad.numel())
        torch.testing.assert_close(grad, shard)


@pytest.mark.parametrize("strategy", STRATEGY_NAMES)
def test_no_sync_shows_each_ranks_accumulated_gradient_then_reduces_it(strategy: str) -> None:
    """Inside no_sync(), after two backwards: with use_orig_params each parameter's .grad is
    this rank's unreduced sum in the parameter's full shape (while the parameter holds its
    shard), without it each flat parameter's .grad is the unsharded flat sum (torch's FSDP1,
    test_no_sync_correctness); a third, synchronising backward then gives the average over
    the ranks of all three batches."""
    for use_orig_params in (True, False):
        run_on_ranks(2, _check_shown_inside_no_sync, strategy, use_orig_params)


def _check_dropped_and_edited(use_orig_params: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model()
    fsdp = _wrap(model, "FULL_SHARD", use_orig_params)
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    fsdp(_batch(rank, 9)).sum().backward()  # a synchronised gradient, set aside in no_sync()
    with fsdp.no_sync():
        fsdp(_batch(rank, 0)).sum().backward()
        optim.zero_grad(set_to_none=True)  # drops batch 0's gradient and batch 9's
        fsdp(_batch(rank, 1)).sum().backward()
        for param in fsdp.parameters():
            assert param.grad is not None
            param.grad.mul_(2)  # edited in place: the same memory
    fsdp(_batch(rank, 2)).sum().backward()
    twice = _local_grads(model, [_batch(r, 1) for r in range(world)])
    once = _local_grads(model, [_batch(r, 2) for r in range(world)])
    reference = {n: (2 * twice[n] + once[n]) / world for n in twice}
    _check_reduced(fsdp, reference, use_orig_params)
    if use_orig_params:
        with fsdp.no_sync():
            fsdp(_batch(rank, 3)).sum().backward()
            weight = fsdp.get_parameter("_fsdp_wrapped_module.0.weight")
            weight.grad = torch.zeros_like(weight)  # the shard's size, not the gradient's
        with pytest.raises(RuntimeError, match=r"0\.weight.*unsharded gradient.*was assigned"):
            fsdp(_batch(rank, 4))


@pytest.mark.parametrize("use_orig_params", [True, False])
def test_no_sync_gradients_dropped_or_edited_by_the_user_are_taken_back(
    use_orig_params: bool,
) -> None:
    """zero_grad(set_to_none=True) inside no_sync() drops what was accumulated and the
    sharded gradient of an earlier synchronised backward; an in-place
    edit of the shown gradient is kept; the reduction sees both. A gradient of the wrong
    size assigned there is refused at the next forward, naming the parameter."""
    run_on_ranks(2, _check_dropped_and_edited, use_orig_params)
