"""Fuzzed checkpoint resumes through torch's checkpoint API, across engines and layouts.

A checkpoint is only as good as the run it resumes. Each example trains
``test_fuzz_fully_shard``'s drawn models (odd and tiny widths, so parameters with fewer rows
than ranks; frozen blocks and frozen layers inside a unit; ties; blocks unused, repeated or
checkpointed) on gloo ranks, every step on its rows of one global batch:

- uninterrupted, 4 steps, under the saving side's engine and layout;
- 2 steps under the same, then a checkpoint: ``get_state_dict`` and ``dcp.save`` (sharded), or
  ``get_state_dict(full_state_dict=True, cpu_offload=True)`` and ``torch.save`` on rank 0 (as
  accelerate and transformers save a full state dict);
- a model built afresh (other weights, no forward yet) under the resuming side's engine and
  layout, loaded (``dcp.load`` + ``set_state_dict``, or rank 0's file with
  ``broadcast_from_rank0=True``), and 2 more steps.

The two sides draw their engines (fullshard's ``fully_shard``, torch's ``fully_shard``,
fullshard's ``FullyShardedDataParallel`` with and without ``use_orig_params``) and their
layouts (which blocks get a unit, ``reshard_after_forward``, parameters sharded on dim 1, CPU
offload; on 4 ranks a 1-D mesh, a 2 x 2 HSDP mesh, or tensor parallelism over a (dp, tp) mesh)
independently, so checkpoints move between doors, between torch's engine and fullshard's, and
between shardings. The resumed run's global losses, final parameters and optimizer state
must be the uninterrupted run's.

A last test saves on 2, 3 or 4 ranks and resumes on another of them, DCP resharding the
checkpoint.

CI runs FULLSHARD_FUZZ_EXAMPLES (default 30) examples on 2 ranks, a fifth as many on 4 with
and without tensor parallelism, and a sixth across world sizes.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import event, example, given
from hypothesis import strategies as st
from test_fuzz_fully_shard import (
    DIM,
    Net,
    Tree,
    _api,
    _dim1_when_wider,
    _full,
    _fuzz_settings,
    trees,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

from harness import run_on_ranks

EXAMPLES = int(os.environ.get("FULLSHARD_FUZZ_EXAMPLES", "30"))
ENGINES = ("fullshard", "torch", "fullshard-fsdp1", "fullshard-fsdp1-flat")
"""fullshard's and torch's ``fully_shard``, fullshard's ``FullyShardedDataParallel`` with and
without ``use_orig_params``. Not torch's FSDP1: on CPU ranks torch 2.13's cannot save through
``get_state_dict`` and ``dcp.save`` ("Missing key in checkpoint state_dict: optim.param_groups"
at the load) and its rank 0 crashes (SIGSEGV) loading a full state dict with
``broadcast_from_rank0`` (docs/conformance.md)."""
FSDP2_ENGINES = ("fullshard", "torch")
GLOBAL_BATCH = 12
"""Rows of one step's batch, split over the data-parallel ranks (2, 3 or 4), so every layout
and world size computes the same global loss."""
STEPS, SAVED_AT = 4, 2


@dataclass(frozen=True)
class Side:
    """How one half of the run is sharded."""

    engine: str
    units: tuple[int, ...]
    """Blocks that get a unit of their own (never a tied one: its tie would be broken)."""
    reshard_after_forward: bool | int
    dim1: bool
    offload: bool
    hsdp: bool
    """4 ranks: a (replicate, shard) 2 x 2 mesh (HYBRID_SHARD for FSDP1) instead of 1-D."""
    tp: bool = False
    """4 ranks, ``fully_shard``: a (dp, tp) 2 x 2 mesh, each block's first Linear
    ``ColwiseParallel`` and second ``RowwiseParallel`` over "tp", then ``fully_shard`` over
    "dp" (as torchtitan composes them)."""


@dataclass(frozen=True)
class Resume:
    precision: str
    """"none", or "bf16" (parameters in bf16, gradients reduced in fp32)."""
    optimizer: str
    decay_groups: bool
    """Two parameter groups: weights with weight decay, biases and norms without, at another lr."""
    full: bool
    """A full state dict on rank 0 (torch.save, broadcast on load) instead of dcp's shards."""
    saved: Side
    resumed: Side


@st.composite
def sides(draw: st.DrawFn, tree: Tree, world: int, tp: bool = False) -> Side:
    """With ``tp``, a tensor-parallel side (``tree`` must fit it)."""
    engine = draw(st.sampled_from(FSDP2_ENGINES if tp else ENGINES))
    tied = set(tree.tie or ())
    blocks = [index for index in range(len(tree.widths)) if index not in tied]
    layout = "1d"
    if tp:
        layout = "tp"
    elif world == 4:
        layout = draw(st.sampled_from(["1d", "hsdp"]))
    hsdp, tp = layout == "hsdp", layout == "tp"
    shard = 2 if hsdp or tp else world
    sizes = [k for k in range(1, shard + 1) if shard % k == 0]
    # dim 1 must split evenly: the head's and first layers' DIM columns, and a second
    # layer's width where it is wider than DIM (`_dim1_when_wider`)
    dim1_splits = all(cols % shard == 0 for cols in (DIM, *tree.widths) if cols >= DIM)
    return Side(
        engine,
        tuple(sorted(draw(st.sets(st.sampled_from(blocks), max_size=len(blocks)))))
        if blocks
        else (),
        draw(st.sampled_from([True, False, *sizes])),
        not tp and dim1_splits and draw(st.booleans()),
        draw(st.booleans()),
        hsdp,
        tp,
    )


@st.composite
def resumes(draw: st.DrawFn, world: int) -> tuple[Tree, Resume]:
    tree = draw(trees())
    return _completed(draw, tree, draw(sides(tree, world)), draw(sides(tree, world)))


def _completed(draw: st.DrawFn, tree: Tree, saved: Side, resumed: Side) -> tuple[Tree, Resume]:
    """The tree both sides can train, and the rest of the example drawn: precision,
    optimizer, parameter groups, format. A flat parameter holds weights and biases alike (one
    group), and the never-called block's parameters too, which its optimizer then steps with
    zero gradients (AdamW decays them) where the others' never step them: no such block
    beside it."""
    flat = "fullshard-fsdp1-flat" in (saved.engine, resumed.engine)
    tree = dataclasses.replace(tree, unused_block=tree.unused_block and not flat)
    return tree, Resume(
        draw(st.sampled_from(["none", "bf16"])),
        draw(st.sampled_from(["sgd", "adam", "adamw"])),
        not flat and draw(st.booleans()),
        draw(st.booleans()),
        saved,
        resumed,
    )


@st.composite
def tp_resumes(draw: st.DrawFn) -> tuple[Tree, Resume]:
    """4 ranks, one side or both tensor parallel (a (dp, tp) mesh): torch's TP needs the hidden
    widths to split evenly over 2 ranks, and a tie it distributes twice breaks."""
    tree = draw(trees())
    even = tuple(width + width % 2 for width in tree.widths)
    tree = dataclasses.replace(tree, widths=even, tie=None)
    which = draw(st.sampled_from(["saved", "resumed", "both"]))
    saved = draw(sides(tree, 4, tp=which != "resumed"))
    return _completed(draw, tree, saved, draw(sides(tree, 4, tp=which != "saved")))


def _mesh(side: Side) -> Any:
    world = dist.get_world_size()
    if side.hsdp:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    if side.tp:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return init_device_mesh("cpu", (world,))


def _data_parallel(side: Side) -> tuple[int, int]:
    """This rank's index among the ranks that read different rows, and their count."""
    if side.tp:
        return dist.get_rank() // 2, dist.get_world_size() // 2
    return dist.get_rank(), dist.get_world_size()


def _tensor_parallel(model: Net, mesh: Any) -> Any:
    """Each block's Linears split over ``mesh["tp"]``; returns the "dp" mesh."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    for block in model.blocks:
        plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        parallelize_module(block, mesh["tp"], plan)
    return mesh["dp"]


def _sharded(tree: Tree, seed: int, side: Side, precision: str) -> nn.Module:
    """``Net(tree)`` with weights of ``seed``, sharded as ``side`` says."""
    model = Net(dataclasses.replace(tree, seed=seed))
    if side.engine.startswith("fullshard-fsdp1"):
        return _fsdp1(model, side, precision)
    api = _api(side.engine)
    mesh = _mesh(side)
    if side.tp:
        mesh = _tensor_parallel(model, mesh)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": side.reshard_after_forward}
    if precision == "bf16":
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if side.offload:
        kwargs["offload_policy"] = api.CPUOffloadPolicy(pin_memory=False)
    if side.dim1:
        kwargs["shard_placement_fn"] = _dim1_when_wider
    for index in side.units:
        api.fully_shard(model.blocks[index], **kwargs)
    api.fully_shard(model, **kwargs)
    return model


def _fsdp1(model: Net, side: Side, precision: str) -> nn.Module:
    import fullshard as api
    from fullshard.wrap import CustomPolicy

    targets = {model.blocks[index] for index in side.units}
    kwargs: dict[str, Any] = {
        "auto_wrap_policy": CustomPolicy(lambda module: module in targets),
        "use_orig_params": side.engine != "fullshard-fsdp1-flat",
    }
    if side.hsdp:
        kwargs["sharding_strategy"] = api.ShardingStrategy.HYBRID_SHARD
        kwargs["device_mesh"] = _mesh(side)
    if precision == "bf16":
        kwargs["mixed_precision"] = api.MixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if side.offload:
        kwargs["cpu_offload"] = api.CPUOffload(offload_params=True)
    return api.FullyShardedDataParallel(model, **kwargs)


def _optimizer(resume: Resume, model: nn.Module) -> torch.optim.Optimizer:
    # Not the never-called block's: an optimizer that never stepped a parameter saves no
    # state for it, and torch's ``get_state_dict`` on the fresh optimizer makes some (a step
    # with zero gradients), which ``dcp.load`` then misses ("Missing key in checkpoint
    # state_dict"), on torch's engine as on fullshard's.
    named = [
        (name, p)
        for name, p in model.named_parameters()
        if p.requires_grad and "unused." not in name
    ]
    if resume.decay_groups:
        groups: list[dict[str, Any]] = [
            # by name, as transformers' Trainer groups them: FSDP1's parameters are 1-D
            # views of its flat shard, whatever their shape
            {"params": [p for name, p in named if not _no_decay(name)]},
            {
                "params": [p for name, p in named if _no_decay(name)],
                "weight_decay": 0.0,
                "lr": 0.004,
            },
        ]
        groups = [group for group in groups if group["params"]]
    else:
        groups = [{"params": [p for _, p in named]}]
    if resume.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9)
    if resume.optimizer == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)


def _no_decay(name: str) -> bool:
    return name.endswith("bias") or ".norm." in name


def _input(step: int, side: Side) -> torch.Tensor:
    """This rank's rows of step ``step``'s global batch."""
    index, count = _data_parallel(side)
    rows = GLOBAL_BATCH // count
    batch = torch.randn(GLOBAL_BATCH, DIM, generator=torch.Generator().manual_seed(step))
    return batch[index * rows : (index + 1) * rows]


def _steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range, side: Side) -> list[float]:
    """Trains ``steps``; returns the global losses (every rank's mean)."""
    losses = []
    for step in steps:
        loss = model(_input(step, side)).float().pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _outcome(model: nn.Module, optim: torch.optim.Optimizer, losses: list[float]) -> dict[str, Any]:
    """Losses, full parameters (by the plain model's names) and full optimizer state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    options = StateDictOptions(full_state_dict=True)
    params = {
        name: _full(value) for name, value in get_model_state_dict(model, options=options).items()
    }
    state = get_optimizer_state_dict(model, optim, options=options)
    for name, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                params[f"optim {name} {key}"] = _full(value)
    return {"losses": losses, "values": params}


def _uninterrupted(tree: Tree, resume: Resume) -> dict[str, Any]:
    model = _sharded(tree, tree.seed, resume.saved, resume.precision)
    optim = _optimizer(resume, model)
    return _outcome(model, optim, _steps(model, optim, range(STEPS), resume.saved))


def _save(tree: Tree, resume: Resume, path: str) -> list[float]:
    model = _sharded(tree, tree.seed, resume.saved, resume.precision)
    optim = _optimizer(resume, model)
    losses = _steps(model, optim, range(SAVED_AT), resume.saved)
    if resume.full:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optim, options=options)
        if dist.get_rank() == 0:
            torch.save({"model": model_state, "optim": optim_state}, os.path.join(path, "full.pt"))
    else:
        model_state, optim_state = get_state_dict(model, optim)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    dist.barrier()
    return losses


def _resume(tree: Tree, resume: Resume, path: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _sharded(tree, tree.seed + 1, resume.resumed, resume.precision)
    optim = _optimizer(resume, model)
    if resume.full:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        saved: dict[str, Any] = {"model": {}, "optim": {}}
        if dist.get_rank() == 0:
            saved = torch.load(os.path.join(path, "full.pt"), weights_only=True)
        set_model_state_dict(model, saved["model"], options=options)
        set_optimizer_state_dict(model, optim, saved["optim"], options=options)
    else:
        model_state, optim_state = get_state_dict(model, optim)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    return model, optim


def _interrupted(tree: Tree, resume: Resume, path: str) -> dict[str, Any]:
    losses = _save(tree, resume, path)
    model, optim = _resume(tree, resume, path)
    losses += _steps(model, optim, range(SAVED_AT, STEPS), resume.resumed)
    return _outcome(model, optim, losses)


def _compare(tree: Tree, resume: Resume, path: str) -> str:
    expected = _uninterrupted(tree, resume)
    got = _interrupted(tree, resume, path)
    _assert_resumed(got, expected, resume)
    return f"{_label(resume.saved)} -> {_label(resume.resumed)}"


def _assert_resumed(got: dict[str, Any], expected: dict[str, Any], resume: Resume) -> None:
    # fp32: the sides' reductions may add in another order (HSDP against a 1-D mesh). bf16:
    # the sides round to bf16 at other points (FSDP1 casts the root's inputs only), as
    # `test_fuzz_fully_shard` allows between torch's engine and fullshard's.
    rel = 1e-5 if resume.precision == "none" else 2e-2
    share = 0.1 if resume.precision == "none" else 0.5
    assert got["losses"] == pytest.approx(expected["losses"], rel=rel, abs=rel / 10), (
        got["losses"],
        expected["losses"],
    )
    assert got["values"].keys() == expected["values"].keys()
    # the tolerance's scale: the parameters' and moments' magnitudes, not Adam's step count
    present = [v for k, v in expected["values"].items() if v.numel() and not k.endswith(" step")]
    scale = max((float(v.abs().max()) for v in present), default=1.0)
    for name, value in expected["values"].items():
        torch.testing.assert_close(
            got["values"][name], value, rtol=rel, atol=rel * scale * share, msg=name
        )


def _label(side: Side) -> str:
    return side.engine + ("/tp" if side.tp else "/hsdp" if side.hsdp else "")


def _check(world: int, example: tuple[Tree, Resume]) -> None:
    path = tempfile.mkdtemp(prefix="fullshard-resume-")
    try:
        outcome = run_on_ranks(world, _compare, *example, path, timeout=240)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert len(set(outcome)) == 1, outcome
    event(outcome[0])


@_fuzz_settings(EXAMPLES)
@given(example=resumes(2))
def test_fuzzed_resume_trains_as_the_uninterrupted_run_on_two_ranks(
    example: tuple[Tree, Resume],
) -> None:
    _check(2, example)


_STEP_OF_A_PARAMETER_HELD_ELSEWHERE = (
    Tree((1,), None, (), (), True, None, False, False, 0),
    Resume(
        "none",
        "adam",
        False,
        False,
        Side("fullshard", (), True, False, False, False),
        Side("fullshard-fsdp1", (), True, False, False, False),
    ),
)
"""4 ranks resume a ``fully_shard`` checkpoint under ``FullyShardedDataParallel(use_orig_params=
True)``, one unit: ranks 1 and 2 hold only the never-called block's elements, rank 0 none of
the head's. The optimizer state dict took a parameter's Adam ``step`` from such a rank (1, from
``get_state_dict``'s initial step, or 2, from the load) instead of from the ranks that step it
(4): [Note: scalar states of a parameter a rank holds none of]."""


@_fuzz_settings(max(1, EXAMPLES // 5))
@given(example=resumes(4))
@example(example=_STEP_OF_A_PARAMETER_HELD_ELSEWHERE)
def test_fuzzed_resume_trains_as_the_uninterrupted_run_on_four_ranks(
    example: tuple[Tree, Resume],
) -> None:
    _check(4, example)


@_fuzz_settings(max(1, EXAMPLES // 5))
@given(example=tp_resumes())
def test_fuzzed_resume_with_tensor_parallel_sides_trains_as_the_uninterrupted_run(
    example: tuple[Tree, Resume],
) -> None:
    _check(4, example)


# -- across world sizes ------------------------------------------------------------------


def _saved_uninterrupted(tree: Tree, resume: Resume, path: str) -> dict[str, Any]:
    """On the saving world: the uninterrupted run's outcome, and the first half's losses
    with its checkpoint in ``path``."""
    return {"expected": _uninterrupted(tree, resume), "first": _save(tree, resume, path)}


def _resumed_elsewhere(tree: Tree, resume: Resume, path: str) -> dict[str, Any]:
    model, optim = _resume(tree, resume, path)
    return _outcome(model, optim, _steps(model, optim, range(SAVED_AT, STEPS), resume.resumed))


@st.composite
def resharded(draw: st.DrawFn) -> tuple[int, int, Tree, Resume]:
    """A checkpoint saved on one world size and resumed on another."""
    saved_on, resumed_on = draw(st.sampled_from([(2, 4), (4, 2), (2, 3), (3, 2), (4, 3)]))
    tree = draw(trees())
    saved, resumed = draw(sides(tree, saved_on)), draw(sides(tree, resumed_on))
    return (saved_on, resumed_on, *_completed(draw, tree, saved, resumed))


@_fuzz_settings(max(1, EXAMPLES // 6))
@given(example=resharded())
def test_fuzzed_resume_on_another_world_size_trains_as_the_uninterrupted_run(
    example: tuple[int, int, Tree, Resume],
) -> None:
    """Saved on 2, 3 or 4 ranks, resumed on another of them (each side's layout drawn for
    its own world): DCP reshards the checkpoint, and the resumed run is the uninterrupted
    one's."""
    saved_on, resumed_on, tree, resume = example
    path = tempfile.mkdtemp(prefix="fullshard-resume-")
    try:
        first = run_on_ranks(saved_on, _saved_uninterrupted, tree, resume, path, timeout=240)
        second = run_on_ranks(resumed_on, _resumed_elsewhere, tree, resume, path, timeout=240)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    expected = first[0]["expected"]
    got = {"losses": first[0]["first"] + second[0]["losses"], "values": second[0]["values"]}
    _assert_resumed(got, expected, resume)
    event(f"{saved_on} -> {resumed_on}: {_label(resume.saved)} -> {_label(resume.resumed)}")
