"""Units mixing frozen and trainable parameters (LoRA, PEFT), with either use_orig_params.

The model is ``LoRAStack``: a frozen base with trainable low-rank adapters, wrapped with one
unit per ``LoRABlock`` plus the root, so every unit mixes ``requires_grad``. The expectations
are computed from the plain model, not from fullshard's layout: a unit's gradient is the
concatenation of its trainable parameters' gradients in registration order, padded to a
multiple of the shard group's size and split evenly (see [Note: frozen parameters] in
fullshard/_engine/flat_param.py). Hybrid strategies run on 4 ranks (2 shards x 2 replicas).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard.checkpoint as ckpt
from fullshard import (
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._comm.collectives import COUNTERS
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import LoRABlock, LoRAStack, strategy_kwargs

FLAT = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]
HYBRID = ["HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
HYBRID_ENV = {"LOCAL_WORLD_SIZE": "2"}
"""Hybrid strategies on 4 ranks: shard over pairs of ranks, replicate across the pairs."""
BYTES = 4  # float32
each_use_orig_params = pytest.mark.parametrize(
    "use_orig_params", [False, True], ids=["flat_param", "orig_params"]
)


def _wrap(model: nn.Module, strategy: str, use_orig_params: bool, **kwargs: Any) -> FSDP:
    return FSDP(
        model,
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({LoRABlock}),
        **kwargs,
    )


def _units(model: FSDP) -> list[FSDP]:
    return [unit for unit in FSDP.fsdp_modules(model) if unit._handle is not None]


def _input(rank: int, step: int) -> Tensor:
    return LoRAStack().get_input("cpu", rank=rank, step=step)[0]  # (4, 7)


def _expected_shard(unit: FSDP, full: list[Tensor]) -> Tensor:
    """This rank's part of the unit's trainable values ``full`` (in registration order):
    concatenated, padded to a multiple of the shard group's size, split evenly."""
    handle = unit._handle
    assert handle is not None
    flat = torch.cat([tensor.reshape(-1) for tensor in full])  # (trainable numel,)
    if not handle.uses_sharded_strategy:
        return flat
    num_shards = handle.groups.shard_size
    padded = nn.functional.pad(flat, (0, -flat.numel() % num_shards))
    return padded.chunk(num_shards)[handle.groups.shard_rank]


def _numel(unit: FSDP, numel_of: dict[int, int]) -> int:
    """Elements of the unit's parameters, from the model as built (``numel_of``)."""
    assert unit._handle is not None
    return sum(numel_of[id(p)] for p in unit._handle.orig_params)


def _trainable_numel(unit: FSDP, numel_of: dict[int, int]) -> int:
    """Elements of the unit's trainable parameters, from the model as built (``numel_of``)."""
    assert unit._handle is not None
    return sum(numel_of[id(p)] for p in unit._handle.orig_params if p.requires_grad)


def _real_elements_on_rank(unit: FSDP, trainable: int) -> int:
    """How many of the unit's trainable elements (padding excluded) this rank's shard holds."""
    handle = unit._handle
    assert handle is not None
    if not handle.uses_sharded_strategy:
        return trainable
    shard = -(-trainable // handle.groups.shard_size)
    return max(0, min(shard, trainable - handle.groups.shard_rank * shard))


# ----------------------------------------------------------------------------------------
# Gradients equal DDP's; frozen parameters get none and never change


def _check_grads(fsdp: FSDP, ref: nn.Module, fqn_of: dict[int, str], where: str) -> None:
    ref_params = dict(ref.named_parameters())
    for unit in _units(fsdp):
        handle = unit._handle
        assert handle is not None
        trainable = [p for p in handle.orig_params if p.requires_grad]
        expected = _expected_shard(unit, [ref_params[fqn_of[id(p)]].grad for p in trainable])
        flat_grad = handle.flat_param.grad
        assert flat_grad is not None, f"{where}: unit {handle.label} has no gradient"
        torch.testing.assert_close(flat_grad, expected, rtol=1e-5, atol=1e-6, msg=where)
        for param in handle.orig_params:
            if not param.requires_grad:
                assert param.grad is None, f"{where}: frozen {fqn_of[id(param)]} got a gradient"
        for frozen_flat in handle.flat_params[1:]:
            assert not frozen_flat.requires_grad and frozen_flat.grad is None, where


def _grads_match_ddp(strategy: str, use_orig_params: bool, offload: bool) -> None:
    rank = dist.get_rank()
    ref_model, model = LoRAStack(), LoRAStack()
    fqn_of = {id(p): fqn for fqn, p in model.named_parameters()}
    frozen = {fqn: p.detach().clone() for fqn, p in model.named_parameters() if not p.requires_grad}
    ref = DDP(ref_model)
    fsdp = _wrap(model, strategy, use_orig_params, cpu_offload=CPUOffload(offload_params=offload))
    ref_optim = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)  # frozen ones included, as PEFT does
    for step in range(4):
        x = _input(rank, step)
        ref_loss = ref_model.get_loss((x,), ref(x))
        ref_loss.backward()
        loss = ref_model.get_loss((x,), fsdp(x))
        loss.backward()
        where = f"rank {rank} step {step}"
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6, msg=where)
        _check_grads(fsdp, ref_model, fqn_of, where)
        ref_trainable = [p for p in ref_model.parameters() if p.requires_grad]
        ref_norm = torch.nn.utils.clip_grad_norm_(ref_trainable, max_norm=0.5)
        torch.testing.assert_close(fsdp.clip_grad_norm_(0.5), ref_norm, rtol=1e-5, atol=1e-6)
        _check_grads(fsdp, ref_model, fqn_of, f"{where}, clipped")
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
    ref_params = dict(ref_model.named_parameters())
    with FSDP.summon_full_params(fsdp):
        for fqn, param in fsdp.named_parameters():
            torch.testing.assert_close(param, ref_params[fqn], rtol=1e-5, atol=1e-6, msg=fqn)
            if fqn in frozen:
                assert torch.equal(param, frozen[fqn]), f"frozen {fqn} changed"


@each_use_orig_params
@pytest.mark.parametrize("strategy", FLAT)
def test_mixed_unit_grads_match_ddp(strategy: str, use_orig_params: bool) -> None:
    """4 Adam steps: each unit's sharded gradient is its trainable parameters' (DDP's
    gradients, concatenated, padded, split), frozen parameters get none and stay unchanged."""
    run_on_ranks(2, _grads_match_ddp, strategy, use_orig_params, False)


@each_use_orig_params
@pytest.mark.parametrize("strategy", HYBRID)
def test_mixed_unit_grads_match_ddp_hybrid(strategy: str, use_orig_params: bool) -> None:
    """The same on 4 ranks, 2 shards x 2 replicas: the replicas all-reduce trainable shards."""
    run_on_ranks(4, _grads_match_ddp, strategy, use_orig_params, False, env=HYBRID_ENV, timeout=240)


@each_use_orig_params
def test_mixed_unit_grads_match_ddp_with_cpu_offload(use_orig_params: bool) -> None:
    """The same with the shards and gradients offloaded to the CPU."""
    run_on_ranks(2, _grads_match_ddp, "FULL_SHARD", use_orig_params, True)


# ----------------------------------------------------------------------------------------
# Gradient memory, reduction bytes and optimizer state cover only trainable parameters


def _expected_reduction_bytes(strategy: str, trainable: list[int]) -> dict[str, float]:
    """Bytes one rank sends to reduce the units' gradients of ``trainable`` elements."""
    num_ranks = dist.get_world_size()
    if strategy == "NO_SHARD":
        return {"all_reduce": sum(2 * t * BYTES * (num_ranks - 1) / num_ranks for t in trainable)}
    shards = 2 if strategy in HYBRID else num_ranks
    replicas = num_ranks // shards
    padded = [-(-t // shards) * shards for t in trainable]
    sent = {"reduce_scatter": sum(p * BYTES * (shards - 1) / shards for p in padded)}
    if replicas > 1:
        shard_bytes = sum(p // shards * BYTES for p in padded)
        sent["all_reduce"] = 2 * shard_bytes * (replicas - 1) / replicas
    return sent


def _gradient_memory(strategy: str, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = LoRAStack()
    numel_of = {id(p): p.numel() for p in model.parameters()}
    fsdp = _wrap(model, strategy, use_orig_params)
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    units = _units(fsdp)
    trainable = [_trainable_numel(unit, numel_of) for unit in units]
    with fsdp.no_sync():  # the unsharded gradients stay on the leaves
        fsdp(_input(rank, 0)).sum().backward()
    for unit, count in zip(units, trainable):
        handle = unit._handle
        assert handle is not None
        unsharded = handle._unsharded_flat_param.grad
        assert unsharded is not None and unsharded.numel() == count, (handle.label, unsharded)
    COUNTERS.reset()
    fsdp(_input(rank, 1)).sum().backward()
    sent = {kind: COUNTERS.bytes_sent.get(kind, 0.0) for kind in ("reduce_scatter", "all_reduce")}
    expected = {
        "reduce_scatter": 0.0,
        "all_reduce": 0.0,
        **_expected_reduction_bytes(strategy, trainable),
    }
    assert sent == pytest.approx(expected), (sent, expected)
    for unit, count in zip(units, trainable):
        handle = unit._handle
        assert handle is not None
        shard = _expected_shard(unit, [torch.zeros(count)])
        assert handle.flat_param.grad is not None
        assert handle.flat_param.grad.numel() == shard.numel(), handle.label
        if use_orig_params:
            grads = [p.grad for p in handle.orig_params if p.grad is not None]
            assert sum(g.numel() for g in grads) == _real_elements_on_rank(unit, count)
    optim.step()
    _check_optimizer_state(optim, units, trainable, use_orig_params)


def _check_optimizer_state(
    optim: torch.optim.Optimizer,
    units: list[FSDP],
    trainable: list[int],
    use_orig_params: bool,
) -> None:
    """Adam's state exists for trainable elements only (the shard's padding included with
    use_orig_params=False, where the optimizer steps the flat parameter)."""
    state_numel = 0
    for param, state in optim.state.items():
        assert param.requires_grad, f"state for a frozen parameter of shape {param.shape}"
        state_numel += state["exp_avg"].numel()
    if use_orig_params:
        expected = sum(_real_elements_on_rank(u, t) for u, t in zip(units, trainable))
    else:
        expected = sum(
            _expected_shard(u, [torch.zeros(t)]).numel() for u, t in zip(units, trainable)
        )
    assert state_numel == expected, (state_numel, expected)


@each_use_orig_params
@pytest.mark.parametrize("strategy", FLAT)
def test_gradient_bytes_cover_only_trainable_params(strategy: str, use_orig_params: bool) -> None:
    """The unsharded gradient autograd accumulates, the sharded ``.grad``, the bytes the
    reduction sends and Adam's state all cover the trainable elements only."""
    run_on_ranks(2, _gradient_memory, strategy, use_orig_params)


@each_use_orig_params
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_gradient_bytes_cover_only_trainable_params_three_ranks(
    strategy: str, use_orig_params: bool
) -> None:
    """The same on 3 ranks, where the trainable segments need padding of their own."""
    run_on_ranks(3, _gradient_memory, strategy, use_orig_params)


@each_use_orig_params
@pytest.mark.parametrize("strategy", HYBRID)
def test_gradient_bytes_cover_only_trainable_params_hybrid(
    strategy: str, use_orig_params: bool
) -> None:
    """The same for hybrid strategies: reduce-scatter in pairs, all-reduce across them."""
    run_on_ranks(4, _gradient_memory, strategy, use_orig_params, env=HYBRID_ENV, timeout=240)


# ----------------------------------------------------------------------------------------
# State dicts, optimizer state dicts, checkpoints


def _trainable_by_unit(fsdp: FSDP) -> dict[str, int]:
    """Per unit label (after lazy initialisation), its trainable elements in LoRAStack."""
    labels = [unit._handle.label for unit in _units(fsdp) if unit._handle is not None]
    counts = dict.fromkeys(labels, 0)
    with torch.random.fork_rng():
        plain = LoRAStack()
    for fqn, param in plain.named_parameters():
        if param.requires_grad:
            owner = next((label for label in labels if fqn.startswith(label + ".")), "(root)")
            counts[owner] += param.numel()
    return counts


def _assert_trainable_only_grads(fsdp: FSDP, counts: dict[str, int]) -> None:
    """Each unit's sharded gradient is its trainable elements' shard; frozen ones have none."""
    for unit in _units(fsdp):
        handle = unit._handle
        assert handle is not None and handle.flat_param.grad is not None, unit
        expected = _expected_shard(unit, [torch.zeros(counts[handle.label])])
        assert handle.flat_param.grad.numel() == expected.numel(), handle.label
        assert all(p.grad is None for p in handle.orig_params if not p.requires_grad)


def _train(fsdp: FSDP, optim: torch.optim.Optimizer, steps: range) -> None:
    """Adam steps on rank-dependent inputs, checking every step's gradients are the
    trainable parameters' only."""
    rank = dist.get_rank()
    for step in steps:
        fsdp(_input(rank, step)).pow(2).mean().backward()
        _assert_trainable_only_grads(fsdp, _trainable_by_unit(fsdp))
        optim.step()
        optim.zero_grad(set_to_none=True)


def _assert_same_full_values(resumed: FSDP, original: FSDP) -> None:
    """Every full parameter of ``resumed`` equals ``original``'s, bit for bit."""
    resumed_values, original_values = _full_values(resumed), _full_values(original)
    for fqn, value in original_values.items():
        torch.testing.assert_close(resumed_values[fqn], value, rtol=0, atol=0, msg=fqn)


def _full_values(fsdp: FSDP) -> dict[str, Tensor]:
    with FSDP.summon_full_params(fsdp):
        return {fqn: p.detach().clone() for fqn, p in fsdp.named_parameters()}


def _zero_params(fsdp: FSDP) -> None:
    """Zero every parameter, frozen ones included (summon's writeback into each segment)."""
    with FSDP.summon_full_params(fsdp), torch.no_grad():
        for param in fsdp.parameters():
            param.zero_()


_CONFIGS: dict[StateDictType, Any] = {
    StateDictType.FULL_STATE_DICT: FullStateDictConfig(),
    StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig(),
    StateDictType.LOCAL_STATE_DICT: None,
}


def _state_dict_round_trip(
    state_dict_type: StateDictType, strategy: str, use_orig_params: bool
) -> None:
    plain = LoRAStack()
    fsdp = _wrap(copy.deepcopy(plain), strategy, use_orig_params)
    _train(fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-2), range(2))
    expected = _full_values(fsdp)
    assert list(expected) == [fqn for fqn, _ in plain.named_parameters()]
    for fqn, param in plain.named_parameters():
        unchanged = torch.equal(expected[fqn], param.detach())
        assert unchanged == (not param.requires_grad), f"{fqn}: frozen iff unchanged"
    with FSDP.state_dict_type(fsdp, state_dict_type, _CONFIGS[state_dict_type]):
        state_dict = fsdp.state_dict()
        if state_dict_type == StateDictType.LOCAL_STATE_DICT:
            flat_keys = sorted(k for k in state_dict if k.endswith("flat_param"))
            assert flat_keys == sorted(
                f"{path}{name}"
                for path in ("", "blocks.0.", "blocks.1.")
                for name in ("_flat_param", "_frozen_flat_param")
            ), flat_keys
            state_dict = {k: _cloned(v) for k, v in state_dict.items()}
        else:
            assert list(state_dict) == list(plain.state_dict()), list(state_dict)
        _zero_params(fsdp)
        result = fsdp.load_state_dict(state_dict)
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    actual = _full_values(fsdp)
    for fqn, value in expected.items():
        torch.testing.assert_close(actual[fqn], value, rtol=0, atol=0, msg=fqn)
    _train(fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-2), range(2, 3))  # still trains


def _cloned(value: Any) -> Any:
    """A LOCAL value's own copy: it shares the shard's storage, which zeroing would change."""
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return value.clone()
    return DTensor.from_local(
        value.to_local().clone(),
        value.device_mesh,
        value.placements,
        shape=value.shape,
        stride=value.stride(),
    )


@each_use_orig_params
@pytest.mark.parametrize("strategy", FLAT)
@pytest.mark.parametrize("state_dict_type", list(_CONFIGS), ids=lambda t: t.name)
def test_state_dict_round_trip_with_mixed_units(
    state_dict_type: StateDictType, strategy: str, use_orig_params: bool
) -> None:
    """Train, save, zero every parameter, load: all back exactly. FULL and SHARDED keys are
    the plain model's; LOCAL has each mixed unit's two flat shards."""
    run_on_ranks(2, _state_dict_round_trip, state_dict_type, strategy, use_orig_params)


def _adam_states(optim_state_dict: dict[str, Any]) -> dict[str, dict[str, Tensor]]:
    return {
        fqn: {key: value for key, value in state.items() if key != "step"}
        for fqn, state in optim_state_dict["state"].items()
    }


_OPTIM_CONFIGS: dict[str, tuple[StateDictType, Any, Any]] = {
    "FULL": (StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig()),
    "FULL_rank0_only": (
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(),
        FullOptimStateDictConfig(rank0_only=True),
    ),
    "SHARDED": (
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(),
    ),
}


def _optim_state_dict_round_trip(kind: str, use_orig_params: bool) -> None:
    """Adam's state dict names trainable parameters only, holds DDP's values, and loads into
    a fresh model whose next step then matches the original's (with rank0_only, rank 0
    alone holds it and broadcasts it on loading)."""
    rank = dist.get_rank()
    ref_model = LoRAStack()
    ref = DDP(ref_model)
    ref_optim = torch.optim.Adam([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", use_orig_params)
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    for step in range(2):
        ref_model.get_loss((x := _input(rank, step),), ref(x)).backward()
        ref_optim.step()
        ref_optim.zero_grad()
    _train(fsdp, optim, range(2))
    state_dict_type, config, optim_config = _OPTIM_CONFIGS[kind]
    with FSDP.state_dict_type(fsdp, state_dict_type, config, optim_config):
        model_state = fsdp.state_dict()
        osd = FSDP.optim_state_dict(fsdp, optim)
    if kind == "FULL_rank0_only" and rank != 0:
        assert osd == {}, osd
    else:
        trainable = [fqn for fqn, p in ref_model.named_parameters() if p.requires_grad]
        assert sorted(osd["state"]) == sorted(trainable), sorted(osd["state"])
        reference = {fqn: dict(ref_optim.state[p]) for fqn, p in ref_model.named_parameters()}
        for fqn, states in _adam_states(osd).items():
            for key, value in states.items():
                full = value.full_tensor() if kind == "SHARDED" else value  # type: ignore[union-attr]
                torch.testing.assert_close(full, reference[fqn][key], rtol=1e-5, atol=1e-7)
    fresh = _wrap(LoRAStack(seed=1), "FULL_SHARD", use_orig_params)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with FSDP.state_dict_type(fresh, state_dict_type, config, optim_config):
        fresh.load_state_dict(model_state)
        loadable = FSDP.optim_state_dict_to_load(fresh, fresh_optim, osd)
    fresh_optim.load_state_dict(loadable)
    _train(fsdp, optim, range(2, 3))
    _train(fresh, fresh_optim, range(2, 3))
    _assert_same_full_values(fresh, fsdp)


@each_use_orig_params
@pytest.mark.parametrize("kind", list(_OPTIM_CONFIGS))
def test_optim_state_dict_round_trip_with_mixed_units(kind: str, use_orig_params: bool) -> None:
    """FULL (also rank0_only) and SHARDED optimizer state dicts: keyed by the trainable
    parameters' FQNs, equal to DDP's Adam state, and a fresh model resumes from them exactly."""
    run_on_ranks(2, _optim_state_dict_round_trip, kind, use_orig_params)


def _rank0_only_full_state_dict(use_orig_params: bool) -> None:
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", use_orig_params)
    _train(fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-2), range(1))
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, FullStateDictConfig()):
        everywhere = fsdp.state_dict()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT, config):
        on_rank0 = fsdp.state_dict()
    if dist.get_rank() != 0:
        assert on_rank0 == {}
        return
    assert list(on_rank0) == list(everywhere)
    for key, value in everywhere.items():
        torch.testing.assert_close(on_rank0[key], value, rtol=0, atol=0, msg=key)


@each_use_orig_params
def test_rank0_only_full_state_dict_of_mixed_units(use_orig_params: bool) -> None:
    """rank0_only gathers each segment to rank 0: the same values as every rank's FULL dict."""
    run_on_ranks(2, _rank0_only_full_state_dict, use_orig_params)


def _checkpoint_resume(path: str, use_orig_params: bool) -> None:
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", use_orig_params)
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    _train(fsdp, optim, range(2))
    ckpt.save(path, fsdp, optim, step=2)
    fresh = _wrap(LoRAStack(seed=1), "FULL_SHARD", use_orig_params)
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    assert ckpt.load(path, fresh, fresh_optim) == {"step": 2}
    _train(fsdp, optim, range(2, 4))
    _train(fresh, fresh_optim, range(2, 4))
    _assert_same_full_values(fresh, fsdp)


@each_use_orig_params
def test_checkpoint_resumes_mixed_units_exactly(tmp_path: Path, use_orig_params: bool) -> None:
    """fullshard.checkpoint save -> load into a model built from another seed -> two more
    steps: the same parameters as two uninterrupted steps."""
    run_on_ranks(2, _checkpoint_resume, str(tmp_path / "ckpt"), use_orig_params)


def _summon_with_grads() -> None:
    """use_orig_params=True: summon_full_params(with_grads=True) shows DDP's full gradients
    for trainable parameters and none for frozen ones."""
    rank = dist.get_rank()
    ref_model = LoRAStack()
    ref = DDP(ref_model)
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", True)
    x = _input(rank, 0)
    ref_model.get_loss((x,), ref(x)).backward()
    ref_model.get_loss((x,), fsdp(x)).backward()
    _assert_trainable_only_grads(fsdp, _trainable_by_unit(fsdp))
    ref_params = dict(ref_model.named_parameters())
    with FSDP.summon_full_params(fsdp, with_grads=True):
        for fqn, param in fsdp.named_parameters():
            expected = ref_params[fqn].grad
            if expected is None:
                assert param.grad is None, f"frozen {fqn} shows a gradient"
            else:
                torch.testing.assert_close(param.grad, expected, rtol=1e-5, atol=1e-7, msg=fqn)


def test_summon_full_params_with_grads_of_mixed_units() -> None:
    """Full gradients of the trainable parameters, none for the frozen ones."""
    run_on_ranks(2, _summon_with_grads)


# ----------------------------------------------------------------------------------------
# The memory model (fullshard.memory) against what a rank holds


def _model_state_bytes(strategy: str) -> dict[str, tuple[int, int]]:
    """Per kind, (measured, estimated) bytes of one rank's shards, gradients, Adam state and
    one step's sent bytes, for LoRAStack with its frozen base."""
    from fullshard.memory import communication_bytes, estimate

    rank = dist.get_rank()
    model = LoRAStack()
    numel_of = {id(p): p.numel() for p in model.parameters()}
    fsdp = _wrap(model, strategy, use_orig_params=False)
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    fsdp(_input(rank, 0)).sum().backward()
    optim.step()
    units = _units(fsdp)
    root, blocks = units[0], units[1:]
    assert root is fsdp
    sizes = [_numel(u, numel_of) for u in blocks]
    trainable = [_trainable_numel(u, numel_of) for u in blocks]
    kwargs: dict[str, Any] = {
        "root_numel": _numel(root, numel_of),
        "trainable_numels": trainable,
        "root_trainable_numel": _trainable_numel(root, numel_of),
    }
    predicted = estimate(sizes, dist.get_world_size(), strategy, **kwargs)
    COUNTERS.reset()
    fsdp(_input(rank, 1)).sum().backward()
    sent = communication_bytes(sizes, dist.get_world_size(), strategy, **kwargs)
    params = sum(p.numel() * p.element_size() for p in fsdp.parameters())
    grads = sum(p.grad.numel() * 4 for p in fsdp.parameters() if p.grad is not None)
    states = sum(s["exp_avg"].numel() * 4 * 2 for s in optim.state.values())
    return {
        "params": (params, predicted.params),
        "grads": (grads, predicted.grads),
        "optimizer": (states, predicted.optimizer),
        "sent": (int(COUNTERS.total_bytes), sent),
    }


@pytest.mark.parametrize("strategy", FLAT)
def test_memory_model_counts_trainable_gradients(strategy: str) -> None:
    """fullshard.memory.estimate with trainable_numels gives the shards', gradients' and
    Adam state's bytes a rank holds exactly, and the bytes it sends within padding."""
    for kind, (measured, predicted) in run_on_ranks(2, _model_state_bytes, strategy)[0].items():
        if kind == "sent":  # the model's ring estimate ignores padding
            assert measured == pytest.approx(predicted, rel=0.02), kind
        else:
            assert measured == predicted, kind


# ----------------------------------------------------------------------------------------
# Precision: mixed precision, full-precision eval, a model converted after wrapping


def _mixed_precision_with_mixed_units(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    plain = LoRAStack()
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fsdp = _wrap(copy.deepcopy(plain), "FULL_SHARD", use_orig_params, mixed_precision=bf16)
    COUNTERS.reset()
    _train(fsdp, torch.optim.Adam(fsdp.parameters(), lr=1e-2), range(2))
    # Per step every segment is gathered in bf16 for forward and again for backward (the
    # root once: it keeps its parameters); all_gather counts bytes x (N - 1) / N.
    expected = 0
    for unit in _units(fsdp):
        assert unit._handle is not None
        gathers = 1 if unit is fsdp else 2
        expected += sum(f.numel() * 2 * gathers for f in unit._handle.flat_params)
    num_ranks = dist.get_world_size()
    assert COUNTERS.bytes_sent["all_gather"] == 2 * expected * (num_ranks - 1)
    trained = _full_values(fsdp)
    for fqn, param in plain.named_parameters():
        assert trained[fqn].dtype == torch.float32, fqn
        if not param.requires_grad:
            assert torch.equal(trained[fqn], param.detach()), f"frozen {fqn} changed"
    plain.load_state_dict(trained)
    fsdp.eval()  # FSDP_USE_FULL_PREC_IN_EVAL=1: both segments gathered in float32
    with torch.no_grad():
        x = _input(rank, 9)
        torch.testing.assert_close(fsdp(x), plain(x), rtol=1e-6, atol=1e-6)


@each_use_orig_params
def test_mixed_precision_and_full_precision_eval_with_mixed_units(use_orig_params: bool) -> None:
    """bf16 compute: both segments all-gather bf16 bytes, sharded gradients stay
    trainable-only, frozen parameters unchanged; eval in full precision equals the fp32
    model."""
    env = {"FSDP_USE_FULL_PREC_IN_EVAL": "1"}
    run_on_ranks(2, _mixed_precision_with_mixed_units, use_orig_params, env=env)


def _converted_after_wrapping(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    plain = LoRAStack().double()
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", use_orig_params).double()
    for unit in _units(fsdp):
        assert unit._handle is not None
        assert [f.dtype for f in unit._handle.flat_params] == [torch.float64] * 2
    optim = torch.optim.Adam(fsdp.parameters(), lr=1e-2)
    counts: dict[str, int] | None = None
    for step in range(2):
        fsdp(_input(rank, step).double()).pow(2).mean().backward()
        counts = counts or _trainable_by_unit(fsdp)
        _assert_trainable_only_grads(fsdp, counts)
        optim.step()
        optim.zero_grad(set_to_none=True)
    trained = _full_values(fsdp)
    for fqn, param in plain.named_parameters():
        assert trained[fqn].dtype == torch.float64, fqn
        assert torch.equal(trained[fqn], param.detach()) == (not param.requires_grad), fqn


@each_use_orig_params
def test_model_converted_after_wrapping_keeps_both_segments(use_orig_params: bool) -> None:
    """``.double()`` after wrapping converts the trainable and the frozen segment; training
    then changes the adapters only."""
    run_on_ranks(2, _converted_after_wrapping, use_orig_params)


# ----------------------------------------------------------------------------------------
# Parameter memory in backward: units with frozen parameters reshard as their backward ends


def _unsharded_units_in_backward(use_orig_params: bool, frozen_blocks: bool) -> list[int]:
    """Per unit, in backward order, how many units hold unsharded parameters when its
    pre-backward hook has run (LoRAStack, 6 blocks; ``frozen_blocks``: every block fully
    frozen, so their units have no post-backward hook at all)."""
    torch.manual_seed(0)
    plain = LoRAStack(num_blocks=6)
    if frozen_blocks:
        for block in plain.blocks:
            block.requires_grad_(False)
    fsdp = _wrap(plain, "FULL_SHARD", use_orig_params)
    units = _units(fsdp)
    counts: list[int] = []

    def count(*_: Any) -> None:
        counts.append(sum(u._handle.state.name != "SHARDED" for u in units if u._handle))

    for _ in range(2):  # the second step: after lazy initialisation and a first backward
        counts.clear()
        x = _input(dist.get_rank(), 0).requires_grad_(frozen_blocks)  # frozen: inputs need grad
        output = fsdp(x)
        for unit in units[1:]:  # the blocks' outputs, as their pre-backward hooks see them
            unit._runtime.pre_backward = _after(unit._runtime.pre_backward, count)
        fsdp._fsdp_wrapped_module.get_loss((x,), output).backward()
        for unit in units[1:]:
            del unit._runtime.pre_backward
        assert all(u._handle.state.name == "SHARDED" for u in units if u._handle)
    return counts


def _after(method: Any, then: Any) -> Any:
    def run() -> None:
        method()
        then()

    return run


@pytest.mark.parametrize("frozen_blocks", [False, True], ids=["lora", "frozen_blocks"])
@each_use_orig_params
def test_units_with_frozen_parameters_reshard_during_backward(
    use_orig_params: bool, frozen_blocks: bool
) -> None:
    """Units with frozen parameters reshard once their inputs' gradients are computed, not
    at the end of backward: at most the root, the unit computing, the unit just finished
    and the prefetched one are unsharded at a time (before: every unit by the end)."""
    for counts in run_on_ranks(2, _unsharded_units_in_backward, use_orig_params, frozen_blocks):
        assert len(counts) == 6, counts
        assert max(counts) <= 4, counts


class _TrunkHead(nn.Module):
    """A trunk and a head: the model users freeze part of (``model.trunk``) after wrapping."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = nn.Sequential(nn.Linear(7, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.trunk(x)))


def _set_requires_grad(trunk: nn.Module, requires_grad: bool) -> None:
    for param in trunk.parameters():  # FlatParameters, or the original parameters
        param.requires_grad = requires_grad


def _freeze_after_wrapping(strategy: str, use_orig_params: bool) -> None:
    """Train 6 SGD steps (momentum) with the trunk frozen after step 2 and unfrozen after
    step 4, all by setting requires_grad on the wrapped model; a local model doing the same
    on the same batch (every rank sees it, so FSDP's average is the local gradient) must
    end with the same parameters and the same gradients at every step."""
    local = _TrunkHead()
    model = _TrunkHead()
    kwargs: dict[str, Any] = {**strategy_kwargs(strategy), "use_orig_params": use_orig_params}
    model.trunk = FSDP(model.trunk, **kwargs)  # type: ignore[assignment]
    model.head = FSDP(model.head, **kwargs)  # type: ignore[assignment]
    fsdp = FSDP(model, **kwargs)
    schedule = {2: False, 4: True}  # step -> the trunk's requires_grad from that step on
    optims: list[torch.optim.Optimizer] = []
    for step in range(6):
        if step in schedule:
            _set_requires_grad(local.trunk, schedule[step])
            _set_requires_grad(model.trunk, schedule[step])
        if step == 2:  # built after freezing, over every parameter, as users do
            optims = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (local, fsdp)]
        x = _input(0, step)
        for m in (local, fsdp):
            loss = (m(x) ** 2).sum()
            loss.backward()
        trunk_grads = [p.grad for p in model.trunk.parameters()]
        if step in (2, 3):
            assert all(g is None for g in trunk_grads), f"step {step}: a frozen trunk got grads"
        else:
            assert any(g is not None for g in trunk_grads), f"step {step}: no trunk grads"
        for optim in optims:
            optim.step()
            optim.zero_grad()
        if not optims:
            for m in (local, fsdp):
                m.zero_grad()
        with FSDP.summon_full_params(fsdp):
            for (name, mine), theirs in zip(fsdp.named_parameters(), local.parameters()):
                torch.testing.assert_close(mine, theirs, msg=f"step {step}: {name}")
                assert mine.requires_grad == theirs.requires_grad, f"step {step}: {name}"


@pytest.mark.parametrize("strategy", FLAT)
@each_use_orig_params
def test_freezing_after_wrapping_is_honoured(strategy: str, use_orig_params: bool) -> None:
    """``requires_grad`` set on a wrapped unit's parameters (its FlatParameter, or with
    use_orig_params the original ones) after wrapping freezes and unfreezes it from the next
    forward on, as on the plain model (before: ignored, the frozen trunk kept training)."""
    run_on_ranks(2, _freeze_after_wrapping, strategy, use_orig_params)


@pytest.mark.parametrize("strategy", HYBRID)
@each_use_orig_params
def test_freezing_after_wrapping_is_honoured_hybrid(strategy: str, use_orig_params: bool) -> None:
    """As above, sharded over pairs of 4 ranks and replicated across the pairs."""
    run_on_ranks(4, _freeze_after_wrapping, strategy, use_orig_params, env=HYBRID_ENV, timeout=240)


def _freeze_one_original_parameter() -> None:
    """use_orig_params: freezing one parameter of a unit that keeps training leaves it with
    no gradient and unchanged by the optimizer, as on the plain model."""
    local = _TrunkHead()
    fsdp = FSDP(_TrunkHead(), use_orig_params=True)
    fsdp.module.trunk[0].bias.requires_grad_(False)
    local.trunk[0].bias.requires_grad_(False)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (local, fsdp)]
    for step in range(2):
        for m, optim in zip((local, fsdp), optims):
            (m(_input(0, step)) ** 2).sum().backward()
            optim.step()
        assert fsdp.module.trunk[0].bias.grad is None
        for optim in optims:
            optim.zero_grad()
    with FSDP.summon_full_params(fsdp):
        for (name, mine), theirs in zip(fsdp.named_parameters(), local.parameters()):
            torch.testing.assert_close(mine, theirs, msg=name)


def test_freezing_one_original_parameter_after_wrapping() -> None:
    """One frozen parameter inside a trainable unit (use_orig_params): no gradient, no update."""
    run_on_ranks(2, _freeze_one_original_parameter)


def _unfreeze_frozen_segment(use_orig_params: bool) -> str:
    fsdp = _wrap(LoRAStack(), "FULL_SHARD", use_orig_params)
    x = _input(dist.get_rank(), 0)
    fsdp(x).sum().backward()  # one step as wrapped
    for param in fsdp.parameters():
        param.requires_grad_(True)
    with pytest.raises(RuntimeError, match="now require") as error:
        fsdp(x)
    return str(error.value)


@each_use_orig_params
def test_unfreezing_a_frozen_segment_after_wrapping_raises(use_orig_params: bool) -> None:
    """The frozen parameters of a unit that mixed frozen and trainable ones at wrapping were
    flattened apart and have no gradient path: unfreezing them raises at the next forward,
    naming them, instead of silently never training them."""
    for message in run_on_ranks(2, _unfreeze_frozen_segment, use_orig_params):
        assert "Unfreeze them before wrapping" in message
        assert "FSDP unit" in message
        if use_orig_params:
            assert "inp.weight" in message, message
