"""Activation checkpointing on fullshard units: every order and implementation.

Each check trains a model wrapped in fullshard with checkpointing applied (torch's
``apply_activation_checkpointing`` with ``checkpoint_wrapper`` REENTRANT / NO_REENTRANT,
before or after wrapping, around a whole unit or a submodule inside one; ``torch.utils.
checkpoint.checkpoint`` inside a forward, also over a region that uses a parameter directly;
``offload_wrapper``; transformers' ``gradient_checkpointing_enable``) on 2 ranks, next to a
single-process reference with the same checkpointing on the whole batch, and returns the
largest difference of the first step's gradients and of the parameters after three SGD
steps. Before the fix these failed with "A different number of tensors was saved" (non-
reentrant) or left the checkpointed parameters without a gradient (reentrant).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import ShardingStrategy
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import STRATEGY_NAMES, tiny_llama

STRATEGIES = [*STRATEGY_NAMES, "HYBRID_SHARD"]
TOLERANCE = 1e-5
PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_offload_wrapped_module.")


class Scaled(nn.Module):
    """A block that multiplies by a parameter, as RMSNorm and every Llama layer do."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.probe: Callable[[], str] | None = None
        """Set by ``_probe_units``: the state of the unit that owns this block's parameters."""
        self.observed: list[str] = []
        """``probe()`` each time autograd computed this block's gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.lin(x)) * self.scale
        probe = self.probe
        if probe is not None and out.grad_fn is not None:
            out.grad_fn.register_hook(lambda *_: self.observed.append(probe()))
        return out


class Split(nn.Module):
    """A unit with a checkpointable part (``inner``) and a part outside it (``outer``),
    in either order: the unit's gradient then arrives from two backward passes."""

    def __init__(self, inner_first: bool) -> None:
        super().__init__()
        self.inner = Scaled()
        self.outer = nn.Linear(8, 8)
        self.inner_first = inner_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner_first:
            return self.outer(self.inner(x))
        return self.inner(self.outer(x))


class DirectRegion(nn.Module):
    """``torch.utils.checkpoint.checkpoint`` over a function that uses parameters directly."""

    def __init__(self, use_reentrant: bool, region_first: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) / 3)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 8))
        self.outer = nn.Linear(8, 8)
        self.use_reentrant = use_reentrant
        self.region_first = region_first

    def _region(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight) * self.gain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.region_first:
            x = self.outer(x)
        x = checkpoint(self._region, x, use_reentrant=self.use_reentrant)
        return self.outer(x) if self.region_first else x


class Net(nn.Module):
    def __init__(self, make_block: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.blocks = nn.Sequential(*(make_block() for _ in range(3)))
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.inp(x)))


def _plain(name: str) -> str:
    for prefix in PREFIXES:
        name = name.replace(prefix, "")
    return name


def _probe_units(fsdp: nn.Module) -> list[Scaled]:
    """Have every ``Scaled`` block record its unit's handle state as its gradient is computed
    (it reads the parameters, which must be unsharded then: a freed buffer is read silently
    on the CPU while its memory is not reused)."""
    blocks: dict[Scaled, FSDP] = {}
    for unit in FSDP.fsdp_modules(fsdp):  # outer units first: inner ones override
        for module in unit.modules():
            if isinstance(module, Scaled):
                blocks[module] = unit
    for block, unit in blocks.items():
        handle = unit._handle
        assert handle is not None
        block.probe = lambda handle=handle: handle.state.name
    return list(blocks)


def _compare(
    model: nn.Module, fsdp: nn.Module, steps: int = 3, input_requires_grad: bool = False
) -> tuple[float, float]:
    """Train ``model`` (a local reference) on the whole batch and ``fsdp`` on this rank's
    half with SGD; the largest gradient difference of step 1 and parameter difference at
    the end. Every checkpointed block's unit must be unsharded while its gradient is
    computed."""
    blocks = _probe_units(fsdp)
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    grad_diff = 0.0
    for step in range(steps):
        batch = torch.randn(4 * world, 8, generator=generator)
        local = batch.chunk(world)[rank].clone().requires_grad_(input_requires_grad)
        fsdp(local).square().mean().backward()
        model(batch.clone().requires_grad_(input_requires_grad)).square().mean().backward()
        if step == 0:
            grad_diff = _grad_difference(model, fsdp)
        _step(optim, ref_optim)
    observed = [state for block in blocks for state in block.observed]
    assert set(observed) == ({"UNSHARDED"} if blocks else set()), observed
    return grad_diff, _param_difference(model, fsdp)


def _step(*optims: torch.optim.Optimizer) -> None:
    for optim in optims:
        optim.step()
        optim.zero_grad()


def _grad_difference(model: nn.Module, fsdp: nn.Module) -> float:
    reference = {_plain(n): p.grad for n, p in model.named_parameters()}
    worst = 0.0
    with FSDP.summon_full_params(fsdp, with_grads=True):
        for name, param in fsdp.named_parameters():
            expected = reference[_plain(name)]
            assert param.grad is not None, f"{_plain(name)} got no gradient"
            assert expected is not None
            worst = max(worst, (param.grad - expected).abs().max().item())
    return worst


def _param_difference(model: nn.Module, fsdp: nn.Module) -> float:
    reference = {_plain(n): p for n, p in model.named_parameters()}
    with FSDP.summon_full_params(fsdp):
        named = list(fsdp.named_parameters())
        assert {_plain(n) for n, _ in named} == set(reference)
        return max((p - reference[_plain(n)]).abs().max().item() for n, p in named)


def _wrapper(impl: str) -> Callable[[nn.Module], nn.Module]:
    if impl == "OFFLOAD":
        return offload_wrapper
    impl = impl.removesuffix("_FULL_RECOMPUTE")
    return functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl[impl])


def _wrap(model: nn.Module, classes: set[type[nn.Module]], strategy: str) -> FSDP:
    # use_orig_params=True throughout: summon(with_grads=True) needs it to show gradients.
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy(classes),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
    )


def _check_wrapper(impl: str, order: str, target: str, strategy: str) -> tuple[float, float]:
    """``apply_activation_checkpointing`` on each block (``target="block"``: the wrapped
    module of a unit) or on each unit itself (``"unit"``: the checkpoint wraps the FSDP
    module), ``before`` or ``after`` wrapping."""
    torch.manual_seed(0)
    model = Net(Scaled)
    fsdp_model = copy.deepcopy(model)
    wrapper = _wrapper(impl)
    apply_activation_checkpointing(
        model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Scaled)
    )
    if order == "before":  # the units wrap the checkpoint wrappers
        apply_activation_checkpointing(
            fsdp_model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: isinstance(m, Scaled)
        )
        fsdp = _wrap(fsdp_model, {CheckpointWrapper}, strategy)
    else:
        fsdp = _wrap(fsdp_model, {Scaled}, strategy)
        unit_or_block = (
            (lambda m: isinstance(m, FSDP) and m is not fsdp)
            if target == "unit"
            else (lambda m: isinstance(m, Scaled))
        )
        apply_activation_checkpointing(fsdp, checkpoint_wrapper_fn=wrapper, check_fn=unit_or_block)
    # Non-reentrant recomputation normally stops once it has what backward needs, before
    # the unit's post-forward; without early stopping the whole unit forward runs again.
    with set_checkpoint_early_stop(not impl.endswith("_FULL_RECOMPUTE")):
        return _compare(model, fsdp)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(
    ("impl", "order", "target"),
    [
        ("NO_REENTRANT", "after", "block"),
        ("REENTRANT", "after", "block"),
        ("NO_REENTRANT", "before", "block"),
        ("REENTRANT", "before", "block"),
        ("NO_REENTRANT", "after", "unit"),
        ("REENTRANT", "after", "unit"),
        ("NO_REENTRANT_FULL_RECOMPUTE", "after", "unit"),
        ("OFFLOAD", "after", "block"),
    ],
)
def test_checkpoint_wrapper_matches_reference(
    impl: str, order: str, target: str, strategy: str
) -> None:
    """checkpoint_wrapper before/after wrapping, on a unit's module or on the unit: the
    gradients and trained parameters equal a local run with the same checkpointing."""
    for grad_diff, param_diff in run_on_ranks(2, _check_wrapper, impl, order, target, strategy):
        assert grad_diff < TOLERANCE and param_diff < TOLERANCE, (grad_diff, param_diff)


def _check_split(impl: str, inner_first: bool, strategy: str, nested: bool) -> tuple[float, float]:
    """Checkpointing a submodule inside a unit that also computes outside it."""
    torch.manual_seed(0)
    model = Net(lambda: Split(inner_first))
    fsdp_model = copy.deepcopy(model)
    for target in (model, fsdp_model):
        apply_activation_checkpointing(
            target, checkpoint_wrapper_fn=_wrapper(impl), check_fn=lambda m: isinstance(m, Scaled)
        )
    classes: set[type[nn.Module]] = {Split} if nested else set()
    return _compare(model, _wrap(fsdp_model, classes, strategy))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
@pytest.mark.parametrize("inner_first", [True, False], ids=["inner_first", "outer_first"])
@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
def test_checkpointed_submodule_inside_unit_matches_reference(
    impl: str, inner_first: bool, strategy: str
) -> None:
    """A checkpointed submodule inside a unit with other computation, in either order: a
    reentrant region's gradient arrives in a backward of its own, and the unit's parameters
    stay unsharded until both parts have delivered theirs."""
    for nested in (True, False):
        for grad_diff, param_diff in run_on_ranks(
            2, _check_split, impl, inner_first, strategy, nested
        ):
            assert grad_diff < TOLERANCE and param_diff < TOLERANCE, (nested, grad_diff, param_diff)


def _check_direct_region(
    use_reentrant: bool, region_first: bool, strategy: str
) -> tuple[float, float]:
    torch.manual_seed(0)
    model = Net(lambda: DirectRegion(use_reentrant, region_first))
    return _compare(model, _wrap(copy.deepcopy(model), {DirectRegion}, strategy))


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
@pytest.mark.parametrize("region_first", [True, False], ids=["region_first", "region_last"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_checkpoint_region_using_parameters_matches_reference(
    use_reentrant: bool, region_first: bool, strategy: str
) -> None:
    """torch.utils.checkpoint.checkpoint inside a unit's forward over a function that uses
    the unit's parameters directly (not through a submodule)."""
    for grad_diff, param_diff in run_on_ranks(
        2, _check_direct_region, use_reentrant, region_first, strategy
    ):
        assert grad_diff < TOLERANCE and param_diff < TOLERANCE, (grad_diff, param_diff)


def _check_use_orig_params_false(impl: str, strategy: str) -> float:
    """use_orig_params=False (no summon with_grads): compare trained parameters only."""
    torch.manual_seed(0)
    model = Net(Scaled)
    fsdp_model = copy.deepcopy(model)
    for target in (model, fsdp_model):
        apply_activation_checkpointing(
            target, checkpoint_wrapper_fn=_wrapper(impl), check_fn=lambda m: isinstance(m, Scaled)
        )
    fsdp = FSDP(
        fsdp_model,
        auto_wrap_policy=ModuleWrapPolicy({CheckpointWrapper}),
        sharding_strategy=ShardingStrategy[strategy],
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(model.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        batch = torch.randn(4 * world, 8, generator=generator)
        fsdp(batch.chunk(world)[rank]).square().mean().backward()
        model(batch).square().mean().backward()
        _step(optim, ref_optim)
    return _param_difference(model, fsdp)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
def test_checkpointing_with_flat_parameters_matches_reference(impl: str, strategy: str) -> None:
    """The same with use_orig_params=False: trained parameters equal the reference's."""
    for param_diff in run_on_ranks(2, _check_use_orig_params_false, impl, strategy):
        assert param_diff < TOLERANCE, param_diff


def _check_hf_gradient_checkpointing(use_reentrant: bool, use_orig_params: bool) -> float:
    """transformers' gradient_checkpointing_enable on a Llama built from a config."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    model = tiny_llama()
    fsdp_model = copy.deepcopy(model)
    kwargs = {"use_reentrant": use_reentrant}
    for target in (model, fsdp_model):
        target.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        target.train()
    fsdp = FSDP(
        fsdp_model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
        use_orig_params=use_orig_params,
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    optim = torch.optim.SGD(fsdp.parameters(), lr=0.5)
    ref_optim = torch.optim.SGD(model.parameters(), lr=0.5)
    generator = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2 * world, 16), generator=generator)
        local = tokens.chunk(world)[rank]
        fsdp(input_ids=local, labels=local).loss.backward()
        model(input_ids=tokens, labels=tokens).loss.backward()
        _step(optim, ref_optim)
    return _param_difference(model, fsdp)


@pytest.mark.parametrize("use_orig_params", [True, False], ids=["orig_params", "flat_params"])
@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_transformers_gradient_checkpointing_matches_reference(
    use_reentrant: bool, use_orig_params: bool
) -> None:
    """A Llama with gradient_checkpointing_enable(use_reentrant=...) wrapped per decoder
    layer trains like the same model in one process."""
    pytest.importorskip("transformers")
    for param_diff in run_on_ranks(
        2, _check_hf_gradient_checkpointing, use_reentrant, use_orig_params
    ):
        assert param_diff < TOLERANCE, param_diff


def _unsharded_while_blocks_backward(impl: str, discard_first: bool) -> list[int]:
    """How many units hold unsharded parameters as each block's gradient is computed, in a
    step that follows (``discard_first``) a forward with grad on that is never
    backpropagated (a validation loss logged without no_grad)."""
    torch.manual_seed(0)
    model = Net(Scaled)
    fsdp = _wrap(model, {Scaled}, "FULL_SHARD")
    apply_activation_checkpointing(
        fsdp, checkpoint_wrapper_fn=_wrapper(impl), check_fn=lambda m: isinstance(m, Scaled)
    )
    units = [u for u in FSDP.fsdp_modules(fsdp) if u._handle is not None]
    blocks = _probe_units(fsdp)
    for block in blocks:
        block.probe = lambda: str(sum(u._handle.state.name != "SHARDED" for u in units))
    x = torch.randn(4, 8)
    fsdp(x).sum().backward()  # a first step
    if discard_first:
        fsdp(x).sum()  # grad on, never backpropagated
    for block in blocks:
        block.observed.clear()
    fsdp(x).sum().backward()
    return [int(count) for block in blocks for count in block.observed]


@pytest.mark.parametrize("discard_first", [False, True], ids=["plain", "after_discarded"])
@pytest.mark.parametrize("impl", ["REENTRANT", "NO_REENTRANT"])
def test_forward_without_backward_does_not_delay_resharding(impl: str, discard_first: bool) -> None:
    """Installments are counted for the backward in progress: a forward that was never
    backpropagated leaves nothing behind, so units still reshard as their backward ends (at
    most the root, the unit computing and the prefetched one are unsharded)."""
    for counts in run_on_ranks(2, _unsharded_while_blocks_backward, impl, discard_first):
        assert len(counts) == 3 and max(counts) <= 3, counts


class NestedBlock(Scaled):
    """A ``Scaled`` that the wrap policy makes a unit of its own."""


class RegionBeforeUnit(nn.Module):
    """The root computes, then runs a reentrant region, then a nested unit: the root's
    gradient arrives from the region's backward and from its own graph's first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8)
        self.mid = Scaled()
        self.block = NestedBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = checkpoint(self.mid, self.pre(x), use_reentrant=True)
        return self.head(self.block(h))


def _check_region_before_unit(strategy: str) -> tuple[float, float]:
    torch.manual_seed(0)
    model = RegionBeforeUnit()
    fsdp = FSDP(
        copy.deepcopy(model),
        auto_wrap_policy=ModuleWrapPolicy({NestedBlock}),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
    )
    return _compare(model, fsdp, input_requires_grad=True)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_reentrant_region_before_a_nested_unit_matches_reference(strategy: str) -> None:
    """A reentrant region of the root before a nested unit: the root waits for both of its
    gradient installments (it read freed parameters when the walk stopped at the nested
    unit and missed the region)."""
    for grad_diff, param_diff in run_on_ranks(2, _check_region_before_unit, strategy):
        assert grad_diff < TOLERANCE and param_diff < TOLERANCE, (grad_diff, param_diff)


class _CheckpointedBlocks(nn.Sequential):
    """Each block under ``torch.utils.checkpoint`` inside the forward (transformers' way)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return x


def _recomputations_leave_nothing_behind() -> list[int]:
    from fullshard import fully_shard
    from fullshard._fsdp2.state import state_of

    torch.manual_seed(0)
    model = _CheckpointedBlocks(*(nn.Sequential(nn.Linear(6, 6), nn.Tanh()) for _ in range(2)))
    for block in model:
        fully_shard(block)
    fully_shard(model)
    for _ in range(6):
        model(torch.randn(4, 6)).sum().backward()
    return [len(state_of(block).input_dtypes) for block in model]


def test_recomputed_fully_shard_units_leave_nothing_behind_across_steps() -> None:
    """A ``fully_shard`` module recomputed by non-reentrant checkpointing in backward runs its
    pre-forward but, with checkpointing's early stop, not its post-forward: each step left an
    entry in the module's ``input_dtypes`` (6 after 6 steps, growing for as long as training
    ran). The root's next forward now drops them: at most the last backward's remain."""
    for counts in run_on_ranks(2, _recomputations_leave_nothing_behind):
        assert max(counts) <= 1, counts
