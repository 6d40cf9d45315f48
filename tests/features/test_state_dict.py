"""Model state dicts (issue 5): FULL, SHARDED (DTensor, via torch.distributed.checkpoint) and
LOCAL, on gloo CPU ranks.

- Round trips for every state dict type x strategy x use_orig_params, on a model with nested
  units, shared (tied) parameters, buffers and an ignored-free layout: save, zero the model,
  load, and every parameter and buffer is back exactly.
- FULL: keys and values equal the unwrapped model's ``state_dict()``; it loads into the
  plain model; ``rank0_only`` leaves the other ranks empty.
- SHARDED: values are DTensors sharded on dim 0 over the unit's ranks; saved with DCP at one
  world size and loaded at another.
"""

from __future__ import annotations

import copy
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
)
from torch.distributed.tensor import DTensor, Shard

from fullshard import (
    FullStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import STRATEGIES, TransformerWithSharedParams, transformer_layer_classes

TYPES = [
    StateDictType.FULL_STATE_DICT,
    StateDictType.SHARDED_STATE_DICT,
    StateDictType.LOCAL_STATE_DICT,
]


def _wrap(
    strategy: ShardingStrategy, use_orig_params: bool, seed: int = 0
) -> tuple[FSDP, nn.Module]:
    plain = TransformerWithSharedParams(seed=seed)
    model = FSDP(
        copy.deepcopy(plain),
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy(transformer_layer_classes()),
    )
    return model, plain


def _full_values(model: FSDP) -> dict[str, torch.Tensor]:
    """Every parameter and buffer under its unwrapped name, full, cloned."""
    with FSDP.summon_full_params(model):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, buffer in model.named_buffers():
        values[name.replace("_fsdp_wrapped_module.", "")] = buffer.detach().clone()
    return values


def _perturb(model: FSDP) -> None:
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
    # New buffer tensors: the state dict holds the old ones, as nn.Module's does (no copy).
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = torch.full_like(buffer, -1)


def _train_step(model: FSDP, rank: int) -> None:
    src, tgt = model.module.get_input("cpu", rank=rank)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(src, tgt).sum().backward()
    optim.step()


def _round_trip(
    state_dict_type: StateDictType, strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    rank = dist.get_rank()
    model, _ = _wrap(strategy, use_orig_params)
    _train_step(model, rank)  # values differ from the initialisation
    expected = _full_values(model)
    with FSDP.state_dict_type(model, state_dict_type):
        state_dict = model.state_dict()
        if state_dict_type == StateDictType.LOCAL_STATE_DICT:
            # LOCAL values alias the shards (as nn.Module's alias parameters): keep copies.
            flat_keys = [k for k in state_dict if k.endswith("_flat_param")]
            assert flat_keys and not any("_fsdp_wrapped_module" in k for k in flat_keys)
            for key in flat_keys:
                value = state_dict[key]
                assert isinstance(value, DTensor)
                state_dict[key] = DTensor.from_local(
                    value.to_local().clone(),
                    value.device_mesh,
                    value.placements,
                    shape=value.shape,
                    stride=value.stride(),
                )
        _perturb(model)
        result = model.load_state_dict(state_dict)
    assert result.missing_keys == [] and result.unexpected_keys == [], result
    actual = _full_values(model)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)
    _train_step(model, rank)  # still trains after loading


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES, ids=lambda s: s.name)
@pytest.mark.parametrize("state_dict_type", TYPES, ids=lambda t: t.name)
def test_round_trip(
    state_dict_type: StateDictType, strategy: ShardingStrategy, use_orig_params: bool
) -> None:
    """save -> zero every parameter and buffer -> load: all back exactly."""
    run_on_ranks(2, _round_trip, state_dict_type, strategy, use_orig_params)


def _full_matches_plain(use_orig_params: bool, rank0_only: bool) -> None:
    rank = dist.get_rank()
    model, plain = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params)
    reference = plain.state_dict()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        state_dict = model.state_dict()
    if rank0_only and rank != 0:
        assert state_dict == {}
        return
    assert list(state_dict) == list(reference)  # same keys, same order
    for key, value in reference.items():
        torch.testing.assert_close(state_dict[key], value, rtol=0, atol=0, msg=key)
        assert state_dict[key].device.type == "cpu"
    # Tied weights are one tensor under both names, as nn.Module gives them.
    assert state_dict["output_proj.weight"] is state_dict["embed_tokens.weight"]
    fresh = TransformerWithSharedParams(seed=1)
    fresh.load_state_dict(state_dict)
    for key, value in fresh.state_dict().items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("rank0_only", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_is_the_plain_models(use_orig_params: bool, rank0_only: bool) -> None:
    """FULL keys, order and values equal the unwrapped model's; it loads into a plain model;
    with rank0_only the other ranks get an empty dict."""
    run_on_ranks(2, _full_matches_plain, use_orig_params, rank0_only)


def _sharded_values_are_dtensors() -> None:
    model, plain = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=False)
    reference = plain.state_dict()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, ShardedStateDictConfig()):
        state_dict = model.state_dict()
    assert list(state_dict) == list(reference)
    params = dict(plain.named_parameters(remove_duplicate=False))
    for key, value in state_dict.items():
        if key not in params:
            assert not isinstance(value, DTensor), key  # buffers are plain tensors
            continue
        assert isinstance(value, DTensor), key
        assert value.placements == (Shard(0),), key
        assert value.shape == reference[key].shape, key
        torch.testing.assert_close(value.full_tensor(), reference[key], rtol=0, atol=0)
        rows = reference[key].shape[0]
        chunk = -(-rows // 2)
        start = min(dist.get_rank() * chunk, rows)
        torch.testing.assert_close(value.to_local(), reference[key][start : start + chunk])


def test_sharded_state_dict_values_are_dim0_dtensors() -> None:
    """SHARDED: each parameter a DTensor with Shard(0) over the unit's ranks, holding this
    rank's rows; buffers plain."""
    run_on_ranks(2, _sharded_values_are_dtensors)


def _save_sharded(path: str, strategy: ShardingStrategy, use_orig_params: bool) -> None:
    model, _ = _wrap(strategy, use_orig_params, seed=3)
    _train_step(model, dist.get_rank())
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save(model.state_dict(), checkpoint_id=path)
    expected = _full_values(model)  # collective: every rank
    if dist.get_rank() == 0:
        torch.save(expected, f"{path}.expected.pt")


def _load_sharded(path: str, strategy: ShardingStrategy, use_orig_params: bool) -> None:
    model, _ = _wrap(strategy, use_orig_params, seed=4)  # different values to overwrite
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = model.state_dict()
        dcp.load(state_dict, checkpoint_id=path)
        model.load_state_dict(state_dict)
    expected: dict[str, Any] = torch.load(f"{path}.expected.pt", weights_only=True)
    actual = _full_values(model)
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize(
    "save_ranks, load_ranks, save_strategy, load_strategy, use_orig_params",
    [
        (2, 3, ShardingStrategy.FULL_SHARD, ShardingStrategy.FULL_SHARD, False),
        (3, 2, ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, True),
        (2, 1, ShardingStrategy.NO_SHARD, ShardingStrategy.FULL_SHARD, False),
    ],
)
def test_sharded_checkpoint_loads_at_another_world_size(
    tmp_path: Any,
    save_ranks: int,
    load_ranks: int,
    save_strategy: ShardingStrategy,
    load_strategy: ShardingStrategy,
    use_orig_params: bool,
) -> None:
    """DCP save of a SHARDED state dict at one world size (and strategy), load at another:
    every parameter and buffer equal to what was saved."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(save_ranks, _save_sharded, path, save_strategy, use_orig_params)
    run_on_ranks(load_ranks, _load_sharded, path, load_strategy, use_orig_params)


def _torch_fsdp_interop(use_orig_params: bool) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchStateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    rank = dist.get_rank()
    ours, _ = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params, seed=5)
    _train_step(ours, rank)
    theirs = TorchFSDP(
        TransformerWithSharedParams(seed=6),
        auto_wrap_policy=TorchModuleWrapPolicy(transformer_layer_classes()),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    with FSDP.state_dict_type(ours, StateDictType.FULL_STATE_DICT):
        our_state = ours.state_dict()
    with TorchFSDP.state_dict_type(theirs, TorchStateDictType.FULL_STATE_DICT):
        theirs.load_state_dict(our_state)  # fullshard -> torch FSDP
        their_state = theirs.state_dict()
    # Same keys. Ours are in the plain model's order (tested above); torch FSDP gives
    # output_proj.bias before output_proj.weight (the tied weight's second name).
    assert sorted(their_state) == sorted(our_state)
    for key, value in our_state.items():
        torch.testing.assert_close(their_state[key], value, rtol=0, atol=0, msg=key)
    fresh, _ = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params, seed=7)
    fresh.load_state_dict(their_state)  # torch FSDP -> fullshard
    expected = _full_values(ours)
    actual = _full_values(fresh)
    for name, value in expected.items():
        torch.testing.assert_close(actual[name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_full_state_dict_interoperates_with_torch_fsdp(use_orig_params: bool) -> None:
    """fullshard's FULL state dict loads into torch's FSDP (which gives back the same keys
    and values), and torch FSDP's loads into fullshard."""
    run_on_ranks(2, _torch_fsdp_interop, use_orig_params)


def _state_dict_type_api() -> None:
    model, _ = _wrap(ShardingStrategy.FULL_SHARD, use_orig_params=False)
    settings = FSDP.get_state_dict_type(model)
    assert settings.state_dict_type == StateDictType.FULL_STATE_DICT
    assert settings.state_dict_config == FullStateDictConfig()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        for unit in FSDP.fsdp_modules(model):
            assert unit._state_dict_type == StateDictType.SHARDED_STATE_DICT
        assert isinstance(FSDP.get_state_dict_type(model).state_dict_config, ShardedStateDictConfig)
    assert FSDP.get_state_dict_type(model) == settings  # restored on exit
    with pytest.raises(ValueError, match="Expected state_dict_config of type"):
        FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT, FullStateDictConfig())
    previous = FSDP.set_state_dict_type(model, StateDictType.LOCAL_STATE_DICT)
    assert previous == settings
    FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)
    # Strict loading names what is missing or unexpected with the unwrapped model's keys.
    state_dict = model.state_dict()
    del state_dict["transformer.encoder.layers.0.linear1.weight"]
    state_dict["not_a_key"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict(state_dict)
    message = str(info.value)
    assert "Missing key(s) in state_dict: 'transformer.encoder.layers.0.linear1.weight'" in message
    assert "Unexpected key(s) in state_dict: 'not_a_key'" in message
    assert "_fsdp_wrapped_module" not in message
    result = model.load_state_dict(state_dict, strict=False)
    assert result.missing_keys == ["transformer.encoder.layers.0.linear1.weight"]
    assert result.unexpected_keys == ["not_a_key"]
    # A wrong shape names the parameter.
    state_dict = model.state_dict()
    state_dict["embed_tokens.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"cannot load .embed_tokens.weight.*shape"):
        model.load_state_dict(state_dict)


def test_state_dict_type_api_and_errors() -> None:
    """get/set_state_dict_type and the context manager (restores on exit), config type
    checks, strict-loading errors with clean names, shape mismatches named."""
    run_on_ranks(2, _state_dict_type_api)


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale: torch.Tensor
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def _mixed_precision_full_state_dict() -> None:
    from fullshard import MixedPrecision

    plain = _WithBuffer()
    mp = MixedPrecision(param_dtype=torch.float16, buffer_dtype=torch.float16)
    model = FSDP(copy.deepcopy(plain), mixed_precision=mp)
    model(torch.randn(2, 4)).sum().backward()  # buffers now fp16 for compute
    assert model.module.scale.dtype == torch.float16
    state_dict = model.state_dict()
    for key, value in plain.state_dict().items():
        assert state_dict[key].dtype == torch.float32, key  # the model's own dtypes
        torch.testing.assert_close(state_dict[key], value, rtol=0, atol=0, msg=key)


def test_full_state_dict_under_mixed_precision_has_original_dtypes() -> None:
    """Parameters and buffers come out in their own (fp32) dtypes even after a forward cast
    the buffers to buffer_dtype and gathered the parameters in param_dtype."""
    run_on_ranks(2, _mixed_precision_full_state_dict)


def test_hybrid_round_trips_and_reshards_to_full_shard(tmp_path: Any) -> None:
    """HYBRID_SHARD on 4 ranks (2 shard x 2 replicate, LOCAL_WORLD_SIZE=2): FULL, SHARDED
    (DTensors on a 2-D replicate x shard mesh) and LOCAL round trips; a DCP save of the
    SHARDED state dict loads into FULL_SHARD on 2 ranks."""
    path = str(tmp_path / "ckpt")
    env = {"LOCAL_WORLD_SIZE": "2"}
    for state_dict_type in TYPES:
        run_on_ranks(
            4, _round_trip, state_dict_type, ShardingStrategy.HYBRID_SHARD, False, env=env,
            timeout=240,
        )  # fmt: skip
    run_on_ranks(4, _save_sharded, path, ShardingStrategy.HYBRID_SHARD, True, env=env, timeout=240)
    run_on_ranks(2, _load_sharded, path, ShardingStrategy.FULL_SHARD, True)


# -- activation checkpointing applied before wrapping --------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)  # buffers, and a state dict version in _metadata

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x)).relu()


class _BlockNet(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(3, 6)
        self.blocks = nn.Sequential(_Block(), _Block())
        self.out = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def _checkpointed_model(use_orig_params: bool, units: str) -> FSDP:
    """``_BlockNet`` with each block checkpointed, then wrapped: the blocks inside the
    wrappers are units (``units="blocks"``), the wrappers are, or only the root is; or
    (``"after"``) wrapped with block units first and checkpointed inside them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointWrapper,
        apply_activation_checkpointing,
    )

    def checkpoint(model: nn.Module) -> None:
        apply_activation_checkpointing(model, check_fn=lambda module: isinstance(module, _Block))

    model = _BlockNet(seed=0)
    if units != "after":
        checkpoint(model)
    classes = {"wrappers": {CheckpointWrapper}, "root": None}.get(units, {_Block})
    policy = ModuleWrapPolicy(classes) if classes else None
    wrapped = FSDP(model, use_orig_params=use_orig_params, auto_wrap_policy=policy)
    if units == "after":
        checkpoint(wrapped)
    return wrapped


def _checkpoint_wrapper_keys(use_orig_params: bool, units: str, path: str) -> None:
    import fullshard.checkpoint as ckpt

    model = _checkpointed_model(use_orig_params, units)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 3)).sum().backward()  # also moves the BatchNorm statistics
    optim.step()
    plain = _BlockNet(seed=1)
    full = model.state_dict()
    assert list(full) == list(plain.state_dict())  # the plain model's keys, in its order
    plain.load_state_dict(full)  # strict
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    for state_dict_type in (StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with FSDP.state_dict_type(model, state_dict_type):
            state_dict = model.state_dict()
            assert not [k for k in state_dict if "_checkpoint_wrapped_module" in k], state_dict
            model.load_state_dict(state_dict)
    _perturb(model)
    model.load_state_dict(full)  # back into the checkpointed, wrapped model
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, full[key], rtol=0, atol=0, msg=key)
    names = [name for name, _ in plain.named_parameters()]
    osd = FSDP.optim_state_dict(model, optim)
    assert sorted(osd["state"]) == sorted(names)
    assert sorted(fqn for group in osd["param_groups"] for fqn in group["params"]) == sorted(names)
    full_options = StateDictOptions(full_state_dict=True)  # torch's checkpoint API
    assert list(get_model_state_dict(model, options=full_options)) == list(full)
    torch_osd = get_optimizer_state_dict(model, optim, options=full_options)
    assert sorted(torch_osd["state"]) == sorted(names)
    ckpt.save(path, model, optim)
    metadata = ckpt.read_metadata(path)
    assert list(metadata["model"]) == sorted(full)  # fullshard.json keeps keys sorted
    assert sorted(metadata["optimizer_states"]) == sorted(names)


@pytest.mark.parametrize("units", ["blocks", "wrappers", "root", "after"])
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_state_dict_keys_strip_checkpoint_wrapper(
    use_orig_params: bool, units: str, tmp_path: Any
) -> None:
    """With activation checkpointing applied before wrapping (units inside the checkpoint
    wrappers, units of them, or one root unit) or after: FULL, SHARDED, LOCAL, optimizer,
    torch's checkpoint API and fullshard.checkpoint keys have no
    ``_checkpoint_wrapped_module.``; the FULL dict loads into the plain model and back into
    the checkpointed, wrapped one."""
    path = str(tmp_path / "ckpt")
    run_on_ranks(2, _checkpoint_wrapper_keys, use_orig_params, units, path)
