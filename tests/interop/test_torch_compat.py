"""Behaviours torch's own FSDP1 tests assert that fullshard differed on (issue 17).

Each test here is ours, written from what torch's test files check (see
docs/conformance.md for the files and the adapter that runs them against fullshard):
``apply`` on nested units, re-wrapping a trained model, the attributes torch's harness reads
from a wrapper. On 2 gloo ranks.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp._common_utils import TrainingState as TorchTrainingState

from fullshard import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.flat_param import FlatParameter
from fullshard.wrap import ModuleWrapPolicy, enable_wrap, wrap
from harness import run_on_ranks
from models import STRATEGIES, DummyProcessGroup


def _nested(**kwargs: Any) -> FSDP:
    """A root unit with a parameter of its own over two Linear units."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4), nn.LayerNorm(4))
    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)


def _fill_linears(module: nn.Module) -> None:
    if type(module) is nn.Linear:
        with torch.no_grad():
            module.weight.fill_(1.0)
            module.bias.fill_(2.0)


def _apply_on_nested_units(use_orig_params: bool) -> None:
    model = _nested(use_orig_params=use_orig_params)
    assert model.apply(_fill_linears) is model
    with FSDP.summon_full_params(model):
        linears = [m for m in model.modules() if type(m) is nn.Linear]
        assert len(linears) == 2
        for linear in linears:
            assert torch.equal(linear.weight, torch.ones_like(linear.weight))
            assert torch.equal(linear.bias, torch.full_like(linear.bias, 2.0))
    with (
        FSDP.summon_full_params(model),
        pytest.raises(ValueError, match="expected to be in states"),
    ):
        model.apply(_fill_linears)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_apply_reaches_every_nested_unit(use_orig_params: bool) -> None:
    """``apply`` edits the parameters of every nested unit in place (before: the nested
    units' own ``apply`` found the root's summon active and raised); inside a summon it
    raises torch's ValueError."""
    run_on_ranks(2, _apply_on_nested_units, use_orig_params)


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(FSDP(nn.Linear(5, 5)), nn.ReLU(), FSDP(nn.Linear(5, 3)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _rewrap_after_training() -> None:
    inner = _Inner()
    model = FSDP(inner)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.randn(2, 5, generator=torch.Generator().manual_seed(step))).sum().backward()
        optim.step()
        optim.zero_grad()
    x = torch.randn(2, 5)
    expected = model(x)
    rewrapped = FSDP(inner)  # e.g. for inference
    torch.testing.assert_close(rewrapped(x), expected)
    rewrapped(x).sum().backward()  # the nested units follow the new root through backward
    assert all(p.grad is not None for p in rewrapped.parameters())
    with pytest.raises(RuntimeError, match="superseded"):
        model(x)


def test_rewrapping_a_trained_module_whose_wrapper_holds_no_parameters() -> None:
    """Wrapping a trained model again (its nested units inside) works and gives the same
    output; the old wrapper refuses to run instead of driving units it no longer roots."""
    run_on_ranks(2, _rewrap_after_training)


def _attributes() -> None:
    mp = MixedPrecision(param_dtype=torch.float16)
    model = _nested(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=CPUOffload(offload_params=True),
        backward_prefetch=BackwardPrefetch.BACKWARD_POST,
        forward_prefetch=True,
        mixed_precision=mp,
    )
    for unit in FSDP.fsdp_modules(model):
        assert unit.sharding_strategy == ShardingStrategy.SHARD_GRAD_OP
        assert unit.cpu_offload == CPUOffload(offload_params=True)
        assert unit.backward_prefetch == BackwardPrefetch.BACKWARD_POST
        assert unit.forward_prefetch is True
        assert unit.mixed_precision == mp
        assert all(isinstance(p, FlatParameter) for p in unit.params)
        assert len(unit.params) == 1  # every unit here has a parameter of its own
        unit._assert_state(TorchTrainingState.IDLE)  # torch's enum, as its harness passes
        unit._assert_state([TorchTrainingState.IDLE, TorchTrainingState.FORWARD_BACKWARD])
        with pytest.raises(ValueError, match="expected to be in states"):
            unit._assert_state(TorchTrainingState.FORWARD_BACKWARD)
    inner = FSDP.fsdp_modules(model)[1]
    seen: list[str] = []
    inner.module.register_forward_pre_hook(lambda *_: seen.append(inner.training_state.name))
    model(torch.randn(2, 4))
    assert seen == ["FORWARD_BACKWARD"]


def test_torch_attributes_of_a_wrapper() -> None:
    """What torch's harness and users read from a wrapper: the constructor's settings,
    ``params`` (the unit's flat parameters) and ``_assert_state`` taking torch's enum."""
    run_on_ranks(2, _attributes)


class _TwoPaths(nn.Module):
    """layer0, then layer1 or layer2 (same number of elements): ranks taking different
    paths would pair the two units' all-gathers."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer0 = nn.Linear(5, 6)
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Sequential(nn.Linear(6, 3, bias=False), nn.Linear(3, 6, bias=False))
        self.alt = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.relu(self.layer0(x))
        return (self.layer2 if self.alt else self.layer1)(z)


def _two_paths() -> FSDP:
    """On a group of its own: the mismatch leaves its transport failed for good."""
    group = dist.new_group()
    model = _TwoPaths()
    model.layer1 = FSDP(model.layer1, process_group=group)  # type: ignore[assignment]
    model.layer2 = FSDP(model.layer2, process_group=group)  # type: ignore[assignment]
    return FSDP(model, process_group=group)


def _exec_order(first_iteration: bool) -> list[str]:
    """Under DETAIL, rank 1 takes the other path in the first or the second iteration."""
    import fullshard._comm.collectives as comm

    previous = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        model = _two_paths()
        x = torch.randn(4, 5)
        if not first_iteration:
            model(x).sum().backward()
        model.module.alt = dist.get_rank() == 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            expected = RuntimeError if first_iteration else comm.CollectiveMismatchError
            with pytest.raises(expected) as error:
                model(x)
        return [str(error.value)] + [str(w.message) for w in caught]
    finally:
        dist.set_debug_level(previous)


def test_forward_order_differing_across_ranks_in_the_first_iteration_raises() -> None:
    """torch's execution-order validation under TORCH_DISTRIBUTED_DEBUG=DETAIL: every rank
    raises torch's text, naming the unit each rank was about to unshard."""
    for message, *_ in run_on_ranks(2, _exec_order, True):
        assert message.startswith("Forward order differs across ranks"), message
        assert "rank 0: unit index 1 (layer1), rank 1: unit index 2 (layer2)" in message


def test_forward_order_differing_from_the_first_iteration_warns_then_raises() -> None:
    """Later iterations: the deviating rank gets torch's warning; where torch then pairs the
    two units' all-gathers (a wrong result), fullshard's mismatch detection raises."""
    results = run_on_ranks(2, _exec_order, False)
    warned = [w for w in results[1][1:] if w.startswith("Forward order differs from")]
    assert warned and "on rank 1" in warned[0], results[1]
    assert not [w for w in results[0][1:] if w.startswith("Forward order differs")]
    for rank, (message, *_) in enumerate(results):
        assert "ran a different collective" in message, message
        assert f"all-gather of module layer{rank + 1}" in message, message


def _duck_typed_group() -> tuple[int, int, bool]:
    group = DummyProcessGroup(rank=0, size=2)
    with enable_wrap(wrapper_cls=FSDP, process_group=dist.group.WORLD):
        layer = wrap(nn.Linear(5, 5), process_group=group)
    assert isinstance(layer, FSDP)
    assert layer.params[0].numel() == 15  # rank 0's half of 30 elements
    return layer.rank, layer.world_size, layer.process_group is group


def test_a_duck_typed_process_group_is_accepted() -> None:
    """Any object with ``rank()`` and ``size()`` is a process group for wrapping (torch's
    wrap tests pass such a stand-in); before, ``dist.get_rank(group)`` refused it."""
    assert run_on_ranks(2, _duck_typed_group) == [(0, 2, True)] * 2


def _hybrid_groups() -> tuple[int, int, bool]:
    model = _nested(sharding_strategy=ShardingStrategy.HYBRID_SHARD)
    units = FSDP.fsdp_modules(model)
    same = len({id(u._inter_node_pg) for u in units}) == 1
    same = same and len({id(u.process_group) for u in units}) == 1
    return dist.get_world_size(units[0].process_group), units[0]._inter_node_pg.size(), same


def test_hybrid_shard_without_groups_shards_within_the_node() -> None:
    """HYBRID_SHARD with no process group: every unit shards over the ranks of this host
    and replicates over a one-rank inter-node group, the same groups for all units (what
    torch's hybrid tests read from ``process_group`` and ``_inter_node_pg``)."""
    assert run_on_ranks(2, _hybrid_groups) == [(2, 1, True)] * 2


def _nested_unit_ignores_per_rank(use_modules: bool) -> None:
    """A nested unit ignores a rank-dependent number of modules; the root, told nothing,
    must not manage them (its flat parameter would differ across ranks)."""
    torch.manual_seed(0)
    extra = [nn.Linear(4, 4, bias=False) for _ in range(dist.get_rank() + 1)]
    model = nn.Sequential(nn.Sequential(nn.Linear(5, 4), *extra), nn.Linear(4, 4))
    ignored: dict[str, Any] = (
        {"ignored_modules": extra}
        if use_modules
        else {"ignored_states": [p for m in extra for p in m.parameters()]}
    )
    model[0] = FSDP(model[0], **ignored)
    fsdp = FSDP(model)
    assert fsdp.params[0].numel() == 10  # half of the root's own Linear(4, 4): nothing else
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-3)
    for _ in range(2):
        fsdp(torch.randn(3, 5)).sum().backward()
        optim.step()


@pytest.mark.parametrize("use_modules", [True, False], ids=["ignored_modules", "ignored_states"])
def test_ancestors_ignore_what_nested_units_ignore(use_modules: bool) -> None:
    """Modules (or parameters) a nested unit ignores are ignored by its ancestors too, as in
    torch: ranks ignoring different numbers of modules train (before: the root managed them,
    and the ranks' all-gathers differed)."""
    run_on_ranks(2, _nested_unit_ignores_per_rank, use_modules)


def _params_between_forward_and_backward(strategy: str) -> None:
    model = _nested(sharding_strategy=ShardingStrategy[strategy], use_orig_params=True)
    names = [name for name, _ in model.named_parameters()]
    x = torch.randn(2, 4)
    model(x).sum().backward()
    output = model(x)
    assert [name for name, _ in model.named_parameters()] == names  # the root's too
    output.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.numel() > 0)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_parameters_between_forward_and_backward_use_orig_params(strategy: str) -> None:
    """use_orig_params: units kept unsharded from forward to backward (the root, every unit
    under SHARD_GRAD_OP) list their original parameters in between, as torch's do (before:
    the modules held plain views then, and ``model.parameters()`` skipped them)."""
    run_on_ranks(2, _params_between_forward_and_backward, strategy)


class _Prefetching(nn.Module):
    """Starts its second block's all-gather before running the first block."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block1 = nn.Linear(6, 6)
        self.block2 = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = self.block2._unshard(async_op=True) if isinstance(self.block2, FSDP) else None
        y = torch.relu(self.block1(x))
        if work is not None:
            work.wait()
        return self.block2(y)


def _explicit_prefetch(use_orig_params: bool) -> None:
    from fullshard._comm.collectives import COUNTERS

    local = _Prefetching()
    model = _Prefetching()
    kwargs: dict[str, Any] = {
        "use_orig_params": use_orig_params,
        "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
    }
    model.block1 = FSDP(model.block1, **kwargs)  # type: ignore[assignment]
    model.block2 = FSDP(model.block2, **kwargs)  # type: ignore[assignment]
    fsdp = FSDP(model, **kwargs)
    optims = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (local, fsdp)]
    for step in range(3):
        x = torch.randn(2, 6, generator=torch.Generator().manual_seed(step))
        COUNTERS.reset()
        losses = [m(x).sum() for m in (local, fsdp)]
        assert COUNTERS.calls["all_gather"] == 2  # block2's gather was issued once, early
        for loss, optim in zip(losses, optims):
            loss.backward()
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(losses[1], losses[0])
    fsdp._wait_unshard_streams_on_current_stream()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_explicit_unshard_prefetches_a_unit(use_orig_params: bool) -> None:
    """torch's ``_unshard(async_op=True)``: a unit's all-gather issued early from its
    parent's forward is the one its own forward uses (one per unit per step), and training
    matches a local model."""
    run_on_ranks(2, _explicit_prefetch, use_orig_params)


def _summon_under_a_plain_root(use_orig_params: bool) -> None:
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(10, 10, bias=False), nn.Linear(10, 4), nn.Linear(4, 4))
    shapes = [tuple(p.shape) for p in plain.parameters()]
    model = nn.Sequential(plain[0], FSDP(plain[1], use_orig_params=use_orig_params), FSDP(plain[2]))
    with FSDP.summon_full_params(model):
        params = list(model.parameters())
        assert [tuple(p.shape) for p in params] == shapes
        assert not any(isinstance(p, FlatParameter) for p in params)
    flat = [p for p in model.parameters() if isinstance(p, FlatParameter)]
    assert len(flat) == (1 if use_orig_params else 2)  # registered again
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 10)).sum().backward()
    optim.step()


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_summon_under_a_plain_root_lists_each_parameter_once(use_orig_params: bool) -> None:
    """Inside ``summon_full_params`` of a model whose root is not a unit, ``parameters()``
    lists every parameter once at full size: flat parameters are unregistered meanwhile, as
    in torch (before: each unit's flat shard was listed too)."""
    run_on_ranks(2, _summon_under_a_plain_root, use_orig_params)


# -- use_orig_params: original parameters changed by the user after wrapping -----------------


def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 7))


def _wrapped_linears(strategy: ShardingStrategy) -> FSDP:
    """``_two_linears`` with each Linear a unit, ``use_orig_params=True``."""
    return FSDP(
        _two_linears(),
        sharding_strategy=strategy,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        use_orig_params=True,
    )


def _assert_like_local(
    fsdp: FSDP, local: nn.Module, grads: bool = False, grad_factor: float = 1.0, exact: bool = False
) -> None:
    """Inside a summon, each full parameter of ``fsdp`` (with ``grads``, its gradient) equals
    the local model's (its gradient times ``grad_factor``); bitwise with ``exact``."""
    tolerance = {"rtol": 0.0, "atol": 0.0} if exact else {}
    with FSDP.summon_full_params(fsdp, with_grads=grads):
        for (name, ours), (_, theirs) in zip(
            fsdp.module.named_parameters(), local.named_parameters()
        ):
            if grads:
                ours, theirs = ours.grad, theirs.grad * grad_factor
            torch.testing.assert_close(ours, theirs, msg=name, **tolerance)


def _changed_orig_params(strategy: ShardingStrategy, change: str) -> None:
    local = _two_linears()
    fsdp = _wrapped_linears(strategy)
    # The user changes a parameter as torch's FSDP lets them: its .data, or the Parameter
    # itself, replaced by one of the same (this rank's flattened piece) shape.
    for linear in (local[2], fsdp.module[2].module):
        param = linear.weight
        if change == "data":
            param.data = torch.full_like(param, 2.0)
        else:
            linear.weight = nn.Parameter(torch.full_like(param, 2.0))
    _assert_like_local(fsdp, local, exact=True)  # written back before the summon's gather
    # The new Parameter is the one FSDP trains from now on: an optimizer over it steps it.
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (local, fsdp)]
    for step in range(2):
        torch.manual_seed(step)  # the same batch on every rank: the local model's too
        batch = torch.randn(4, 5)
        for model, optim in zip((local, fsdp), optims):
            model(batch).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()
    _assert_like_local(fsdp, local)


@pytest.mark.parametrize("change", ["data", "variable"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_original_parameters_changed_after_wrapping_are_written_back(
    strategy: ShardingStrategy, change: str
) -> None:
    """use_orig_params=True: a parameter whose .data was replaced, or that was replaced by a
    Parameter of its piece's shape, is written back into the shard before the next gather
    (summon, forward), and the new Parameter trains, as in torch. Before: the change was
    silently ignored (.data), and the summon showed the old values."""
    run_on_ranks(2, _changed_orig_params, strategy, change)


def _writeback_shape_changed() -> None:
    fsdp = FSDP(_two_linears(), use_orig_params=True)
    weight = fsdp.module[0].weight
    fsdp.module[0].weight = nn.Parameter(torch.zeros(weight.numel() + 1))
    with (
        pytest.raises(RuntimeError, match=r"^Cannot writeback when the parameter shape changes"),
        FSDP.summon_full_params(fsdp),
    ):
        pass


def test_writeback_of_another_shape_raises() -> None:
    """A replacement whose shape is not the piece's cannot be written back: torch's error."""
    run_on_ranks(2, _writeback_shape_changed)


def _changed_between_forward_and_backward(change: str) -> None:
    fsdp = _wrapped_linears(ShardingStrategy.SHARD_GRAD_OP)
    loss = fsdp(torch.randn(2, 5)).sum()
    linear = fsdp.module[0].module
    if change == "data":
        linear.weight.data = linear.weight.detach().clone()
    else:
        linear.weight = nn.Parameter(linear.weight.detach().clone())
    with pytest.raises(
        AssertionError,
        match=re.escape(
            "FSDP does not support changing the parameters between forward and backward for "
            "ShardingStrategy.SHARD_GRAD_OP: the parameter weight of FSDP unit '0'"
        ),
    ) as info:
        loss.backward()
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("change", ["data", "variable"])
def test_changing_parameters_between_forward_and_backward_raises(change: str) -> None:
    """A unit kept unsharded after forward (SHARD_GRAD_OP): a parameter changed before its
    backward would be bypassed by the graph's views; its pre-backward raises torch's error."""
    run_on_ranks(2, _changed_between_forward_and_backward, change)


class _Regularised(nn.Module):
    """A forward that reads its own parameters (a weight penalty), as users' models do."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(5, 5)
        self.seen: list[tuple[str, torch.Size]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        named = list(self.named_parameters())
        self.seen = [(name, p.shape) for name, p in named]
        penalty = sum(p.pow(2).sum() for _, p in named)
        return self.lin(x).sum() + penalty


def _named_parameters_in_forward(strategy: ShardingStrategy) -> None:
    local = _Regularised()
    fsdp = FSDP(_Regularised(), sharding_strategy=strategy, use_orig_params=True)
    torch.manual_seed(1)
    batch = torch.randn(2, 5)
    expected = local(batch)
    loss = fsdp(batch)
    assert (
        fsdp.module.seen
        == local.seen
        == [
            ("lin.weight", torch.Size([5, 5])),
            ("lin.bias", torch.Size([5])),
        ]
    )
    torch.testing.assert_close(loss, expected)
    expected.backward()
    loss.backward()
    _assert_like_local(fsdp, local, grads=True)
    # Between steps the modules list the original Parameters again.
    assert all(isinstance(p, nn.Parameter) for p in fsdp.module.parameters())


@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_named_parameters_inside_forward_lists_the_original_parameters(
    strategy: ShardingStrategy,
) -> None:
    """use_orig_params=True: named_parameters() inside the forward gives each original
    parameter under its name at full shape, as torch's; a weight penalty computed there
    trains like the local model's (before: the list was empty, the penalty silently 0)."""
    run_on_ranks(2, _named_parameters_in_forward, strategy)


def _grads_edited_in_summon(strategy: ShardingStrategy, writeback: bool) -> None:
    local = _two_linears()
    fsdp = _wrapped_linears(strategy)
    torch.manual_seed(0)  # the same batch on every rank
    batch = torch.randn(4, 5)
    for model in (local, fsdp):
        model(batch).pow(2).sum().backward()
    with FSDP.summon_full_params(fsdp, with_grads=True, writeback=writeback):
        for param in fsdp.parameters():
            param.grad *= 3.0
    # Kept with writeback (as torch); without, the summon's full gradients were copies (the
    # sharded ones are unchanged), except NO_SHARD's, which are the gradients themselves.
    factor = 3.0 if writeback or strategy == ShardingStrategy.NO_SHARD else 1.0
    _assert_like_local(fsdp, local, grads=True, grad_factor=factor)


@pytest.mark.parametrize("writeback", [True, False], ids=["writeback", "no-writeback"])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
def test_gradients_edited_inside_summon_with_grads(
    strategy: ShardingStrategy, writeback: bool
) -> None:
    """summon_full_params(with_grads=True, writeback=True): gradients edited inside are
    written back into the sharded gradient, as torch's (before: silently dropped under the
    sharded strategies)."""
    run_on_ranks(2, _grads_edited_in_summon, strategy, writeback)


def _attributes_outside_forward() -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    def build(cls: Any, policy: Any, **kwargs: Any) -> nn.Module:
        torch.manual_seed(0)  # MultiheadAttention's out_proj: a Linear subclass
        model = nn.Sequential(nn.Linear(4, 4), nn.MultiheadAttention(4, 2), nn.Linear(4, 3))
        return cls(model, auto_wrap_policy=policy({nn.MultiheadAttention}), **kwargs)

    ours = build(FSDP, ModuleWrapPolicy)
    theirs = build(TorchFSDP, TorchPolicy, device_id=torch.device("cpu"))
    # before a forward and after a summon, as torch: print(model) reads each Linear's bias
    assert repr(ours) == repr(theirs)
    for name, attr in (("0", "weight"), ("1", "in_proj_weight"), ("1.out_proj", "bias")):
        mine, their = (getattr(m.module.get_submodule(name), attr) for m in (ours, theirs))
        assert (mine.shape, mine.dtype, mine.device) == (their.shape, their.dtype, their.device)
    with pytest.raises(RuntimeError, match=r"parameter '0\.weight' of FSDP unit .* no values"):
        ours.module[0].weight.sum()  # no values there: the error names the parameter
    with FSDP.summon_full_params(ours):
        assert ours.module[0].weight.abs().sum() > 0
    assert repr(ours) == repr(theirs)
    assert ours.module[2].bias.shape == (3,)


def test_module_attributes_outside_forward_are_as_torchs_flat_parameter_views() -> None:
    """With use_orig_params=False, before the first forward and after a summon, modules
    keep attributes with their parameters' shape, dtype and device, as torch's FSDP1 (its
    views): ``print(model)`` works (before: ``AttributeError: 'Linear' object has no
    attribute 'bias'``, failing torch's test_train_ema_eval_flow), and using their values
    raises an error naming the parameter and where to read it."""
    run_on_ranks(2, _attributes_outside_forward)


class _NormedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


def _names_in_and_out_of_summon(engine: str, use_orig_params: bool) -> dict[str, list[str]]:
    import functools

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    if engine == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as Engine
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy as Policy

        extra: dict[str, Any] = {"device_id": torch.device("cpu")}
    else:
        Engine, Policy, extra = FSDP, ModuleWrapPolicy, {}  # type: ignore[assignment]
    torch.manual_seed(0)
    model = Engine(
        nn.Sequential(_NormedBlock(), _NormedBlock()),
        auto_wrap_policy=Policy({_NormedBlock}),
        use_orig_params=use_orig_params,
        **extra,
    )
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, nn.Linear)
    )
    names = {"buffers": [name for name, _ in model.named_buffers()]}
    with Engine.summon_full_params(model):
        names["summoned parameters"] = [name for name, _ in model.named_parameters()]
        names["summoned buffers"] = [name for name, _ in model.named_buffers()]
    return names


def _names_as_torchs(use_orig_params: bool) -> None:
    ours = _names_in_and_out_of_summon("fullshard", use_orig_params)
    theirs = _names_in_and_out_of_summon("torch", use_orig_params)
    assert ours == theirs, (ours, theirs)
    assert "0.norm.running_mean" in ours["summoned buffers"]
    if use_orig_params:
        assert "0.lin._checkpoint_wrapped_module.weight" in ours["summoned parameters"]


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_names_inside_summon_drop_fsdps_prefix_only_as_torchs(use_orig_params: bool) -> None:
    """Inside ``summon_full_params`` torch's ``named_parameters`` and ``named_buffers`` drop
    FSDP's ``_fsdp_wrapped_module.`` and keep activation checkpointing's
    ``_checkpoint_wrapped_module.``. fullshard dropped both from parameters' names, and kept
    FSDP's in buffers' names (it had no ``named_buffers``)."""
    run_on_ranks(2, _names_as_torchs, use_orig_params)
