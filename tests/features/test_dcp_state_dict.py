"""torch's checkpoint API (``torch.distributed.checkpoint.state_dict``) on fullshard models,
on gloo CPU ranks: see [Note: torch's state-dict functions see fullshard's units].

Exact resume: 6 uninterrupted steps against 3 steps, ``get_state_dict`` + ``dcp.save``, a new
process group and a freshly built model (no forward yet), ``get_state_dict`` + ``dcp.load`` +
``set_state_dict``, 3 more steps. Every rank takes its rows of one global batch per step (12
rows: divisible by 2, 3 and 4), so the global loss is the same computation at any world size.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import REPO_ROOT, run_on_ranks

GLOBAL_BATCH = 12
FULL = StateDictOptions(full_state_dict=True)


def _plain(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 7), nn.ReLU(), nn.Linear(7, 3))


def _model(use_orig_params: bool, seed: int, group: Any = None) -> FSDP:
    return FSDP(
        _plain(seed),
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        process_group=group,
    )


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.Adam([{"params": params[:1], "lr": 0.02}, {"params": params[1:]}], lr=0.01)


def _train(model: FSDP, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """One step per global batch; returns the global (all-ranks mean) losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        inputs = torch.randn(GLOBAL_BATCH, 5, generator=generator)[rank * rows : (rank + 1) * rows]
        target = torch.randn(GLOBAL_BATCH, 3, generator=generator)[rank * rows : (rank + 1) * rows]
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _uninterrupted(use_orig_params: bool) -> list[float]:
    model = _model(use_orig_params, seed=0)
    return _train(model, _adam(model), range(6))


def _first_half(path: str, use_orig_params: bool) -> list[float]:
    model = _model(use_orig_params, seed=0)
    optim = _adam(model)
    losses = _train(model, optim, range(3))
    model_state, optim_state = get_state_dict(model, optim)
    for key, value in model_state.items():  # sharded: DTensors under the plain model's keys
        assert isinstance(value, DTensor), key
    assert sorted(optim_state["state"]) == sorted(_plain(0).state_dict())
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return losses


def _second_half(path: str, use_orig_params: bool) -> list[float]:
    group = dist.new_group(list(range(dist.get_world_size())))  # a new process group
    model = _model(use_orig_params, seed=1, group=group)  # other values, no forward yet
    optim = _adam(model)
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _train(model, optim, range(3, 6))


RESUMES = [(2, 2, False), (2, 2, True), (2, 3, False), (4, 2, True)]


@pytest.mark.parametrize(
    "saved_on, resumed_on, use_orig_params",
    RESUMES,
    ids=[f"{a}->{b}-orig{o}" for a, b, o in RESUMES],
)
def test_get_set_state_dict_resume_matches_uninterrupted_run(
    saved_on: int, resumed_on: int, use_orig_params: bool, tmp_path: Path
) -> None:
    """3 steps + get_state_dict + dcp.save, new group + fresh model + dcp.load +
    set_state_dict + 3 steps == 6 steps: bitwise at the same world size, within 1e-5
    relative across world sizes."""
    path = str(tmp_path / "ckpt")
    expected = run_on_ranks(saved_on, _uninterrupted, use_orig_params)[0]
    first = run_on_ranks(saved_on, _first_half, path, use_orig_params)[0]
    second = run_on_ranks(resumed_on, _second_half, path, use_orig_params, timeout=240)[0]
    assert first == expected[:3]
    if saved_on == resumed_on:
        assert second == expected[3:]
    else:
        torch.testing.assert_close(
            torch.tensor(second, dtype=torch.float64),
            torch.tensor(expected[3:], dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )


def _assert_equal(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor) and not isinstance(actual, DTensor), where
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected), where
        for key, value in expected.items():
            _assert_equal(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for index, value in enumerate(expected):
            _assert_equal(actual[index], value, f"{where}[{index}]")
    else:
        assert actual == expected, where


def _full_options(use_orig_params: bool) -> None:
    model = _model(use_orig_params, seed=0)
    optim = _adam(model)
    _train(model, optim, range(2))
    plain = _plain(0)
    # fullshard's own FULL dicts (tested against the plain model in test_state_dict.py and
    # test_optim_state_dict.py) are the reference.
    expected_model = model.state_dict()
    expected_optim = FSDP.optim_state_dict(model, optim)
    model_state = get_model_state_dict(model, options=FULL)
    optim_state = get_optimizer_state_dict(model, optim, options=FULL)
    assert list(model_state) == list(plain.state_dict())
    _assert_equal(model_state, expected_model)
    _assert_equal(optim_state, expected_optim)
    sharded = get_optimizer_state_dict(model, optim)  # the default: DTensors, same values
    for fqn, states in sharded["state"].items():
        for key, value in states.items():
            if isinstance(value, DTensor):
                value = value.full_tensor()
            _assert_equal(value, expected_optim["state"][fqn][key], f"{fqn}.{key}")
    offloaded = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    assert (offloaded == {}) == (dist.get_rank() != 0)
    # Full dicts load back, from every rank or broadcast from rank 0, into fresh models.
    # (set_state_dict would treat the other ranks' empty model dicts as "optimizer only".)
    for broadcast in (False, True):
        fresh = _model(use_orig_params, seed=1)
        fresh_optim = _adam(fresh)
        given = not broadcast or dist.get_rank() == 0
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        set_model_state_dict(fresh, model_state if given else {}, options=options)
        set_optimizer_state_dict(fresh, fresh_optim, optim_state if given else {}, options=options)
        _assert_equal(fresh.state_dict(), expected_model, f"broadcast={broadcast}")
        _assert_equal(FSDP.optim_state_dict(fresh, fresh_optim), expected_optim)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_options_give_the_plain_models_keys_and_values(
    use_orig_params: bool,
) -> None:
    """full_state_dict=True: model and optimizer dicts keyed like the plain model, full
    tensors equal to fullshard's FULL dicts (cpu_offload: on rank 0 only); the default
    sharded optimizer dict holds the same values; both load back (broadcast_from_rank0 too)."""
    run_on_ranks(2, _full_options, use_orig_params)


def _flattened_into_stepped_optimizer() -> None:
    model = _model(use_orig_params=True, seed=0)
    optim = _adam(model)
    _train(model, optim, range(1))  # a rank holding no piece of a bias has no state for it
    options = StateDictOptions(flatten_optimizer_state_dict=True)
    model_state, optim_state = get_state_dict(model, optim, options=options)
    with pytest.raises(ValueError, match="the ranks were given different sharded optimizer"):
        set_state_dict(
            model,
            optim,
            model_state_dict=model_state,
            optim_state_dict=optim_state,
            options=options,
        )
    fresh = _model(use_orig_params=True, seed=1)  # a fresh optimizer gets every state: fine
    fresh_optim = _adam(fresh)
    set_state_dict(
        fresh,
        fresh_optim,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )
    _assert_equal(fresh.state_dict(), model.state_dict())
    _assert_equal(FSDP.optim_state_dict(fresh, fresh_optim), FSDP.optim_state_dict(model, optim))


def test_flattened_optimizer_state_into_a_stepped_optimizer_is_refused() -> None:
    """flatten_optimizer_state_dict=True loaded into an optimizer that has stepped (ranks then
    pass different states, use_orig_params=True) raises on every rank instead of gathering
    mismatched DTensors; into a fresh optimizer it loads exactly."""
    run_on_ranks(2, _flattened_into_stepped_optimizer)


def _fsdp1_optimizer_functions_on_fully_shard() -> None:
    from fullshard import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Linear(5, 2))  # 5 rows: uneven over 2 ranks
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    optim.step()
    hint = "sharded by fully_shard .*get_optimizer_state_dict.*set_optimizer_state_dict"
    with pytest.raises(RuntimeError, match=hint):
        FSDP.optim_state_dict(model, optim)
    state = get_optimizer_state_dict(model, optim)  # what the error points to works
    assert set(state["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    full = {"state": {k: {n: _full(v) for n, v in s.items()} for k, s in state["state"].items()}}
    with pytest.raises(RuntimeError, match=hint):
        FSDP.optim_state_dict_to_load(model, optim, full)
    set_optimizer_state_dict(model, optim, state)


def _full(value: Any) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def test_fsdp1_optimizer_state_dicts_of_a_fully_shard_model_point_to_torchs_api() -> None:
    """``FSDP.optim_state_dict`` / ``optim_state_dict_to_load`` on a ``fully_shard`` model
    (torch fails with an AttributeError; before, fullshard failed inside DTensor on an
    uneven shard) raise an error naming ``get_optimizer_state_dict`` and
    ``set_optimizer_state_dict``, which save and load its state."""
    run_on_ranks(2, _fsdp1_optimizer_functions_on_fully_shard)


_IMPORT_ORDER = """
import sys, tempfile
import torch, torch.distributed as dist
from torch import nn
from fullshard import FullyShardedDataParallel as FSDP
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = FSDP(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)))
assert "torch.distributed.checkpoint.state_dict" not in sys.modules
import inspect
import torch.distributed.checkpoint.state_dict as dsd
from fullshard._features import dcp_state_dict as _dcp_state_dict
assert dsd.FSDP is _dcp_state_dict._AnyFSDP, dsd.FSDP
assert "def get_state_dict" in inspect.getsource(dsd)  # the wrapped loader still reads it
assert _dcp_state_dict._incompatibility(dsd) is None  # this torch's layout is the known one
print(sorted(dsd.get_model_state_dict(model)))
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
theirs = TorchFSDP(nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2)), device_id=torch.device("cpu"))
print(sorted(dsd.get_model_state_dict(theirs)))
mixed = nn.Sequential(FSDP(nn.Linear(2, 3)), TorchFSDP(nn.Linear(3, 2), device_id=torch.device("cpu")))
try:
    dsd.get_model_state_dict(mixed)
except ValueError as error:
    print(error)
dist.destroy_process_group()
"""


def test_torch_state_dict_module_imported_after_wrapping_sees_units() -> None:
    """torch's state-dict module imported after the first FSDP was built gets fullshard's
    look-ups from the import hook; torch's own FSDP models keep working with it; a model
    mixing both libraries' units is refused."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _IMPORT_ORDER],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    plain_keys = "['0.bias', '0.weight', '1.bias', '1.weight']"
    assert lines[:2] == [plain_keys, plain_keys], result.stdout
    assert "holds both fullshard and torch FSDP units" in lines[2], result.stdout
