"""The step's host-side shortcuts against what they stand for: the shard's piece views made
by one split against slicing, their addresses found without views against the views, and
the parameters' DTensor specs shared with their gradients as torch's FSDP2 shares them.
Units over 3 ranks with odd sizes and parameters with fewer rows than ranks (pieces that
are empty, padding between and after them), through both doors and every strategy. Also
the host's memory and copies: nothing a step allocates is left to Python's cycle
collector, a model its user dropped is freed, and the rings receive ``fully_shard``'s rows
straight into its parameters."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import distribute_tensor

import fullshard
from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard._engine.unit import handles_in
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks


class _Odd(nn.Module):
    """Rows 1, 2, 7 and 5 and odd widths: on 3 ranks some ranks hold none of a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.randn(1, 5))
        self.gate = nn.Parameter(torch.randn(2, 5))
        self.proj = nn.Linear(5, 7)
        self.out = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x + self.start) * torch.sigmoid(self.gate).mean(0)
        return self.out(torch.relu(self.proj(h)))


def _wrapped(door: str) -> nn.Module:
    torch.manual_seed(0)
    model = _Odd()
    if door == "fully_shard":
        fullshard.fully_shard(model.proj)
        fullshard.fully_shard(model)
        return model
    strategy, use_orig_params = door.split("/")
    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params == "orig",
    )


def _check_pieces(door: str) -> int:
    model = _wrapped(door)
    model(torch.randn(3, 5)).sum().backward()  # a step's state: resharded, with gradients
    checked = 0
    for handle in handles_in(model):
        for segment in handle._segments:
            flat = segment.flat_param
            split = segment.sharded_piece_views(flat)
            sliced = segment._piece_views._sliced(flat)
            places = segment.piece_places()
            for view, slice_, place in zip(split, sliced, places):
                assert view.shape == slice_.shape
                assert place is not None and place[1] == view.shape
                if view.numel():
                    assert view.data_ptr() == slice_.data_ptr() == place[0]
                    checked += 1
                assert view.grad_fn is None and not view.requires_grad
            # a gradient-shaped tensor of distinct values: the same values piece by piece
            values = torch.arange(flat.numel(), dtype=flat.dtype)
            for view, slice_ in zip(
                segment.sharded_piece_views(values), segment._piece_views._sliced(values)
            ):
                assert torch.equal(view, slice_)
    return checked


@pytest.mark.parametrize(
    "door", ["FULL_SHARD/orig", "FULL_SHARD/flat", "NO_SHARD/orig", "fully_shard"]
)
def test_split_piece_views_and_their_places_are_the_slices(door: str) -> None:
    """``sharded_piece_views`` (one split over pieces and padding) gives each parameter the
    view slicing gives, and ``piece_places`` its address and shape without a view: the
    check that lets a reshard skip parameters already on their pieces."""
    checked = run_on_ranks(3, _check_pieces, door)
    assert all(count > 0 for count in checked), checked


def _specs_shared() -> list[bool]:
    model = _wrapped("fully_shard")
    model(torch.randn(3, 5)).sum().backward()
    return [param.grad._spec is param._spec for param in model.parameters()]


def test_fully_shard_gradients_share_their_parameters_spec() -> None:
    """Each sharded gradient is a DTensor on its parameter's own spec object, as torch's
    FSDP2 makes them: DTensor's dispatch of the optimizer's ops then finds the two specs
    identical instead of comparing them field by field (a tenth of the optimizer step's
    host time on a model of many small parameters)."""
    for shared in run_on_ranks(3, _specs_shared):
        assert shared == [True] * 6, shared  # start, gate, proj and out weight and bias


def _writes_back_after_fast_reshards(door: str) -> None:
    model = _wrapped(door)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # reshards that find every parameter on its piece
        model(torch.randn(3, 5)).sum().backward()
        optim.step()
        optim.zero_grad()
    proj = model.proj if door == "fully_shard" else model.module.proj
    weight = proj.weight
    if door == "fully_shard":  # a new DTensor parameter, as load_state_dict(assign=True) sets
        full = torch.full((7, 5), 3.0)
        proj.weight = nn.Parameter(distribute_tensor(full, weight.device_mesh, weight.placements))
        proj.unshard()
        assert torch.equal(proj.weight.detach(), full)
        proj.reshard()
        return
    weight.data = torch.full_like(weight, 3.0)  # this rank's piece, new .data
    with FSDP.summon_full_params(model):
        assert torch.equal(proj.weight.detach(), torch.full((7, 5), 3.0))


@pytest.mark.parametrize("door", ["FULL_SHARD/orig", "fully_shard"])
def test_a_piece_replaced_after_fast_reshards_is_written_back(door: str) -> None:
    """A parameter given new ``.data`` (FSDP1 door) or replaced by a new DTensor parameter
    (``fully_shard``) after reshards that skipped every parameter is still found and written
    back into the shard at the next gather."""
    run_on_ranks(3, _writes_back_after_fast_reshards, door)


def _tensors_left_in_cycles(door: str, mixed: bool) -> list[str]:
    """Train a step, then one more with Python's cycle collector off; the tensors with
    memory that only the collector would have freed."""
    torch.manual_seed(0)
    model: nn.Module = _Odd()
    if door == "fully_shard":
        policy = fullshard.MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if mixed else None
        kwargs = {"mp_policy": policy} if policy else {}
        fullshard.fully_shard(model.proj, **kwargs)
        fullshard.fully_shard(model, **kwargs)
    else:
        precision = fullshard.MixedPrecision(torch.bfloat16, torch.bfloat16) if mixed else None
        policy = ModuleWrapPolicy({nn.Linear})
        model = FSDP(model, auto_wrap_policy=policy, mixed_precision=precision)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)

    def step() -> None:
        model(torch.randn(3, 5)).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)

    step()  # the first step's one-time objects (DTensor's caches, the optimizer's state)
    gc.collect()
    gc.disable()
    try:
        step()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [
            f"{t.dtype} {tuple(t.shape)}"
            for t in gc.garbage
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes() > 0
        ]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        gc.collect()
    return left


@pytest.mark.parametrize("transport", ["shared memory", "rings"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])
@pytest.mark.parametrize("door", ["FullyShardedDataParallel", "fully_shard"])
def test_a_step_leaves_no_tensor_to_the_cycle_collector(
    door: str, mixed: bool, transport: str
) -> None:
    """Nothing a step allocates waits for Python's cycle collector to be freed. An
    all-gather of the shared-memory transport was once in a cycle through its own output
    callback: under mixed precision each held its cast shard (a unit's shard in bf16) until
    the collector ran, 200 MiB a step on the benchmark's comm config."""
    env = {"FULLSHARD_SHM": "0"} if transport == "rings" else None
    results = run_on_ranks(2, _tensors_left_in_cycles, door, mixed, env=env)
    assert results == [[], []], results


def _dropped_model_is_freed(door: str) -> list[bool]:
    """Train a step, drop the model, its optimizer and the loss: whether the module whose
    parameters were sharded and its unit's handle are gone."""
    model = _wrapped(door)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(3, 5)).sum().backward()
    optim.step()
    inner = model.module if isinstance(model, FSDP) else model
    dropped = [weakref.ref(inner), weakref.ref(handles_in(model)[0])]
    del model, optim, inner
    gc.collect()
    return [ref() is None for ref in dropped]


@pytest.mark.parametrize("ranks", [1, 2])
@pytest.mark.parametrize(
    "door", ["fully_shard", "FULL_SHARD/flat", "FULL_SHARD/orig", "NO_SHARD/flat"]
)
def test_a_dropped_model_is_freed(door: str, ranks: int) -> None:
    """A model its user dropped is freed, with its parameters and its handle (and the
    shared-memory files of its groups). The unsharded leaf's post-backward hook held its
    unit strongly, and the leaf is held from C++ (the base of the views the modules compute
    with), where the cycle collector cannot see: every ``fully_shard`` model and every
    model the FSDP1 door wraps without sharding (NO_SHARD, and any strategy on 1 rank)
    stayed alive for the rest of the process."""
    assert run_on_ranks(ranks, _dropped_model_is_freed, door) == [[True, True]] * ranks


def _backward_after_the_model_was_dropped() -> str:
    model = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 3))
    fullshard.fully_shard(model)
    kept: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda module, args, output: kept.append(output))
    model(torch.randn(3, 5))
    del model
    gc.collect()
    with pytest.raises(RuntimeError) as error:
        kept[0].sum().backward()
    return str(error.value)


def test_a_backward_after_the_model_was_dropped_raises() -> None:
    """A backward that reaches a unit's parameters after the model was freed (an
    activation of it kept, the model dropped) raises on every rank, naming the unit: its
    gradients cannot be reduced, where the optimizer may still hold the parameters."""
    for message in run_on_ranks(2, _backward_after_the_model_was_dropped):
        assert "the FSDP unit of 0.weight, 0.bias, 2.weight" in message, message
        assert "Keep the model alive until backward() returns" in message, message


def _meshes_of_destroyed_groups() -> list[bool]:
    """Sharded state dicts of HYBRID_SHARD models over groups of their own (shard: this
    rank alone, replicate: both ranks), the first model's groups then destroyed: whether a
    state-dict mesh still holds them once the second model's is made, and whether they are
    freed."""
    from fullshard import StateDictType
    from fullshard._features import state_dict

    def hybrid_state_dict() -> list[weakref.ref[Any]]:
        shards = [dist.new_group([rank]) for rank in range(2)]  # every rank makes every group
        groups = (shards[dist.get_rank()], dist.new_group([0, 1]))
        model = FSDP(_Odd(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, process_group=groups)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.state_dict()
        return [weakref.ref(group) for group in groups]  # this rank's groups

    first = hybrid_state_dict()
    for ref in first:
        dist.destroy_process_group(ref())
    gc.collect()
    hybrid_state_dict()
    gc.collect()
    stale = [key for key in state_dict._MESHES if state_dict._destroyed(key[0])]
    return [not stale, all(ref() is None for ref in first)]


def test_state_dict_meshes_do_not_keep_destroyed_groups() -> None:
    """The sharded state dicts' meshes are cached per group pair; once the groups are
    destroyed (a sweep or a notebook setting up new ones), the next mesh made drops theirs:
    a mesh holds its groups, which kept their gloo threads and their shared-memory files
    for the rest of the process."""
    assert run_on_ranks(2, _meshes_of_destroyed_groups) == [[True, True]] * 2


def _rings_receive_into_parameters(reshard_after_forward: bool | int) -> list[Any]:
    """``_Odd`` under ``fully_shard``: its parameters as the unshard (or, with an int, the
    backward's gather within the smaller group) left them, and its gradients."""
    torch.manual_seed(0)
    model = _Odd()
    fullshard.fully_shard(model.proj, reshard_after_forward=reshard_after_forward)
    fullshard.fully_shard(model, reshard_after_forward=reshard_after_forward)
    full = {name: p.full_tensor() for name, p in model.named_parameters()}  # torch's gather
    units = [model, model.proj]
    for unit in units:
        unit.unshard()  # type: ignore[operator]
    unsharded = {name: p.detach().clone() for name, p in model.named_parameters()}
    received = [
        fullshard.fully_shard.state(unit).handle._segments[0].active.params_gathered
        for unit in units
    ]
    assert received == [True, True], received  # no gathered buffer to copy out of
    for unit in units:
        unit.reshard()  # type: ignore[operator]
    torch.manual_seed(1)
    model(torch.randn(3, 5)).sum().backward()
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters()}
    assert all(torch.equal(unsharded[name], full[name]) for name in full), "unshard"
    return [grads[name] for name in sorted(grads)]


@pytest.mark.parametrize("ranks", [3, 4])
def test_rings_receive_each_ranks_rows_into_the_parameters(ranks: int) -> None:
    """The rings (``FULLSHARD_SHM=0``) receive each rank's rows of each parameter where they
    go, one message per parameter, instead of into a gathered buffer copied out after. On 3
    ranks (parameters of 1, 2, 5 and 7 rows: some ranks hold none of one, padding after
    others) the unsharded parameters are torch's ``full_tensor()``; on 4 ranks the backward
    of ``reshard_after_forward=2`` gathers within pairs the same way, and the gradients are
    those of ``reshard_after_forward=True``."""
    env = {"FULLSHARD_SHM": "0"}
    whole = run_on_ranks(ranks, _rings_receive_into_parameters, True, env=env)
    if ranks == 4:
        pairs = run_on_ranks(ranks, _rings_receive_into_parameters, 2, env=env)
        for ours, reference in zip(pairs[0], whole[0]):
            torch.testing.assert_close(ours, reference, rtol=0, atol=0)
