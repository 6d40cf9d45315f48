"""User mistakes ("misuses") and the error fullshard gives for each; docs/misuse.md lists them.

Every case asserts the exception's exact type and a distinctive part of its message. Cases
run on 2 gloo ranks through ``harness.run_on_ranks`` and every rank makes the mistake, as
the ranks of a real job would. The exceptions are the ``fullshard`` command's cases, which
run it in a subprocess, and wrapping before ``init_process_group``, which runs in this
process. Checkpoint files are damaged here, between the ranks' save and load.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fullshard.checkpoint as ckpt
from fullshard import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedGradScaler,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import CustomPolicy, ModuleWrapPolicy, enable_wrap
from harness import REPO_ROOT, run_on_ranks

# ----------------------------------------------------------------------------------------
# Models and the helper every case runs through


def _mlp(out: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, out))


def _wrapped(out: int = 2, **kwargs: Any) -> FSDP:
    """One FSDP unit per Linear, under a root unit."""
    return FSDP(_mlp(out), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kwargs)


def _trained(**kwargs: Any) -> FSDP:
    """A wrapped model after one forward and backward (lazily initialised, with grads)."""
    model = _wrapped(**kwargs)
    model(torch.randn(2, 4)).sum().backward()
    return model


def _with_adam(**kwargs: Any) -> tuple[FSDP, torch.optim.Optimizer]:
    """A wrapped model and an Adam over it, after one step (so Adam has state)."""
    model = _trained(**kwargs)
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    optim.step()
    return model, optim


def _during_backward(model: FSDP, action: Callable[[], object]) -> None:
    """Run ``action`` from a gradient hook, while ``model``'s backward runs."""
    out = model(torch.randn(2, 4))

    def hook(grad: torch.Tensor) -> torch.Tensor:
        action()
        return grad

    out.register_hook(hook)
    out.sum().backward()


class _SummonsInForward(nn.Module):
    """Calls summon_full_params on its own FSDP wrapper from inside forward."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.wrapper: list[FSDP] = []  # a list: not registered as a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with FSDP.summon_full_params(self.wrapper[0]):
            pass
        return self.linear(x)


class _MetaWithoutReset(nn.Module):
    """A module built on the meta device that has no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(3, device="meta"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


Case = tuple[Callable[[], object], type[BaseException], str]
"""What to do, the exception type it raises (torch's, where torch raises one), and a literal
piece of its message."""


def _expect(table: str, case: str) -> str:
    """On each rank: run the case, check the exception's exact type and message."""
    action, error, fragment = TABLES[table][case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. "switching to NO_SHARD": not what is tested
        with pytest.raises(error, match=re.escape(fragment)) as info:
            action()
    # Exact type, or a fullshard error class whose direct bases are torch's type and ours.
    exact = type(info.value) is error or error in type(info.value).__bases__
    assert exact, f"{type(info.value).__name__}: {info.value}"
    return str(info.value)


def _run_case(table: str, case: str, env: dict[str, str] | None = None) -> None:
    messages = run_on_ranks(2, _expect, table, case, env=env)
    assert len(messages) == 2 and all(messages)


# ----------------------------------------------------------------------------------------
# 1. Wrong arguments to the constructor and the wrap policies


def _shared_with_nested_unit() -> None:
    model = _mlp()
    model[2] = nn.Linear(4, 4)
    model[2].weight = model[0].weight  # tied to a module that gets its own unit first
    model[0] = FSDP(model[0])
    FSDP(model)


def _ignored_fsdp_unit() -> None:
    model = _mlp()
    model[0] = FSDP(model[0])
    FSDP(model, ignored_modules=[model[0]])


def _mixed_dtypes() -> None:
    model = _mlp()
    model[2].double()
    FSDP(model)


def _units_disagree_on_use_orig_params() -> None:
    model = _mlp()
    model[0] = FSDP(model[0], use_orig_params=True)
    FSDP(model)(torch.randn(2, 4))  # checked when the root initialises, at forward


def _nested_enable_wrap() -> None:
    with enable_wrap(wrapper_cls=FSDP), enable_wrap(wrapper_cls=FSDP):
        pass


def _mesh_and_group() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    FSDP(_mlp(), process_group=dist.group.WORLD, device_mesh=init_device_mesh("cpu", (2,)))


def _two_dim_mesh_without_hybrid() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    FSDP(_mlp(), device_mesh=init_device_mesh("cpu", (1, 2)))


def _same_module_twice() -> None:
    model = _mlp()
    FSDP(model)
    gc.collect()  # the first wrapper is gone; its flat parameter is still on the model
    FSDP(model)  # the first wrapper owns its parameters already


def _auto_wrap_over_wrapped_child() -> None:
    model = _mlp()
    model[0] = FSDP(model[0])
    FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))


def _returns_three(module: nn.Module) -> Any:
    return 3  # neither a bool nor a kwargs dict


_BF16_AS_STRING = MixedPrecision(param_dtype="bf16")  # type: ignore[arg-type]

CONSTRUCTION: dict[str, Case] = {
    "sharding_strategy_as_string": (
        lambda: FSDP(_mlp(), sharding_strategy="FULL_SHARD"),  # type: ignore[arg-type]
        TypeError,
        "sharding_strategy must be a fullshard.ShardingStrategy, got 'FULL_SHARD'",
    ),
    "cpu_offload_as_bool": (
        lambda: FSDP(_mlp(), cpu_offload=True),  # type: ignore[arg-type]
        TypeError,
        "cpu_offload must be a fullshard.CPUOffload or None, got True",
    ),
    "mixed_precision_as_dtype": (
        lambda: FSDP(_mlp(), mixed_precision=torch.bfloat16),  # type: ignore[arg-type]
        TypeError,
        "mixed_precision must be a fullshard.MixedPrecision or None, got torch.bfloat16",
    ),
    "mixed_precision_dtype_as_string": (
        lambda: FSDP(_mlp(), mixed_precision=_BF16_AS_STRING),
        TypeError,
        "MixedPrecision.param_dtype must be a floating-point torch.dtype or None, got 'bf16'",
    ),
    "mixed_precision_integer_dtype": (
        lambda: FSDP(_mlp(), mixed_precision=MixedPrecision(reduce_dtype=torch.int8)),
        TypeError,
        "MixedPrecision.reduce_dtype must be a floating-point torch.dtype or None, got torch.int8",
    ),
    "device_id_as_float": (
        lambda: FSDP(_mlp(), device_id=1.5),  # type: ignore[arg-type]
        TypeError,
        "device_id must be an int, a str or a torch.device, got 1.5 on rank",
    ),
    "backward_prefetch_as_string": (
        lambda: FSDP(_mlp(), backward_prefetch="BACKWARD_PRE"),  # type: ignore[arg-type]
        TypeError,
        "backward_prefetch must be a BackwardPrefetch or None, got 'BACKWARD_PRE'",
    ),
    "param_init_fn_not_callable": (
        lambda: FSDP(_mlp(), param_init_fn=3),  # type: ignore[arg-type]
        ValueError,
        "Expected 3 to be callable but got <class 'int'>",
    ),
    "auto_wrap_policy_as_set_of_classes": (
        lambda: FSDP(_mlp(), auto_wrap_policy={nn.Linear}),
        TypeError,
        "got {<class 'torch.nn.modules.linear.Linear'>} of type set; to wrap instances of "
        "some classes, pass ModuleWrapPolicy({...})",
    ),
    "auto_wrap_policy_as_string": (
        lambda: FSDP(_mlp(), auto_wrap_policy="transformer"),
        TypeError,
        "auto_wrap_policy must be None, a ModuleWrapPolicy/CustomPolicy, or a callable",
    ),
    "module_wrap_policy_of_one_class": (
        lambda: ModuleWrapPolicy(nn.Linear),  # type: ignore[arg-type]
        TypeError,
        "got the class Linear itself; wrap it in a set: {Linear}",
    ),
    "module_wrap_policy_of_class_names": (
        lambda: ModuleWrapPolicy(["Linear"]),  # type: ignore[list-item]
        TypeError,
        "must contain classes, but it contains 'Linear' of type str (not a class)",
    ),
    "custom_policy_returning_int": (
        lambda: FSDP(_mlp(), auto_wrap_policy=CustomPolicy(_returns_three)),
        ValueError,
        "must return True/False or a kwargs dict, but for module 0 (Linear) it returned 3",
    ),
    "custom_policy_misspelt_option": (
        lambda: FSDP(
            _mlp(),
            auto_wrap_policy=CustomPolicy(
                lambda m: {"sharding": 1} if isinstance(m, nn.Linear) else False
            ),
        ),
        TypeError,
        "unknown FullyShardedDataParallel options ['sharding'] (from a wrap policy's overrides?)",
    ),
    "wrapping_twice": (
        lambda: FSDP(FSDP(_mlp())),
        ValueError,
        "the module is already a FullyShardedDataParallel instance; wrap it only once",
    ),
    "same_module_wrapped_by_two_instances": (
        _same_module_twice,
        ValueError,
        "this Sequential is already wrapped by another FullyShardedDataParallel instance",
    ),
    "auto_wrap_over_a_wrapped_child": (
        _auto_wrap_over_wrapped_child,
        ValueError,
        "FSDP auto wrapping requires modules to not already have FSDP applied but found 0 in",
    ),
    "a_tensor_instead_of_a_module": (
        lambda: FSDP(torch.randn(3)),  # type: ignore[arg-type]
        TypeError,
        "FullyShardedDataParallel wraps an nn.Module, got Tensor",
    ),
    "a_class_as_auto_wrap_policy": (
        lambda: FSDP(_mlp(), auto_wrap_policy=nn.Linear),
        TypeError,
        "auto_wrap_policy got the class Linear; to wrap every instance of it, pass "
        "ModuleWrapPolicy({Linear})",
    ),
    "process_group_as_int": (
        lambda: FSDP(_mlp(), process_group=2),
        TypeError,
        "process_group must be a torch.distributed.ProcessGroup (or, for hybrid strategies, a "
        "(shard, replicate) tuple of them) or None, got 2",
    ),
    "device_mesh_as_string": (
        lambda: FSDP(_mlp(), device_mesh="cpu"),
        TypeError,
        "device_mesh must be a torch.distributed.DeviceMesh or None, got 'cpu'",
    ),
    "ignored_modules_holding_a_unit": (
        _ignored_fsdp_unit,
        ValueError,
        "`ignored_modules` should not include FSDP modules: pass the module it wraps",
    ),
    "ignored_modules_and_ignored_states": (
        lambda: FSDP(_mlp(), ignored_modules=[nn.Linear(2, 2)], ignored_states=[]),
        ValueError,
        "Cannot pass both ignored_modules and ignored_states at the same time",
    ),
    "parameters_of_two_dtypes_in_one_unit": (
        _mixed_dtypes,
        ValueError,
        "FSDP expects every parameter of one unit to have the same dtype",
    ),
    "meta_module_without_reset_parameters": (
        lambda: FSDP(_MetaWithoutReset()),
        ValueError,
        "_MetaWithoutReset was on the meta device and has no `reset_parameters()`",
    ),
    "parameter_shared_with_a_nested_unit": (
        _shared_with_nested_unit,
        ValueError,
        "parameter '2.weight' is shared with a nested FSDP unit that already manages it",
    ),
    "units_disagree_on_use_orig_params": (
        _units_disagree_on_use_orig_params,
        ValueError,
        "Expects one homogeneous value for _use_orig_params but got {False, True}",
    ),
    "nested_enable_wrap": (
        _nested_enable_wrap,
        NotImplementedError,
        "enable_wrap() contexts cannot be nested",
    ),
    "hybrid_shard_with_one_group": (
        lambda: FSDP(
            _mlp(),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
            process_group=dist.group.WORLD,
        ),
        ValueError,
        "Expected process_group to be passed in as either None or Tuple[dist.ProcessGroup, "
        "dist.ProcessGroup] but got <class 'torch.distributed.distributed_c10d.ProcessGroup'>: "
        "ShardingStrategy.HYBRID_SHARD shards over the first group and replicates over the "
        "second",
    ),
    "hybrid_shard_wrapped_by_hand_without_groups": (
        lambda: FSDP(_mlp(), sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2),
        ValueError,
        "Manual wrapping with ShardingStrategy._HYBRID_SHARD_ZERO2 requires explicit "
        "specification of process group or device_mesh. Pass process_group=(shard_group, "
        "replicate_group) or a 2-D device_mesh",
    ),
    "group_pair_without_hybrid_shard": (
        lambda: FSDP(_mlp(), process_group=(dist.group.WORLD, dist.group.WORLD)),
        ValueError,
        "a (shard_group, replicate_group) tuple is only valid with hybrid strategies",
    ),
    "process_group_and_device_mesh": (
        _mesh_and_group,
        ValueError,
        "Cannot pass both process_group and device_mesh at the same time",
    ),
    "two_dim_mesh_without_hybrid_shard": (
        _two_dim_mesh_without_hybrid,
        ValueError,
        "a 2-D device_mesh is only valid with HYBRID_SHARD or _HYBRID_SHARD_ZERO2",
    ),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION))
def test_construction_misuse(case: str) -> None:
    """Wrong argument types and values, double wrapping, units that cannot be built."""
    _run_case("construction", case)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: device_id=0 is fine")
def test_cuda_device_id_without_cuda() -> None:
    """device_id naming a CUDA device on a machine without CUDA."""
    _run_case("no_cuda", "cuda_device_id_without_cuda")


def _frozen_and_trainable() -> list[tuple[str, bool, int]]:
    model = _mlp()
    model[0].weight.requires_grad_(False)
    fsdp = FSDP(model)  # use_orig_params=False
    optim = torch.optim.Adam(fsdp.parameters(), lr=0.1)
    fsdp(torch.randn(2, 4)).sum().backward()
    optim.step()
    assert [p.requires_grad for p in optim.state] == [True]
    return [(name, p.requires_grad, p.numel()) for name, p in fsdp.named_parameters()]


def test_frozen_and_trainable_in_one_flat_unit() -> None:
    """Row 20, no longer a misuse: with use_orig_params=False the frozen parameter moves to a
    second, frozen flat parameter and the optimizer's state covers the trainable ones only."""
    flat_params = run_on_ranks(2, _frozen_and_trainable)[0]
    # 0.bias, 2.weight, 2.bias: 4 + 8 + 2 = 14 elements; 0.weight: 16, on 2 ranks.
    assert flat_params == [
        ("_fsdp_wrapped_module._flat_param", True, 7),
        ("_fsdp_wrapped_module._frozen_flat_param", False, 8),
    ]


def _module_list_root() -> None:
    message = "FSDP will not all-gather parameters for containers that do not implement forward"
    with pytest.warns(UserWarning, match=message):
        FSDP(nn.ModuleList([nn.Linear(4, 4)]))


def test_module_list_root_warns() -> None:
    """A ModuleList (no forward) as the root unit warns, as torch's FSDP does."""
    run_on_ranks(2, _module_list_root)


def test_wrapping_before_init_process_group() -> None:
    """FSDP before torch.distributed.init_process_group (this process has no group)."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("this process already has a default process group")
    with pytest.raises(RuntimeError, match=r"fullshard needs torch\.distributed initialised"):
        FSDP(_mlp())


# ----------------------------------------------------------------------------------------
# 2. Calls in the wrong training state, and changing parameters after wrapping


def _summon_in_forward() -> None:
    module = _SummonsInForward()
    model = FSDP(module)
    module.wrapper.append(model)
    model(torch.randn(2, 4))


def _summon_nested() -> None:
    model = _wrapped()
    with FSDP.summon_full_params(model), FSDP.summon_full_params(model):
        pass


def _summon_during_backward() -> None:
    model = _wrapped()
    _during_backward(model, lambda: FSDP.summon_full_params(model).__enter__())


def _state_dict_during_backward() -> None:
    model = _wrapped()
    _during_backward(model, model.state_dict)


def _load_state_dict_in_summon() -> None:
    model = _wrapped()
    state = model.state_dict()
    with FSDP.summon_full_params(model):
        model.load_state_dict(state)


def _optim_state_dict_in_summon() -> None:
    model, optim = _with_adam()
    with FSDP.summon_full_params(model):
        FSDP.optim_state_dict(model, optim)


def _no_sync_on_inner_unit() -> None:
    model = _trained()  # after the first forward: the root is known
    with model.module[0].no_sync():
        pass


def _clip_on_inner_unit() -> None:
    _trained().module[0].clip_grad_norm_(1.0)


def _clip_during_backward() -> None:
    model = _wrapped()
    _during_backward(model, lambda: model.clip_grad_norm_(1.0))


def _convert_in_summon() -> None:
    model = _wrapped()
    with FSDP.summon_full_params(model):
        model.double()


def _convert_with_unreduced_grads() -> None:
    model = _wrapped()
    with model.no_sync():
        model(torch.randn(2, 4)).sum().backward()
        model.double()


def _optimizer_in_backward_on_flat_params() -> None:
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = _wrapped()
    _apply_optimizer_in_backward(torch.optim.SGD, model.parameters(), {"lr": 0.1})
    model(torch.randn(2, 4))


TRAINING_STATE: dict[str, Case] = {
    "summon_full_params_inside_forward": (
        _summon_in_forward,
        AssertionError,  # torch's type (fullshard's error is a RuntimeError too)
        "Cannot manually unshard parameters during forward/backward",
    ),
    "summon_full_params_during_backward": (
        _summon_during_backward,
        AssertionError,
        "Cannot manually unshard parameters during forward/backward",
    ),
    "summon_full_params_nested": (
        _summon_nested,
        AssertionError,
        "Cannot manually unshard parameters when already unsharding parameters: "
        "summon_full_params is already active on FSDP unit '(no params)'",
    ),
    "summon_writeback_and_rank0_only": (
        lambda: FSDP.summon_full_params(_wrapped(), writeback=True, rank0_only=True).__enter__(),
        NotImplementedError,  # torch's type (fullshard's error is a ValueError too)
        "writeback=True and rank0_only=True is not supported",
    ),
    "summon_with_grads_and_rank0_only": (
        lambda: FSDP.summon_full_params(
            _wrapped(use_orig_params=True), writeback=False, rank0_only=True, with_grads=True
        ).__enter__(),
        NotImplementedError,
        "summon_full_params(with_grads=True, rank0_only=True) is not supported",
    ),
    "summon_with_grads_without_use_orig_params": (
        lambda: FSDP.summon_full_params(_wrapped(), with_grads=True).__enter__(),
        NotImplementedError,
        "summon_full_params(with_grads=True) with use_orig_params=False, offload_to_cpu=False "
        "is not supported",
    ),
    "summon_with_grads_and_offload_to_cpu": (
        lambda: FSDP.summon_full_params(
            _wrapped(use_orig_params=True), with_grads=True, offload_to_cpu=True
        ).__enter__(),
        NotImplementedError,
        "summon_full_params(with_grads=True) with use_orig_params=True, offload_to_cpu=True "
        "is not supported",
    ),
    "summon_offload_to_cpu_with_no_shard": (
        lambda: FSDP.summon_full_params(
            _wrapped(sharding_strategy=ShardingStrategy.NO_SHARD), offload_to_cpu=True
        ).__enter__(),
        NotImplementedError,
        "offload_to_cpu=True and NO_SHARD is not supported",
    ),
    "state_dict_during_backward": (
        _state_dict_during_backward,
        RuntimeError,
        "state_dict() must be called outside forward/backward and summon_full_params",
    ),
    "load_state_dict_inside_summon": (
        _load_state_dict_in_summon,
        RuntimeError,
        "load_state_dict() must be called outside forward/backward and summon_full_params",
    ),
    "optim_state_dict_inside_summon": (
        _optim_state_dict_in_summon,
        RuntimeError,
        "optim_state_dict() must be called outside forward/backward and summon_full_params",
    ),
    "no_sync_on_a_non_root_unit": (
        _no_sync_on_inner_unit,
        RuntimeError,
        "`no_sync()` on inner FSDP instances is not supported",
    ),
    "clip_grad_norm_on_a_non_root_unit": (
        _clip_on_inner_unit,
        RuntimeError,
        "`clip_grad_norm_()` should only be called on the root FSDP instance",
    ),
    "clip_grad_norm_during_backward": (
        _clip_during_backward,
        RuntimeError,
        "clip_grad_norm_() must be called after backward, outside forward/backward",
    ),
    "clip_grad_norm_with_norm_type_zero": (
        lambda: _trained().clip_grad_norm_(1.0, norm_type=0),
        ValueError,
        "clip_grad_norm_ needs norm_type > 0, got 0.0",
    ),
    "dtype_conversion_inside_summon": (
        _convert_in_summon,
        RuntimeError,
        "during forward/backward or inside summon_full_params",
    ),
    "dtype_conversion_with_unreduced_grads": (
        _convert_with_unreduced_grads,
        RuntimeError,
        "while it holds an unreduced gradient (between backward and the end of a no_sync() block)",
    ),
    "moving_a_wrapped_model_to_meta": (
        lambda: _wrapped().to("meta"),
        RuntimeError,
        "from cpu to meta: its flat parameter cannot take a tensor of that type in place",
    ),
    "optimizer_in_backward_without_use_orig_params": (
        _optimizer_in_backward_on_flat_params,
        RuntimeError,
        "FSDP optimizer in backward only supported with use_orig_params=True!",
    ),
}


@pytest.mark.parametrize("case", list(TRAINING_STATE))
def test_training_state_misuse(case: str) -> None:
    """Methods called during forward/backward or summon, on a non-root unit, or with
    options that contradict each other; converting a wrapped model at the wrong time."""
    _run_case("training_state", case)


# ----------------------------------------------------------------------------------------
# 3. State dicts and optimizer state dicts


def _full_state_with(edit: Callable[[dict[str, Any]], None]) -> None:
    model = _trained()  # units are named (e.g. '2') once the root has initialised
    state = model.state_dict()
    edit(state)
    model.load_state_dict(state)


def _set_key(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.__setitem__(key, value)


def _inconsistent_settings() -> None:
    model = _wrapped()
    FSDP.set_state_dict_type(model.module[0], StateDictType.SHARDED_STATE_DICT)
    FSDP.get_state_dict_type(model)


def _local_state_dict_at_another_world_size() -> None:
    model = _wrapped()
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state = model.state_dict()
    # The same model sharded over 1 rank instead of 2 (each rank in a group of its own).
    alone = [dist.new_group([0]), dist.new_group([1])][dist.get_rank()]
    other = _wrapped(process_group=alone)
    with FSDP.state_dict_type(other, StateDictType.LOCAL_STATE_DICT):
        other.load_state_dict(state)


def _optimizer_before_wrapping() -> None:
    module = _mlp()
    optim = torch.optim.Adam(module.parameters(), lr=0.1)  # holds the unwrapped parameters
    model = FSDP(module)
    model(torch.randn(2, 4)).sum().backward()
    FSDP.optim_state_dict(model, optim)


def _id_keyed_optim_state_dict() -> None:
    model, optim = _with_adam()
    FSDP.optim_state_dict_to_load(model, optim, optim.state_dict())


def _optim_state_dict_of_another_model() -> None:
    model, optim = _with_adam()
    saved = FSDP.optim_state_dict(model, optim)
    torch.manual_seed(0)
    other = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    FSDP.optim_state_dict_to_load(other, torch.optim.Adam(other.parameters()), saved)


def _optim_state_dict_of_other_shapes() -> None:
    model, optim = _with_adam(use_orig_params=True)
    saved = FSDP.optim_state_dict(model, optim)
    other = _wrapped(out=3, use_orig_params=True)
    FSDP.optim_state_dict_to_load(other, torch.optim.Adam(other.parameters()), saved)


def _optim_state_dict_without_state() -> None:
    model, optim = _with_adam()
    FSDP.optim_state_dict_to_load(model, optim, {"param_groups": []})


def _rekey_with_string() -> None:
    model, optim = _with_adam(use_orig_params=True)
    FSDP.rekey_optim_state_dict(optim.state_dict(), "name", model)  # type: ignore[arg-type]


def _rekey_flat_parameters() -> None:
    model, optim = _with_adam()
    FSDP.rekey_optim_state_dict(optim.state_dict(), OptimStateKeyType.PARAM_NAME, model)


def _named_optimizer() -> None:
    model, optim = _with_adam()
    saved = FSDP.optim_state_dict(model, optim)
    FSDP.optim_state_dict_to_load(model, optim, saved, is_named_optimizer=True)


STATE_DICT: dict[str, Case] = {
    "state_dict_type_as_string": (
        lambda: FSDP.set_state_dict_type(_wrapped(), "FULL_STATE_DICT"),  # type: ignore[arg-type]
        TypeError,
        "state_dict_type must be a StateDictType, got 'FULL_STATE_DICT'",
    ),
    "state_dict_config_of_another_type": (
        lambda: FSDP.set_state_dict_type(
            _wrapped(), StateDictType.FULL_STATE_DICT, ShardedStateDictConfig()
        ),
        RuntimeError,  # torch's type (fullshard's error is a ValueError too)
        "Expected state_dict_config of type <class 'fullshard.api.FullStateDictConfig'> but "
        "got <class 'fullshard.api.ShardedStateDictConfig'>",
    ),
    "optim_state_dict_config_of_another_type": (
        lambda: FSDP.set_state_dict_type(
            _wrapped(),
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(),
            FullOptimStateDictConfig(),
        ),
        RuntimeError,
        "Expected optim_state_dict_config of type "
        "<class 'fullshard.api.ShardedOptimStateDictConfig'> but got "
        "<class 'fullshard.api.FullOptimStateDictConfig'>",
    ),
    "state_dict_type_on_an_unwrapped_model": (
        lambda: FSDP.set_state_dict_type(_mlp(), StateDictType.FULL_STATE_DICT),
        ValueError,
        "set_state_dict_type: Sequential contains no FSDP unit; pass the wrapped model",
    ),
    "units_with_different_state_dict_types": (
        _inconsistent_settings,
        AssertionError,
        "All FSDP modules must have the same state_dict settings",
    ),
    "state_dict_with_positional_arguments": (
        lambda: _wrapped().state_dict({}),
        TypeError,
        "state_dict() takes destination, prefix and keep_vars as keyword arguments only",
    ),
    "load_state_dict_with_a_wrong_shape": (
        lambda: _full_state_with(_set_key("2.weight", torch.zeros(3, 4))),
        ValueError,
        "cannot load 'weight' of FSDP unit '2': the state dict has shape (3, 4) but the "
        "parameter has shape (2, 4)",
    ),
    "load_state_dict_with_a_missing_key": (
        lambda: _full_state_with(lambda state: state.pop("2.weight")),
        RuntimeError,
        "Missing key(s) in state_dict: '2.weight'.",
    ),
    "load_state_dict_with_a_non_tensor": (
        lambda: _full_state_with(_set_key("2.bias", [0.0, 0.0])),
        TypeError,
        "is a list, not a tensor",
    ),
    "local_state_dict_at_another_world_size": (
        _local_state_dict_at_another_world_size,
        ValueError,
        "A LOCAL_STATE_DICT loads only at the world size and wrapping it was saved with; use "
        "SHARDED_STATE_DICT to change them",
    ),
    "optimizer_built_before_wrapping": (
        _optimizer_before_wrapping,
        ValueError,
        "holds a parameter of shape (0,) that is not in the model. Build the optimizer over "
        "the FSDP-wrapped model's parameters, after wrapping",
    ),
    "optim_state_dict_keyed_by_ids": (
        _id_keyed_optim_state_dict,
        ValueError,
        "the optimizer state dict is keyed by parameter ids, as "
        "torch.optim.Optimizer.state_dict() gives it; convert it first with "
        "FullyShardedDataParallel.rekey_optim_state_dict",
    ),
    "optim_state_dict_of_another_model": (
        _optim_state_dict_of_another_model,
        ValueError,
        "the optimizer state dict has state for ['2.weight', '2.bias'], which the optimizer "
        "does not hold",
    ),
    "optim_state_dict_of_other_shapes": (
        _optim_state_dict_of_other_shapes,
        ValueError,
        "optimizer state 'exp_avg' of '2.weight' has shape (2, 4) but the parameter has shape "
        "(3, 4)",
    ),
    "optim_state_dict_without_state": (
        _optim_state_dict_without_state,
        ValueError,
        "expected an optimizer state dict with 'state', got {'param_groups': []}",
    ),
    "rekey_with_a_string_key_type": (
        _rekey_with_string,
        TypeError,
        "optim_state_key_type must be an OptimStateKeyType, got 'name'",
    ),
    "rekey_flat_parameter_state": (
        _rekey_flat_parameters,
        ValueError,
        "the optimizer holds the flat parameter of FSDP unit",
    ),
    "named_optimizer": (
        _named_optimizer,
        NotImplementedError,
        "optim_state_dict_to_load(is_named_optimizer=True): fullshard supports torch.optim "
        "optimizers only",
    ),
}


@pytest.mark.parametrize("case", list(STATE_DICT))
def test_state_dict_misuse(case: str) -> None:
    """Bad state_dict_type configs, state dicts of other models or world sizes, optimizer
    state dicts keyed by ids or from an optimizer built before wrapping."""
    _run_case("state_dict", case)


def _rank0_only_load_without_state() -> bool:
    model, optim = _with_adam()
    configs = (FullStateDictConfig(rank0_only=True), FullOptimStateDictConfig(rank0_only=True))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *configs):
        message = "rank 0 must pass the full optimizer state dict (with 'state' and"
        with pytest.raises(ValueError, match=re.escape(message)):  # every rank, agreed
            FSDP.optim_state_dict_to_load(model, optim, None)  # type: ignore[arg-type]
    return True


def test_rank0_only_optim_load_without_state_on_rank0() -> None:
    """With a rank0_only FULL optimizer config, rank 0 passing None to
    optim_state_dict_to_load: every rank raises (rank 0 alone did, and the others waited
    in the broadcast of the state dict's layout until the group's timeout)."""
    assert run_on_ranks(2, _rank0_only_load_without_state) == [True, True]


# ----------------------------------------------------------------------------------------
# 4. ShardedGradScaler called out of order, and the environment


def _scaled_backward() -> tuple[ShardedGradScaler, torch.optim.Optimizer]:
    model = _wrapped()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler(device="cpu")
    scaler.scale(model(torch.randn(2, 4)).sum()).backward()
    return scaler, optim


def _unscale_twice() -> None:
    scaler, optim = _scaled_backward()
    scaler.unscale_(optim)
    scaler.unscale_(optim)


def _step_twice() -> None:
    scaler, optim = _scaled_backward()
    scaler.step(optim)
    scaler.step(optim)


def _update_without_step() -> None:
    scaler, _ = _scaled_backward()
    scaler.update()


def _forward_with_collective_timeout() -> None:
    _wrapped()(torch.randn(2, 4))


SCALER_AND_ENV: dict[str, Case] = {
    "grad_scaler_unscale_twice": (
        _unscale_twice,
        RuntimeError,
        "unscale_() has already been called on this optimizer since the last update().",
    ),
    "grad_scaler_step_twice": (
        _step_twice,
        RuntimeError,
        "step() has already been called since the last update().",
    ),
    "grad_scaler_update_before_step": (
        _update_without_step,
        AssertionError,
        "No inf checks were recorded prior to update.",
    ),
    "grad_scaler_scale_of_a_number": (
        lambda: ShardedGradScaler(device="cpu").scale(3),  # type: ignore[arg-type]
        ValueError,
        "outputs must be a Tensor or an iterable of Tensors, got int",
    ),
    "collective_timeout_not_a_number": (
        _forward_with_collective_timeout,
        ValueError,
        "FULLSHARD_COLLECTIVE_TIMEOUT='ten' is not a number of seconds",
    ),
    "collective_timeout_with_a_unit": (
        _forward_with_collective_timeout,
        ValueError,
        "FULLSHARD_COLLECTIVE_TIMEOUT='30s' is not a number of seconds",
    ),
    "collective_timeout_zero": (
        _forward_with_collective_timeout,
        ValueError,
        "FULLSHARD_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds, got 0",
    ),
    "collective_timeout_nan": (
        _forward_with_collective_timeout,
        ValueError,
        "FULLSHARD_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds, got nan",
    ),
    "collective_timeout_inf": (
        _forward_with_collective_timeout,
        ValueError,
        "FULLSHARD_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds, got inf",
    ),
}
_ENV = {
    "collective_timeout_not_a_number": {"FULLSHARD_COLLECTIVE_TIMEOUT": "ten"},
    "collective_timeout_with_a_unit": {"FULLSHARD_COLLECTIVE_TIMEOUT": "30s"},
    "collective_timeout_zero": {"FULLSHARD_COLLECTIVE_TIMEOUT": "0"},
    "collective_timeout_nan": {"FULLSHARD_COLLECTIVE_TIMEOUT": "nan"},
    "collective_timeout_inf": {"FULLSHARD_COLLECTIVE_TIMEOUT": "inf"},
}


@pytest.mark.parametrize("case", list(SCALER_AND_ENV))
def test_scaler_and_environment_misuse(case: str) -> None:
    """The grad scaler's calls out of order; FULLSHARD_COLLECTIVE_TIMEOUT not a positive
    number of seconds (read as the unit is built)."""
    _run_case("scaler_and_env", case, env=_ENV.get(case))


NO_CUDA: dict[str, Case] = {
    "cuda_device_id_without_cuda": (
        lambda: FSDP(_mlp(), device_id=0),
        ValueError,
        "device_id=0 names a CUDA device on rank",
    ),
}

TABLES: dict[str, dict[str, Case]] = {
    "construction": CONSTRUCTION,
    "no_cuda": NO_CUDA,
    "training_state": TRAINING_STATE,
    "state_dict": STATE_DICT,
    "scaler_and_env": SCALER_AND_ENV,
}


# ----------------------------------------------------------------------------------------
# 5. Checkpoints: of another model, without what is asked for, damaged on disk


def _save(path: str, with_optim: bool) -> None:
    model, optim = _with_adam()
    ckpt.save(path, model, optim if with_optim else None, step=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with two checkpoints of ``_wrapped()`` saved on 2 ranks: ``full`` (model and
    Adam) and ``model_only``. Tests that damage one copy it first."""
    root = tmp_path_factory.mktemp("saved")
    run_on_ranks(2, _save, str(root / "full"), True)
    run_on_ranks(2, _save, str(root / "model_only"), False)
    return root


def _load_expecting(path: str, load: str, error: type[BaseException], fragment: str) -> None:
    if load == "other_model":
        model: nn.Module = _wrapped(out=3)
        optim = None
    elif load == "unwrapped":
        model, optim = _mlp(), None
    elif load == "optim_over_some_params":
        model = _wrapped(use_orig_params=True)
        optim = torch.optim.Adam(list(model.parameters())[:2])
    elif load == "stateless_optim":
        model = _wrapped()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)  # no momentum: no state
    else:
        assert load == "model_and_adam", load
        model = _wrapped()
        optim = torch.optim.Adam(model.parameters())
    with pytest.raises(error, match=fragment) as info:
        ckpt.load(path, model, optim)
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"


def _truncate(file: Path, keep: float) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


def _damage(folder: Path, how: str) -> None:
    if how == "delete_fullshard_json":
        (folder / "fullshard.json").unlink()
    elif how == "truncate_fullshard_json":
        _truncate(folder / "fullshard.json", 0.5)
    elif how == "foreign_fullshard_json":
        (folder / "fullshard.json").write_text(json.dumps({"format": "something-else"}))
    elif how == "fullshard_json_not_an_object":
        (folder / "fullshard.json").write_text(json.dumps([1, 2]))
    elif how == "delete_metadata":
        (folder / ".metadata").unlink()
    elif how == "truncate_metadata":
        _truncate(folder / ".metadata", 0.1)
    elif how == "truncate_distcp":
        for file in folder.glob("*.distcp"):
            _truncate(file, 0.5)
    elif how == "flip_a_bit":
        data = bytearray((folder / "__1_0.distcp").read_bytes())
        data[len(data) // 2] ^= 0x01
        (folder / "__1_0.distcp").write_bytes(bytes(data))
    else:
        assert how == "delete_distcp", how
        (folder / "__0_0.distcp").unlink()


# id: (checkpoint, damage or None, what the ranks load, error, regex on the message)
CHECKPOINTS: dict[str, tuple[str, str | None, str, type[BaseException], str]] = {
    "checkpoint_of_another_model": (
        "full", None, "other_model", ckpt.CheckpointMismatchError,
        re.escape("was saved from another model.\n  shapes differ: 2.weight (checkpoint (2, 4), "
                  "model (3, 4)), 2.bias (checkpoint (2,), model (3,))"),
    ),
    "checkpoint_into_an_unwrapped_model": (
        "full", None, "unwrapped", ValueError,
        re.escape("set_state_dict_type: Sequential contains no FSDP unit; pass the wrapped model"),
    ),
    "optimizer_state_from_a_model_only_checkpoint": (
        "model_only", None, "model_and_adam", ValueError,
        r"checkpoint .*model_only holds no optimizer state \(saved without optim\)",
    ),
    "checkpoint_optimizer_over_other_parameters": (
        "full", None, "optim_over_some_params", ckpt.CheckpointMismatchError,
        re.escape("has optimizer state for 2.bias, 2.weight, which the optimizer does not "
                  "hold; build it over the same parameters as when saving"),
    ),
    "checkpoint_into_another_kind_of_optimizer": (
        "full", None, "stateless_optim", ckpt.CheckpointMismatchError,
        re.escape("has optimizer state for 0.bias, 0.weight, 2.bias, 2.weight, which the "
                  "optimizer does not hold"),
    ),
    "checkpoint_path_that_does_not_exist": (
        "nonexistent", None, "model_and_adam", FileNotFoundError, r"no checkpoint at .*nonexistent",
    ),
    "checkpoint_without_fullshard_json": (
        "full", "delete_fullshard_json", "model_and_adam", ValueError,
        re.escape("is not a complete fullshard checkpoint: it has no fullshard.json"),
    ),
    "checkpoint_with_truncated_fullshard_json": (
        "full", "truncate_fullshard_json", "model_and_adam", ValueError,
        r"fullshard\.json is unreadable: ",
    ),
    "checkpoint_with_foreign_fullshard_json": (
        "full", "foreign_fullshard_json", "model_and_adam", ValueError,
        re.escape("is not a fullshard checkpoint (format 'something-else')"),
    ),
    "checkpoint_whose_fullshard_json_is_a_list": (
        "full", "fullshard_json_not_an_object", "model_and_adam", ValueError,
        re.escape("is not a fullshard checkpoint (format 'list')"),
    ),
    "checkpoint_without_dcp_metadata": (
        "full", "delete_metadata", "model_and_adam", ckpt.CheckpointCorruptedError,
        re.escape("is damaged: .metadata is missing. Load an earlier checkpoint, or pass "
                  "verify=False to load it anyway"),
    ),
    "checkpoint_with_truncated_dcp_metadata": (
        "full", "truncate_metadata", "model_and_adam", ckpt.CheckpointCorruptedError,
        r"is damaged: \.metadata has \d+ bytes, \d+ saved",
    ),
    "checkpoint_with_truncated_distcp_files": (
        "full", "truncate_distcp", "model_and_adam", ckpt.CheckpointCorruptedError,
        r"is damaged: __0_0\.distcp has \d+ bytes, \d+ saved; __1_0\.distcp has \d+ bytes",
    ),
    "checkpoint_with_a_deleted_distcp_file": (
        "full", "delete_distcp", "model_and_adam", ckpt.CheckpointCorruptedError,
        re.escape("is damaged: __0_0.distcp is missing"),
    ),
    "checkpoint_with_a_flipped_bit": (
        "full", "flip_a_bit", "model_and_adam", ckpt.CheckpointCorruptedError,
        re.escape("is damaged: __1_0.distcp's contents changed since the save (SHA-256 differs)"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_checkpoint_misuse(case: str, saved: Path, tmp_path: Path) -> None:
    """fullshard.checkpoint.load of another model or optimizer, of a checkpoint without
    what is asked for, or of one damaged on disk (the damage is done here, between the
    ranks' save and load)."""
    source, damage, load, error, pattern = CHECKPOINTS[case]
    folder = saved / source
    if damage is not None:
        folder = tmp_path / "ckpt"
        shutil.copytree(saved / source, folder)
        _damage(folder, damage)
    run_on_ranks(2, _load_expecting, str(folder), load, error, pattern)


def _save_with_bad_extra(path: str) -> None:
    message = "extra value 'step' (object) is neither a tensor nor JSON-serialisable"
    with pytest.raises(TypeError, match=re.escape(message)):
        ckpt.save(path, _wrapped(), step=object())


def test_checkpoint_save_with_an_extra_that_is_not_json(tmp_path: Path) -> None:
    """checkpoint.save(..., step=<an object JSON cannot hold>): refused before writing."""
    run_on_ranks(2, _save_with_bad_extra, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


# ----------------------------------------------------------------------------------------
# 6. The fullshard command (tests/cli/test_cli.py has more: docs/misuse.md lists them)

_TINY_TRAIN = ["train", "--preset", "tiny", "--batch-size", "4", "--seq-len", "32"]

CLI: dict[str, tuple[list[str], int, str]] = {
    "plan_shard_group_size_without_hybrid": (
        ["plan", "--preset", "tiny", "--shard-group-size", "2"],
        2,
        "fullshard plan: error: --shard-group-size applies to HYBRID_SHARD and "
        "_HYBRID_SHARD_ZERO2 only",
    ),
    "plan_world_size_zero": (
        ["plan", "--preset", "tiny", "--world-size", "0"],
        2,
        "fullshard plan: error: --world-size must be positive, got 0",
    ),
    "plan_hf_config_not_json": (
        ["plan", "--hf-config", "README.md"],
        1,
        "fullshard plan: --hf-config README.md is not JSON: Expecting value",
    ),
    "train_negative_lr": (
        [*_TINY_TRAIN, "--lr", "-1"],
        2,
        "fullshard train: error: --lr must be a positive number, got -1.0",
    ),
    "train_zero_ranks": (
        [*_TINY_TRAIN, "--nproc-per-node", "0"],
        2,
        "fullshard train: error: --nproc-per-node must be positive, got 0",
    ),
    "train_resume_from_an_unreadable_checkpoint": (
        [*_TINY_TRAIN, "--resume", "--out", "{out}"],
        2,
        "fullshard train: error: --resume: {out}/checkpoint/fullshard.json is unreadable",
    ),
}


@pytest.mark.parametrize("case", list(CLI))
def test_cli_misuse(case: str, tmp_path: Path) -> None:
    """Bad ``fullshard plan`` / ``fullshard train`` flags: an error naming the flag, before
    any rank starts."""
    args, status, message = CLI[case]
    out = tmp_path / "run"
    if "{out}" in args:  # an --out whose checkpoint metadata is not JSON
        (out / "checkpoint").mkdir(parents=True)
        (out / "checkpoint" / "fullshard.json").write_text("{not json")
    args = [arg.format(out=out) for arg in args]
    result = subprocess.run(
        [sys.executable, "-m", "fullshard", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == status, result.stderr[-2000:]
    assert message.format(out=out) in result.stderr, result.stderr[-2000:]


def _replace_after_wrapping(use_orig_params: bool, tie: bool, message: str) -> None:
    model = _mlp()
    fsdp = FSDP(model, use_orig_params=use_orig_params)
    fsdp(torch.randn(2, 4)).sum().backward()
    if tie:
        model[2].weight = model[0].weight  # a tie made after wrapping
    else:
        model[0].weight = nn.Parameter(torch.zeros(4, 4))
    with pytest.raises(RuntimeError, match=re.escape(message)):
        fsdp(torch.randn(2, 4))


@pytest.mark.parametrize(
    ("use_orig_params", "tie"),
    [(False, False), (True, False), (True, True)],
    ids=["replaced-flat", "replaced-orig_params", "tied-orig_params"],
)
def test_parameter_replaced_after_wrapping(use_orig_params: bool, tie: bool) -> None:
    """A parameter replaced (or, with use_orig_params, tied to another) after wrapping: the
    next forward raises naming it, instead of silently training the parameter FSDP found at
    wrapping time. (Without use_orig_params, module attributes between steps are plain
    views, and a plain tensor assigned to one is not detected.)"""
    name = "2.weight" if tie else "0.weight"
    message = f"the parameter {name} of FSDP unit '(root)' was replaced after"
    run_on_ranks(2, _replace_after_wrapping, use_orig_params, tie, message)


def _optimizer_before_wrapping(use_orig_params: bool) -> bool:
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)  # built over the unwrapped model
    fsdp = FSDP(model, use_orig_params=use_orig_params)
    fsdp(torch.randn(2, 4)).sum().backward()
    if not use_orig_params:
        message = (
            "SGD holds parameters that FullyShardedDataParallel took over when it wrapped the "
            "model (e.g. 0.weight): they are empty now and never get gradients"
        )
        with pytest.raises(RuntimeError, match=re.escape(message)):
            optim.step()
        return False
    before = [p.detach().clone() for p in fsdp.parameters()]
    optim.step()  # use_orig_params keeps the original parameters: this trains
    return any(not torch.equal(a, p) for a, p in zip(before, fsdp.parameters()))


def test_optimizer_built_before_wrapping() -> None:
    """With use_orig_params=False the optimizer's first step raises (it would silently do
    nothing); with use_orig_params=True the same code trains."""
    assert run_on_ranks(2, _optimizer_before_wrapping, False) == [False, False]
    assert run_on_ranks(2, _optimizer_before_wrapping, True) == [True, True]
