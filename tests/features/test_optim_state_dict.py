"""Optimizer state dicts (issue 5), on gloo CPU ranks.

- Round trips: FULL and SHARDED x strategy x use_orig_params x Adam / AdamW / SGD with
  momentum, with two param groups and a third whose parameters never got a gradient (no
  state): save, replace the optimizer and zero the model, load, and the optimizer's own state
  dict is back exactly; the next step equals the uninterrupted one.
- FULL equals what DDP's optimizer holds for the unwrapped model, keyed by FQN; it loads
  into a plain model's optimizer (``rekey_optim_state_dict``) and into torch's FSDP, and
  torch FSDP's loads into fullshard.
- The legacy functions (full / sharded / shard / scatter / flatten / rekey) and errors.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import (
    FlatParameter,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    OptimStateKeyType,
    ShardingStrategy,
    StateDictType,
)
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import STRATEGIES, TransformerWithSharedParams, transformer_layer_classes

OPTIMIZERS = ["adam", "adamw", "sgd"]


def _wrap(strategy: ShardingStrategy, use_orig_params: bool, seed: int = 0) -> FSDP:
    return FSDP(
        TransformerWithSharedParams(seed=seed),
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy(transformer_layer_classes()),
    )


def _optimizer(
    name: str, params: list[nn.Parameter], no_state_group: bool = True
) -> torch.optim.Optimizer:
    """Two param groups with different hyperparameters and, with ``no_state_group``, a third
    (the last parameter) that ``_step`` never gives a gradient, so it has no state."""
    last = -1 if no_state_group else len(params)
    groups: list[dict[str, Any]] = [
        {"params": params[0:last:2]},
        {"params": params[1:last:2], "lr": 0.003},
    ]
    if no_state_group:
        groups.append({"params": params[-1:]})
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(groups, lr=0.01, momentum=0.9)


def _step(model: nn.Module, optim: torch.optim.Optimizer, rank: int, step: int) -> float:
    inner = model.module if isinstance(model, (FSDP, DDP)) else model
    src, tgt = inner.get_input("cpu", rank=rank, step=step)
    loss = model(src, tgt).sum()
    loss.backward()
    for group in optim.param_groups[2:]:
        for param in group["params"]:
            param.grad = None  # this group never steps: its parameters have no state
    optim.step()
    optim.zero_grad()
    return loss.item()


def _local_state(optim: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(optim.state_dict())


def _assert_same_local_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["state"].keys() == expected["state"].keys()
    for param_id, state in expected["state"].items():
        assert actual["state"][param_id].keys() == state.keys(), param_id
        for key, value in state.items():
            got = actual["state"][param_id][key]
            torch.testing.assert_close(got, value, rtol=0, atol=0, msg=f"{param_id}.{key}")


def _round_trip(
    state_dict_type: StateDictType, strategy: ShardingStrategy, use_orig_params: bool, name: str
) -> None:
    rank = dist.get_rank()
    model = _wrap(strategy, use_orig_params)
    optim = _optimizer(name, list(model.parameters()))
    for step in range(2):
        _step(model, optim, rank, step)
    expected = _local_state(optim)
    with FSDP.state_dict_type(model, state_dict_type):
        model_state = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    if state_dict_type == StateDictType.SHARDED_STATE_DICT:
        tensors = [v for s in osd["state"].values() for v in s.values() if torch.is_tensor(v)]
        assert any(isinstance(v, DTensor) for v in tensors)
    # Keyed by FQN, no wrapper prefixes; the never-stepped parameter has no state.
    assert all(isinstance(k, str) and "_fsdp_wrapped_module" not in k for k in osd["state"])
    assert len(osd["param_groups"]) == 3
    assert not set(osd["param_groups"][2]["params"]) & set(osd["state"])
    # A fresh optimizer (no state), a zeroed model, then load both.
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    optim = _optimizer(name, list(model.parameters()))
    with FSDP.state_dict_type(model, state_dict_type):
        model.load_state_dict(model_state)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
    _assert_same_local_state(_local_state(optim), expected)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize(
    "state_dict_type",
    [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT],
    ids=lambda t: t.name,
)
def test_optim_round_trip(
    state_dict_type: StateDictType, strategy: ShardingStrategy, use_orig_params: bool, name: str
) -> None:
    """save -> fresh optimizer, zeroed model -> load: the optimizer's state is back exactly."""
    run_on_ranks(2, _round_trip, state_dict_type, strategy, use_orig_params, name)


def _any_key_order(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _optimizer("adam", list(model.parameters()))
    _step(model, optim, rank, 0)
    expected = _local_state(optim)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        osd = FSDP.optim_state_dict(model, optim)
        if rank == 1:  # as a dict built from sets of FQNs may come, on one rank only
            osd["state"] = dict(reversed(osd["state"].items()))
        optim = _optimizer("adam", list(model.parameters()))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
    _assert_same_local_state(_local_state(optim), expected)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_optim_state_dict_loads_whatever_its_order_on_each_rank(
    use_orig_params: bool,
) -> None:
    """A SHARDED optimizer state dict whose FQNs come in another order on one rank loads
    right: its DTensors are gathered in the optimizer's order, the same on every rank."""
    run_on_ranks(2, _any_key_order, use_orig_params)


def _hybrid_round_trip(state_dict_type: StateDictType) -> None:
    _round_trip(state_dict_type, ShardingStrategy.HYBRID_SHARD, True, "adam")


@pytest.mark.parametrize(
    "state_dict_type",
    [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT],
    ids=lambda t: t.name,
)
def test_optim_round_trip_hybrid(state_dict_type: StateDictType) -> None:
    """HYBRID_SHARD on 4 ranks (2 shard x 2 replicate): round trip of Adam's state."""
    run_on_ranks(4, _hybrid_round_trip, state_dict_type)


def _full_matches_ddp(use_orig_params: bool, name: str) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    plain = TransformerWithSharedParams(seed=0)
    ddp = DDP(copy.deepcopy(plain))
    optim = _by_name_optimizer(name, model)
    ddp_optim = _by_name_optimizer(name, ddp, single_group=not use_orig_params)
    for step in range(3):
        _step(model, optim, rank, step)
        _step(ddp, ddp_optim, rank, step)
    osd = FSDP.optim_state_dict(model, optim)  # FULL by default
    expected = FSDP.rekey_optim_state_dict(
        ddp_optim.state_dict(), OptimStateKeyType.PARAM_NAME, ddp.module, optim=ddp_optim
    )
    assert sorted(osd["state"]) == sorted(expected["state"])
    for fqn, state in expected["state"].items():
        assert list(osd["state"][fqn]) == list(state), fqn
        for key, value in state.items():
            torch.testing.assert_close(osd["state"][fqn][key], value, msg=f"{fqn}.{key}")
    for ours, theirs in zip(osd["param_groups"], expected["param_groups"], strict=True):
        assert sorted(ours["params"]) == sorted(theirs["params"])
        assert {**ours, "params": None} == {**theirs, "params": None}
    # The full dict loads into a plain model's optimizer through rekeying to ids.
    plain_optim = _by_name_optimizer(name, plain, single_group=not use_orig_params)
    plain_optim.load_state_dict(
        FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_ID, plain, optim=plain_optim)
    )
    _assert_close_local_state(plain_optim.state_dict(), ddp_optim.state_dict())


def _by_name_optimizer(
    name: str, model: nn.Module, single_group: bool = False
) -> torch.optim.Optimizer:
    """Biases in a second group (by name, so the same parameters in every engine); one group
    where the optimizer sees flat parameters."""
    named = list(model.named_parameters())
    groups: list[dict[str, Any]] = [
        {"params": [p for n, p in named if not n.endswith("bias")]},
        {"params": [p for n, p in named if n.endswith("bias")], "lr": 0.003},
    ]
    if single_group or any(isinstance(p, FlatParameter) for _, p in named):
        groups = [{"params": [p for _, p in named]}]
    if name == "adam":
        return torch.optim.Adam(groups, lr=0.01)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=0.01, weight_decay=0.1)
    return torch.optim.SGD(groups, lr=0.01, momentum=0.9)


def _assert_close_local_state(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for param_id, state in expected["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(actual["state"][param_id][key], value)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_optim_state_dict_matches_ddp(use_orig_params: bool, name: str) -> None:
    """FULL: per original parameter what DDP's optimizer holds (same FQNs, keys, values),
    and it loads into a plain model's optimizer after rekey_optim_state_dict."""
    run_on_ranks(2, _full_matches_ddp, use_orig_params, name)


def _torch_fsdp_interop(use_orig_params: bool, theirs_orig: bool) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    rank = dist.get_rank()
    ours = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params, seed=5)
    optim = _by_name_optimizer("adam", ours, single_group=True)
    for step in range(2):
        _step(ours, optim, rank, step)
    our_model_state = ours.state_dict()  # FULL by default
    our_osd = FSDP.optim_state_dict(ours, optim)
    theirs = TorchFSDP(
        TransformerWithSharedParams(seed=6),
        auto_wrap_policy=TorchModuleWrapPolicy(transformer_layer_classes()),
        use_orig_params=theirs_orig,
        device_id=torch.device("cpu"),
    )
    their_optim = _by_name_optimizer("adam", theirs, single_group=True)
    # fullshard -> torch FSDP (FULL_STATE_DICT is torch's default type too).
    theirs.load_state_dict(our_model_state)
    their_optim.load_state_dict(TorchFSDP.optim_state_dict_to_load(theirs, their_optim, our_osd))
    if not theirs_orig:  # torch gives it back unchanged
        _assert_same_named(TorchFSDP.optim_state_dict(theirs, their_optim), our_osd)
    _step(ours, optim, rank, 2)  # the loaded state is right: both take the same step
    _step(theirs, their_optim, rank, 2)
    with FSDP.summon_full_params(ours):
        our_params = {name: p.detach().clone() for name, p in ours.named_parameters()}
    their_params = theirs.state_dict()
    for name, value in our_params.items():
        torch.testing.assert_close(their_params[name], value, msg=name)
    # torch FSDP -> fullshard: fullshard loads exactly what torch's dicts hold.
    their_osd = TorchFSDP.optim_state_dict(theirs, their_optim)
    fresh = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params, seed=7)
    fresh_optim = _by_name_optimizer("adam", fresh, single_group=True)
    fresh.load_state_dict(theirs.state_dict())
    fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, their_osd))
    _assert_same_named(FSDP.optim_state_dict(fresh, fresh_optim), their_osd)
    if theirs_orig:
        # torch 2.13's FSDP with use_orig_params=True saves each Adam exp_avg wrong (it holds
        # exp_avg_sq; compared with DDP on these ranks), so its next step and ours differ.
        return
    _step(theirs, their_optim, rank, 3)  # both continue alike
    _step(fresh, fresh_optim, rank, 3)
    their_params = theirs.state_dict()
    with FSDP.summon_full_params(fresh):
        for name, param in fresh.named_parameters():
            torch.testing.assert_close(param, their_params[name], msg=name)


def _assert_same_named(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert sorted(actual["state"]) == sorted(expected["state"])
    for fqn, state in expected["state"].items():
        assert sorted(actual["state"][fqn]) == sorted(state), fqn
        for key, value in state.items():
            torch.testing.assert_close(
                actual["state"][fqn][key], value, rtol=0, atol=0, msg=f"{fqn}.{key}"
            )


@pytest.mark.parametrize("theirs_orig", [False, True], ids=["torch-flat", "torch-orig"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_optim_state_dict_interoperates_with_torch_fsdp(
    use_orig_params: bool, theirs_orig: bool
) -> None:
    """fullshard's FULL model and optimizer state dicts load into torch's FSDP (which gives
    them back unchanged), and torch FSDP's load into fullshard (same state, same next step)."""
    run_on_ranks(2, _torch_fsdp_interop, use_orig_params, theirs_orig)


def _legacy_functions(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _optimizer("adam", list(model.parameters()))
    for step in range(2):
        _step(model, optim, rank, step)
    expected = _local_state(optim)
    full = FSDP.full_optim_state_dict(model, optim)  # rank0_only by default
    assert (full == {}) == (rank != 0)
    everywhere = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    assert all(v.device.type == "cpu" for s in everywhere["state"].values() for v in s.values())
    _assert_same_local_state(
        FSDP.shard_full_optim_state_dict(everywhere, model, optim=optim), expected
    )
    scattered = FSDP.scatter_full_optim_state_dict(full if rank == 0 else None, model, optim=optim)
    _assert_same_local_state(scattered, expected)
    sharded = FSDP.sharded_optim_state_dict(model, optim)
    _assert_same_local_state(FSDP.flatten_sharded_optim_state_dict(sharded, model, optim), expected)
    # FULL with rank0_only through optim_state_dict / optim_state_dict_to_load.
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(rank0_only=True),
        FullOptimStateDictConfig(rank0_only=True),
    ):
        osd = FSDP.optim_state_dict(model, optim)
        assert (osd == {}) == (rank != 0)
        fresh = _optimizer("adam", list(model.parameters()))
        FSDP.optim_state_dict_to_load(model, fresh, osd, load_directly=True)
    _assert_same_local_state(_local_state(fresh), expected)
    # LOCAL: the optimizer's own state dict, unchanged.
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = FSDP.optim_state_dict(model, optim)
        assert FSDP.optim_state_dict_to_load(model, optim, local) is local
    _assert_same_local_state(local, expected)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_legacy_optim_state_dict_functions(use_orig_params: bool) -> None:
    """full / scatter / shard / sharded / flatten and optim_state_dict with rank0_only give
    back the optimizer's exact state; LOCAL passes it through."""
    run_on_ranks(2, _legacy_functions, use_orig_params)


def _dcp_optim_reshard(path: str, save: bool, strategy: ShardingStrategy) -> None:
    rank = dist.get_rank()
    model = _wrap(strategy, use_orig_params=True)
    optim = _optimizer("adam", list(model.parameters()))
    if save:
        for step in range(2):
            _step(model, optim, rank, step)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            osd = FSDP.optim_state_dict(model, optim)
            dcp.save({"optim": osd}, checkpoint_id=path)
            full = FSDP.full_optim_state_dict(model, optim)
        if rank == 0:
            torch.save(full, f"{path}.expected.pt")
        return
    for step in range(2):  # some state to overwrite: DCP loads into existing tensors
        _step(model, optim, rank, 10 + step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        template = FSDP.optim_state_dict(model, optim)
        dcp.load({"optim": template}, checkpoint_id=path)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, template))
    full = FSDP.full_optim_state_dict(model, optim)
    if rank == 0:
        expected = torch.load(f"{path}.expected.pt", weights_only=True)
        _assert_same_named(full, expected)


@pytest.mark.parametrize("saved_on, loaded_on", [(2, 3), (3, 2)], ids=["2->3", "3->2"])
def test_sharded_optim_state_dict_reshards_with_dcp(
    saved_on: int, loaded_on: int, tmp_path: Any
) -> None:
    """SHARDED optimizer state saved with DCP on one world size loads on another."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(saved_on, _dcp_optim_reshard, path, True, ShardingStrategy.FULL_SHARD)
    run_on_ranks(loaded_on, _dcp_optim_reshard, path, False, ShardingStrategy.SHARD_GRAD_OP)


def _resume_into_new_optimizer(
    path: str, use_orig_params: bool, name: str, saved_after: int
) -> None:
    """Save after ``saved_after`` steps; resume as accelerate's FSDP1 ``load_state`` does:
    a new model and a new optimizer (no state yet), the SHARDED optimizer dict of that
    optimizer as DCP's load target, ``optim_state_dict_to_load``. The resumed steps equal the
    uninterrupted run's (torch's FSDP1 leaves the state empty here: its template has none)."""
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _optimizer(name, list(model.parameters()), no_state_group=False)
    for step in range(saved_after):
        _step(model, optim, rank, step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.save(saved, checkpoint_id=path)
    uninterrupted = [_step(model, optim, rank, step) for step in range(saved_after, 4)]

    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params, seed=1)
    optim = _optimizer(name, list(model.parameters()), no_state_group=False)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        target = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        assert not optim.state  # the template is built aside: the user's optimizer untouched
        dcp.load(target, checkpoint_id=path)
        model.load_state_dict(target["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, target["optim"]))
    resumed = [_step(model, optim, rank, step) for step in range(saved_after, 4)]
    assert resumed == uninterrupted, (resumed, uninterrupted)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_optim_state_loads_into_an_optimizer_that_has_not_stepped(
    use_orig_params: bool, name: str, tmp_path: Any
) -> None:
    run_on_ranks(2, _resume_into_new_optimizer, str(tmp_path / "a"), use_orig_params, name, 2)


def test_an_unstepped_optimizer_saved_and_resumed_trains_as_a_fresh_one(tmp_path: Any) -> None:
    """The template of an optimizer that has not stepped is its fresh state (Adam: zero
    moments at step 0), so a checkpoint saved before the first step resumes exactly."""
    run_on_ranks(2, _resume_into_new_optimizer, str(tmp_path / "a"), False, "adam", 0)


def _sharded_tensor_load(path: str, save: bool, use_orig_params: bool) -> None:
    """torch's documented FSDP1 sharded flow (Lightning's FSDP1 load): DCP saves the model's
    and the optimizer's SHARDED dicts; ``load_sharded_optimizer_state_dict`` reads the
    optimizer's back as ShardedTensors, which ``optim_state_dict_to_load`` takes."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict

    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _optimizer("adam", list(model.parameters()), no_state_group=False)
    if save:
        for step in range(2):
            _step(model, optim, rank, step)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state = {"model": model.state_dict(), "optimizer": FSDP.optim_state_dict(model, optim)}
            dcp.save(state, checkpoint_id=path)
        full = FSDP.full_optim_state_dict(model, optim)
        if rank == 0:
            torch.save(full, f"{path}.expected.pt")
        return
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        model_state = {"model": model.state_dict()}
        dcp.load(model_state, checkpoint_id=path)
        model.load_state_dict(model_state["model"])
        loaded = load_sharded_optimizer_state_dict(
            model_state_dict=model_state["model"],
            optimizer_key="optimizer",
            storage_reader=FileSystemReader(path),
        )
        osd = loaded["optimizer"]
        assert any(
            type(v).__name__ == "ShardedTensor" for s in osd["state"].values() for v in s.values()
        )
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, osd))
    full = FSDP.full_optim_state_dict(model, optim)
    if rank == 0:
        _assert_same_named(full, torch.load(f"{path}.expected.pt", weights_only=True))


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_sharded_tensor_optimizer_state_loads(use_orig_params: bool, tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _sharded_tensor_load, path, True, use_orig_params)
    run_on_ranks(3, _sharded_tensor_load, path, False, use_orig_params)


def _errors() -> None:
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=True)
    optim = _optimizer("adam", list(model.parameters()))
    _step(model, optim, dist.get_rank(), 0)
    osd = FSDP.optim_state_dict(model, optim)
    with pytest.raises(ValueError, match="rekey_optim_state_dict"):
        FSDP.optim_state_dict_to_load(model, optim, optim.state_dict())
    renamed = copy.deepcopy(osd)
    renamed["state"]["not.a.param"] = renamed["state"].pop("embed_tokens.weight")
    with pytest.raises(ValueError, match=r"state for \['not.a.param'\]"):
        FSDP.optim_state_dict_to_load(model, optim, renamed)
    reshaped = copy.deepcopy(osd)
    reshaped["state"]["output_proj.bias"]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"'exp_avg' of 'output_proj.bias' has shape \(3,\)"):
        FSDP.optim_state_dict_to_load(model, optim, reshaped)
    other = torch.optim.Adam([nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="not in the model"):
        FSDP.optim_state_dict(model, other)


def test_optim_state_dict_errors() -> None:
    """Id-keyed dicts, unknown names, wrong shapes and foreign optimizers get clear errors."""
    run_on_ranks(2, _errors)


def _foreign_parameter_on_one_rank() -> tuple[str, str]:
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=True)
    optim = _optimizer("adam", list(model.parameters()))
    _step(model, optim, dist.get_rank(), 0)
    osd = FSDP.optim_state_dict(model, optim)
    if dist.get_rank() == 1:
        optim.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="not in the model") as raised:
        FSDP.optim_state_dict(model, optim)
    with pytest.raises(ValueError, match="not in the model") as raised_in_load:
        FSDP.optim_state_dict_to_load(model, optim, osd)
    return str(raised.value), str(raised_in_load.value).replace("_to_load", "")


def test_an_optimizer_wrong_on_one_rank_raises_on_every_rank() -> None:
    """Only rank 1's optimizer holds a parameter outside the model: every rank raises,
    naming it, in ``optim_state_dict`` (rank 0 would otherwise wait in the metadata exchange
    until the timeout) and in ``optim_state_dict_to_load`` (rank 0 would load alone)."""
    messages = run_on_ranks(2, _foreign_parameter_on_one_rank)
    assert messages[0] == messages[1]
    for message in messages[0]:
        assert re.match(r"rank 1: optim_state_dict\(\): param group \d+ .* shape \(3,\)", message)


def _unshardable_state_on_one_rank() -> str:
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=True)
    optim = _optimizer("adam", list(model.parameters()))
    _step(model, optim, dist.get_rank(), 0)
    if dist.get_rank() == 1:
        held = next(p for p in model.parameters() if p.numel() > 1)
        optim.state[held]["exp_avg"] = torch.zeros(held.numel() + 1)
    with pytest.raises(ValueError, match="can only unshard states shaped like") as raised:
        FSDP.optim_state_dict(model, optim)
    return str(raised.value)


def test_a_state_unshardable_on_one_rank_raises_on_every_rank() -> None:
    """Only rank 1's optimizer holds a state not shaped like its parameter: every rank
    raises it, naming the rank (rank 0 would otherwise wait in the metadata exchange)."""
    messages = run_on_ranks(2, _unshardable_state_on_one_rank)
    assert messages[0] == messages[1]
    assert re.match(r"rank 1: optimizer state 'exp_avg' of .* has shape \(\d+,\)", messages[0])


def _steps_of_parameters_held_elsewhere() -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    # 13 elements, 7 per rank: rank 0 holds 7 of 0.weight's 8, rank 1 the rest
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 2), nn.Linear(2, 1)), use_orig_params=True)
    params = list(model.parameters())
    assert [p.numel() for p in params] == ([7, 0, 0, 0] if dist.get_rank() == 0 else [1, 2, 2, 1])

    def train(optim: torch.optim.Optimizer) -> None:
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
            model(torch.randn(4, 4, generator=generator)).pow(2).sum().backward()
            optim.step()
            optim.zero_grad()

    # Rank 0 holds none of the second layer: its optimizer has no state, and torch's
    # get_optimizer_state_dict steps it once with zero gradients (step 1) before reading it.
    second = torch.optim.Adam(params[2:], lr=0.01)
    train(second)
    full = get_optimizer_state_dict(model, second, options=StateDictOptions(full_state_dict=True))
    steps = {fqn: state["step"].item() for fqn, state in full["state"].items()}
    assert steps == {"1.weight": 3.0, "1.bias": 3.0}, steps
    # Both ranks hold parts of 0.weight: if they stepped it differently, an error, not a pick.
    every = torch.optim.Adam(params, lr=0.01)
    train(every)
    if dist.get_rank() == 1:
        every.state[params[0]]["step"] = torch.tensor(9.0)
    with pytest.raises(RuntimeError, match=r"Rank 1 has different values for step.*'0.weight'"):
        FSDP.optim_state_dict(model, every)
    # Non-tensor states likewise: the holders' value (rank 0 holds none of 0.bias), and an
    # error where holders disagree.
    every.state[params[0]]["step"] = torch.tensor(3.0)
    every.state[params[1]]["note"] = "stale" if dist.get_rank() == 0 else "fresh"
    full = FSDP.optim_state_dict(model, every)
    assert full["state"]["0.bias"]["note"] == "fresh", full["state"]["0.bias"]
    every.state[params[0]]["note"] = dist.get_rank()
    with pytest.raises(RuntimeError, match=r"Rank 1 has different values for note: 1\b"):
        FSDP.optim_state_dict(model, every)


def test_scalar_states_come_from_the_ranks_that_hold_the_parameter() -> None:
    """Under use_orig_params a rank holding none of a parameter's elements never steps it, so
    its Adam ``step`` there is whatever torch's ``get_optimizer_state_dict`` or a load left: the
    state dict takes the holders' (it gave rank 0 a step of 1 for the second layer, which rank
    1 had stepped 3 times), and non-tensor states likewise. Holders that disagree raise, as in
    torch."""
    run_on_ranks(2, _steps_of_parameters_held_elsewhere)


def _rank0_only_matches_everywhere(strategy: ShardingStrategy, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = _wrap(strategy, use_orig_params)
    optim = _optimizer("adam", list(model.parameters()))
    for step in range(2):
        _step(model, optim, rank, step)
    everywhere = {
        "model": model.state_dict(),
        "optim": FSDP.full_optim_state_dict(model, optim, rank0_only=False),
    }
    with FSDP.state_dict_type(
        model,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
        FullOptimStateDictConfig(rank0_only=True),
    ):
        on_rank0 = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
    if rank != 0:
        assert on_rank0 == {"model": {}, "optim": {}}
        return
    assert list(on_rank0["model"]) == list(everywhere["model"])
    for key, value in everywhere["model"].items():
        torch.testing.assert_close(on_rank0["model"][key], value, rtol=0, atol=0, msg=key)
    _assert_same_named(on_rank0["optim"], everywhere["optim"])
    assert on_rank0["optim"]["param_groups"] == everywhere["optim"]["param_groups"]


@pytest.mark.parametrize(
    "world_size, strategy, use_orig_params",
    [
        (2, ShardingStrategy.FULL_SHARD, False),
        (2, ShardingStrategy.NO_SHARD, True),
        (4, ShardingStrategy.HYBRID_SHARD, True),
    ],
    ids=["FULL_SHARD-2", "NO_SHARD-2", "HYBRID_SHARD-4"],
)
def test_rank0_only_full_state_dicts_match_everywhere_ones(
    world_size: int, strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """rank0_only (units gathered to rank 0 only) gives rank 0 the same model and optimizer
    state dicts as rank0_only=False, and the other ranks empty ones."""
    run_on_ranks(world_size, _rank0_only_matches_everywhere, strategy, use_orig_params)


def _reversed_on_rank1(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """Adam over ``params``, listed in reverse on rank 1 (the same parameters, another order)."""
    return torch.optim.Adam(params[::-1] if dist.get_rank() == 1 else params, lr=0.01)


def _different_optimizer_orders(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _reversed_on_rank1(list(model.parameters()))
    for step in range(2):
        _step(model, optim, rank, step)
    expected = _local_state(optim)
    full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sharded = FSDP.optim_state_dict(model, optim)
    # Both dicts iterate alike on every rank, in rank 0's optimizer's order.
    orders: list[Any] = [None, None]
    dist.all_gather_object(orders, (list(full["state"]), list(sharded["state"])))
    assert orders[0] == orders[1]
    assert orders[0][0] == orders[0][1]
    # So gathering the SHARDED dict's DTensors in its order pairs the same parameters.
    for fqn, state in sharded["state"].items():
        for key, value in state.items():
            got = value.full_tensor() if isinstance(value, DTensor) else value
            torch.testing.assert_close(got, full["state"][fqn][key], rtol=0, atol=0)
    # Loading walks the model's order, whatever each rank's optimizer's.
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        optim = _reversed_on_rank1(list(model.parameters()))
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, sharded))
    _assert_same_local_state(_local_state(optim), expected)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optimizers_holding_parameters_in_different_orders_per_rank(
    use_orig_params: bool,
) -> None:
    """Ranks whose optimizers list the same parameters in different orders: the FULL and
    SHARDED dicts are ordered as rank 0's optimizer on every rank (gathering the SHARDED one's
    DTensors key by key paired different parameters before), and both load back exactly."""
    run_on_ranks(2, _different_optimizer_orders, use_orig_params)


def _optimizer_missing_a_parameter_on_one_rank(use_orig_params: bool, short_rank: int) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    params = list(model.parameters())
    optim = torch.optim.Adam(params[:-1] if rank == short_rank else params, lr=0.01)
    _step(model, optim, rank, 0)
    expected = (
        "FSDP currently requires each rank to have at least the optimizer states needed by "
        "rank 0's optimizer but some ranks are missing some of those states: rank 1's"
        if short_rank == 1
        else "rank 1's optimizer holds FSDP-managed parameters"
    )
    for state_dict_type in [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT]:
        with FSDP.state_dict_type(model, state_dict_type), pytest.raises(RuntimeError) as info:
            FSDP.optim_state_dict(model, optim)
        assert str(info.value).startswith(expected), str(info.value)


@pytest.mark.parametrize("short_rank", [1, 0], ids=["rank1-short", "rank0-short"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_optimizers_holding_different_managed_parameters_raise(
    use_orig_params: bool, short_rank: int
) -> None:
    """One rank's optimizer leaves out a sharded parameter: every rank raises (torch's text
    where rank 1 lacks one of rank 0's), instead of gathering zeros for that rank's shard."""
    run_on_ranks(2, _optimizer_missing_a_parameter_on_one_rank, use_orig_params, short_rank)


class _TwoBlocks(nn.Module):
    """An unwrapped root holding a bias, over two blocks each wrapped as a unit."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block0 = nn.Sequential(nn.Linear(4, 6), nn.ReLU())
        self.block1 = nn.Sequential(nn.Linear(6, 3), nn.ReLU())
        self.bias = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block1(self.block0(x)) + self.bias

    @staticmethod
    def wrapped(use_orig_params: bool, unmanaged_in: str | None = None) -> tuple[nn.Module, Any]:
        """The model with its blocks wrapped; with ``unmanaged_in`` ("root" or "block1") a
        parameter the saved state dicts do not know, registered before wrapping."""
        model = _TwoBlocks()
        added = None
        if unmanaged_in is not None:
            added = nn.Parameter(torch.randn(5, 5))
            owner = model if unmanaged_in == "root" else model.block1[0]
            owner.register_parameter("unmanaged", added)
        model.block0 = FSDP(model.block0, use_orig_params=use_orig_params)
        model.block1 = FSDP(model.block1, use_orig_params=use_orig_params)
        return model, added


def _train_two_blocks(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.manual_seed(dist.get_rank())
    model(torch.randn(8, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def _unmanaged_parameters(use_orig_params: bool, state_dict_type: StateDictType) -> None:
    model, _ = _TwoBlocks.wrapped(use_orig_params)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _train_two_blocks(model, optim)
    with FSDP.state_dict_type(model, state_dict_type):
        osd = FSDP.optim_state_dict(model, optim)
    # A parameter outside every unit that the dict does not know: its id is left out of the
    # groups (as torch), so loading refuses until the caller adds its state.
    model, added = _TwoBlocks.wrapped(use_orig_params, unmanaged_in="root")
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    added_id = next(i for i, p in enumerate(optim.param_groups[0]["params"]) if p is added)
    with FSDP.state_dict_type(model, state_dict_type):
        to_load = FSDP.optim_state_dict_to_load(model, optim, osd)
    assert added_id not in to_load["param_groups"][0]["params"]
    assert len(to_load["param_groups"][0]["params"]) == len(optim.param_groups[0]["params"]) - 1
    with pytest.raises(ValueError, match="doesn't match the size of optimizer's group"):
        optim.load_state_dict(copy.deepcopy(to_load))
    to_load["state"][added_id] = {
        "step": torch.tensor(1.0),
        "exp_avg": torch.zeros(5, 5),
        "exp_avg_sq": torch.zeros(5, 5),
    }
    to_load["param_groups"][0]["params"] = sorted([*to_load["param_groups"][0]["params"], added_id])
    optim.load_state_dict(to_load)
    assert optim.state[added]["step"].item() == 1.0
    if use_orig_params:
        return
    # Inside a unit it shares a flat parameter with parameters that have a `step`: torch's
    # error, on every rank, before any collective.
    model, _ = _TwoBlocks.wrapped(use_orig_params, unmanaged_in="block1")
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    with (
        FSDP.state_dict_type(model, state_dict_type),
        pytest.raises(
            ValueError,
            match=r"^All unflattened parameters comprising a single flat parameter must have "
            r"scalar state with the same value and dtype, but state 'step' is missing for "
            r"\['block1.0.unmanaged'\]",
        ),
    ):
        FSDP.optim_state_dict_to_load(model, optim, osd)


@pytest.mark.parametrize(
    "state_dict_type",
    [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT],
    ids=lambda t: t.name,
)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_loading_into_a_model_with_parameters_the_state_dict_does_not_know(
    use_orig_params: bool, state_dict_type: StateDictType
) -> None:
    """A parameter added since saving: outside every unit its id is left out of the loaded
    groups (optim.load_state_dict refuses until its state is added, as torch); inside a unit
    sharing a flat parameter it raises torch's scalar-state error."""
    run_on_ranks(2, _unmanaged_parameters, use_orig_params, state_dict_type)


def _optim_input_deprecated() -> None:
    import warnings

    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=True)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optim, dist.get_rank(), 0)
    optim_input = list(model.parameters())  # the original parameters, as the optimizer's
    deprecated = r"The `optim_input` argument is deprecated and will be removed after PyTorch 1\.13"
    with pytest.warns(FutureWarning, match=deprecated):
        full = FSDP.full_optim_state_dict(model, optim, optim_input=optim_input, rank0_only=False)
    with pytest.warns(FutureWarning, match=deprecated):
        FSDP.shard_full_optim_state_dict(full, model, optim_input=optim_input)
    with pytest.warns(FutureWarning, match=deprecated):
        FSDP.scatter_full_optim_state_dict(
            full if dist.get_rank() == 0 else None, model, optim_input=optim_input
        )
    with pytest.warns(FutureWarning, match=deprecated):
        FSDP.rekey_optim_state_dict(
            full, OptimStateKeyType.PARAM_ID, model, optim_input=optim_input
        )
    with warnings.catch_warnings():  # without it: no warning
        warnings.simplefilter("error", FutureWarning)
        full_again = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
        FSDP.shard_full_optim_state_dict(full_again, model, optim=optim)
    assert full_again["param_groups"] == full["param_groups"]


def test_optim_input_is_deprecated_with_torchs_warning() -> None:
    """Every optimizer-state method taking ``optim_input`` warns as torch does when it is
    given (torch's test_optim_input_warning), and stays silent without it."""
    run_on_ranks(2, _optim_input_deprecated)


def _without_param_groups(use_orig_params: bool) -> None:
    rank = dist.get_rank()
    model = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    optim = _optimizer("adam", list(model.parameters()))
    _step(model, optim, rank, 0)
    original = copy.deepcopy(optim.state_dict())
    no_groups = copy.deepcopy(original)
    del no_groups["param_groups"]
    saved = FSDP.optim_state_dict(model, optim, optim_state_dict=no_groups)
    assert "param_groups" not in saved and saved["state"]  # torch's: the state, no groups
    _step(model, optim, rank, 1)  # the optimizer moves on
    to_load = FSDP.optim_state_dict_to_load(model, optim, saved)
    assert "param_groups" not in to_load
    to_load["param_groups"] = original["param_groups"]  # the caller adds them, as torch's test
    optim.load_state_dict(to_load)
    _assert_same_local_state(_local_state(optim), original)


@pytest.mark.parametrize("use_orig_params", [False, True], ids=["flat", "orig_params"])
def test_optim_state_dict_given_without_param_groups(use_orig_params: bool) -> None:
    """``FSDP.optim_state_dict(model, optim, optim_state_dict=<no param_groups>)`` returns
    the state without groups, and ``optim_state_dict_to_load`` turns it back into this
    rank's state, which loads once the groups are added (torch's
    test_optim_state_without_param_groups; before: KeyError 'param_groups')."""
    run_on_ranks(2, _without_param_groups, use_orig_params)
