"""What training stacks read from FSDP units that users' scripts do not (issue 31), compared
with torch's FSDP on the same model and ranks: FSDP1's ``_has_params`` and ``_flat_param``
with its ``_fqns``, the ``_fsdp_flattened`` mark, the ``_is_fsdp_managed_module`` /
``_fsdp_use_orig_params`` marks on managed modules (both APIs; transformers' ``generate``
turns on ``synced_gpus`` from them), and accelerate's upcast of low-precision flat
parameters before the first forward."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import MixedPrecision, fully_shard
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import TransformerWithSharedParams, transformer_layer_classes


def _marks(model: nn.Module) -> dict[str, tuple[Any, Any]]:
    return {
        name.replace("_fsdp_wrapped_module.", ""): (
            getattr(m, "_is_fsdp_managed_module", None),
            getattr(m, "_fsdp_use_orig_params", None),
        )
        for name, m in model.named_modules()
        if not name.endswith("_fsdp_wrapped_module")
        and type(m).__name__ != "FullyShardedDataParallel"
    }


def _fsdp1_attributes(use_orig_params: bool) -> None:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    classes = transformer_layer_classes()
    ours = FSDP(
        TransformerWithSharedParams(),
        auto_wrap_policy=ModuleWrapPolicy(classes),
        use_orig_params=use_orig_params,
    )
    theirs = TorchFSDP(
        TransformerWithSharedParams(),
        auto_wrap_policy=TorchModuleWrapPolicy(classes),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    our_units = FSDP.fsdp_modules(ours)
    their_units = TorchFSDP.fsdp_modules(theirs)
    assert len(our_units) == len(their_units) > 1
    for our, their in zip(our_units, their_units):
        assert our._has_params == their._has_params
        if their._has_params:
            assert our._flat_param is our._handle.flat_param
            assert our._flat_param._fqns == their._flat_param._fqns
            assert our._flat_param._fsdp_flattened is True
        else:
            assert our._flat_param is None
    # the marks on every managed module: torch's use_orig_params where dynamo reads it;
    # fullshard's units may be traced with either setting (names.py's note)
    our_marks, their_marks = _marks(ours), _marks(theirs)
    assert our_marks.keys() == their_marks.keys()
    assert all(managed is True for managed, _ in their_marks.values())
    assert our_marks == {name: (True, True) for name in their_marks}


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_units_show_what_stacks_read_as_torch_does(use_orig_params: bool) -> None:
    run_on_ranks(2, _fsdp1_attributes, use_orig_params)


def _fsdp2_marks() -> None:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    def build(shard: Any) -> nn.Module:
        model = TransformerWithSharedParams()
        model.output_proj.weight = nn.Parameter(model.output_proj.weight.detach().clone())
        for layer in model.transformer.encoder.layers:
            shard(layer)
        shard(model)
        return model

    ours, theirs = build(fully_shard), build(torch_fully_shard)
    assert _marks(ours) == _marks(theirs)
    assert all(mark == (True, True) for mark in _marks(theirs).values())


def test_fully_shard_marks_the_modules_it_manages_as_torch_does() -> None:
    run_on_ranks(2, _fsdp2_marks)


def _upcast_like_accelerate(ours: bool) -> list[float]:
    """A bf16 model under bf16 mixed precision whose flat parameters are upcast to fp32
    after wrapping, before the first forward, as accelerate's FSDP1 ``prepare`` does."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy

    model = TransformerWithSharedParams(add_bn=False).to(torch.bfloat16)
    classes = transformer_layer_classes()
    if ours:
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy(classes),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
        units = FSDP.fsdp_modules(model)
    else:
        model = TorchFSDP(
            model,
            auto_wrap_policy=TorchModuleWrapPolicy(classes),
            mixed_precision=TorchMixedPrecision(param_dtype=torch.bfloat16),
            device_id=torch.device("cpu"),
        )
        units = TorchFSDP.fsdp_modules(model)
    for unit in units:  # accelerate/accelerator.py, prepare_model
        if not unit._has_params:
            continue
        param = unit._flat_param
        param.data = param.data.to(torch.float32)
        unit._handle._orig_param_dtype = torch.float32
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    losses = []
    inner = model.module
    for step in range(3):
        src, tgt = inner.get_input("cpu", rank=dist.get_rank(), step=step)
        src, tgt = src, tgt
        loss = model(src, tgt).float().sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def test_flat_parameters_upcast_before_the_first_forward_train_as_on_torch() -> None:
    """Without adopting the new data the optimizer steps the fp32 tensor while the
    all-gathers read the old bf16 shard: the losses stop moving."""
    theirs = run_on_ranks(2, _upcast_like_accelerate, False)
    ours = run_on_ranks(2, _upcast_like_accelerate, True)
    for our, their in zip(ours, theirs):
        torch.testing.assert_close(our, their, rtol=1e-5, atol=0)
        assert our[0] != our[-1]


def _misuses() -> None:
    from fullshard import StateDictType

    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    model._flat_param.data = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"was given data of shape \(3,\) where its shard has"):
        model(torch.randn(2, 4))

    class NeedsMore(torch.optim.SGD):
        def __init__(self, params: Any, extra: int, lr: float = 0.1) -> None:
            super().__init__(params, lr=lr)

    model = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    optim = NeedsMore(model.parameters(), 1)
    rebuild_failed = "NeedsMore has no state yet and could not be rebuilt"
    with (
        FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT),
        pytest.warns(UserWarning, match=rebuild_failed),
    ):
        osd = FSDP.optim_state_dict(model, optim)
    assert osd["state"] == {}  # torch's dict: no state to list


def test_misuses_of_what_stacks_touch() -> None:
    """Rows 150 and 151 of docs/misuse.md."""
    run_on_ranks(2, _misuses)
