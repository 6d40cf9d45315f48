"""Pure low-precision training: a model converted with ``.half()`` before or after wrapping.

Port of torch's ``test/distributed/fsdp/test_fsdp_pure_fp16.py`` (seed
``004_b8793dc6f5156d61``), every method with every subtest, on 2 gloo ranks on the CPU
(CPU fp16 Linear forward/backward works in the torch build the suite runs on):

- ``test_pure_fp16_training``: torch's ``_test_fsdp_parity(NestedWrappedModule,
  FSDPInitMode.RECURSIVE, CUDA_BEFORE, num_iters=1, cpu_offload=..., use_pure_fp16=True)``
  for both ``cpu_offload`` values, written out here as :func:`_check_pure_low_precision_parity`
  with what common_fsdp does: a DDP reference, the FSDP model (nested units, the given
  ``cpu_offload``) converted with ``.half()`` after wrapping, fp16 inputs,
  SGD(lr=1e-2, momentum=0.9), one iteration, loss dtype fp16, parameters on the CPU after
  forward and backward when offloaded, the save/zero/load state-dict round trip
  after the step (``save_model=True``), every unit IDLE at the end, then the losses compared
  with ``torch.testing.assert_close(check_dtype=False)``.
- ``test_fp16_dtypes``: ``_test_fp16_dtypes`` for all 12 combinations of
  ``to_half_before_fsdp_init`` x ``use_orig_params`` x ``mixed_precision``, every assertion.

Deviations from the seed, and why:

- CPU and gloo instead of CUDA and NCCL: the suite runs on CPU machines. Models are CPU
  models (the seed's CUDA_BEFORE / CUDA_NEVER), and no ``device_id`` is passed (the seed
  passes ``torch.cuda.current_device()``).
- World size 2 (the seed: ``min(4, number of GPUs)``).
- The DDP reference wraps the model already converted (``DDP(model.half())``); common_fsdp
  converts after wrapping (``DDP(model).half()``). Converting a parameter's dtype through
  ``.data`` makes autograd drop the parameter's gradient accumulator, on which DDP's reducer
  hooked at construction, so that DDP never all-reduces: each rank keeps its local
  gradients (checked on this torch: the weights' gradients equal the rank-local ones).
  The loss, computed before the step, is the same either way; the parameters after the
  step are not, and the added parameter check below needs a synchronised reference.
- Inputs come from ``models.NestedWrappedModule.get_input(device, rank, step)`` (per-rank
  generator) rather than common_fsdp's ``torch.manual_seed(1 + rank); torch.rand(...)``.
- Added, stricter than the seed: after training, the FSDP parameters (gathered with
  ``summon_full_params``) are compared with DDP's, names, dtypes and values, at
  ``assert_close``'s default tolerances for the dtype. The seed skips this check for pure
  fp16 (common_fsdp's TODO, pytorch/pytorch#90784, blames floating-point inaccuracy; the
  unsynchronised reference above is a likelier cause). With two ranks both sides divide
  by 2 and add two values, so here the parameters agree. Also added:
  every FSDP parameter is fp16 after ``.half()`` and under ``summon_full_params``.
- The save/zero/load round trip uses whatever ``state_dict``/``load_state_dict`` the FSDP
  module offers: fullshard has no FSDP state-dict support yet, so today this is
  ``nn.Module``'s (the units' sharded flat parameters); the seed gets a full state dict.
- ``ShardedGradScaler`` is left out: common_fsdp creates it with ``enabled=False`` here, so
  its ``step`` is ``optim.step()`` and its ``scale``/``update`` do nothing.
- Added: ``test_pure_bf16_training``, the same parity for a model converted with
  ``.to(torch.bfloat16)`` (bf16 is the CPU's usual low precision).
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import CPUOffload, MixedPrecision
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._engine.runtime import TrainingState
from fullshard._engine.sharding import RESHARD_AFTER_FORWARD
from fullshard._engine.unit import handles_in as _get_fsdp_handles
from harness import run_on_ranks
from models import NestedWrappedModule, nested_wrap
from subtests import zero_model

WORLD_SIZE = 2
CPU = torch.device("cpu")
LR = 1e-2
"""common_fsdp's ``_test_fsdp_parity`` hard-codes ``lr = 1e-2`` for both runs."""

CPU_OFFLOADS = [CPUOffload(offload_params=True), CPUOffload(offload_params=False)]
FP16_DTYPES_SUBTESTS = {
    "to_half_before_fsdp_init": [False, True],
    "use_orig_params": [False, True],
    "mixed_precision": [
        MixedPrecision(),
        MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32),
        MixedPrecision(param_dtype=torch.float32),
    ],
}


def _subtests(config: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of ``config``'s values, as torch's ``run_subtests`` runs them."""
    names = list(config)
    return [dict(zip(names, values)) for values in itertools.product(*config.values())]


def _convert(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module.half()`` for fp16 (as the seed does), ``module.to(dtype)`` otherwise."""
    return module.half() if dtype == torch.float16 else module.to(dtype)


# ----------------------------------------------------------------------------------------
# test_pure_fp16_training


def _train_for_several_steps(
    model: nn.Module,
    num_steps: int,
    low_dtype: torch.dtype,
    cpu_offload: CPUOffload,
    save_model: bool,
    where: str,
) -> Tensor:
    """common_fsdp's ``_train_for_several_steps`` with ``use_pure_fp16`` (and no autocast,
    no mixed precision, the grad scaler disabled); returns the last loss, detached."""
    is_fsdp = isinstance(model, FSDP)
    offload_params = cpu_offload.offload_params
    model_device = next(model.parameters()).device
    optim = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    inner: Any = model.module  # the NestedWrappedModule, under DDP and FSDP alike
    rank = dist.get_rank()
    loss = torch.zeros(())
    for step in range(num_steps):
        optim.zero_grad()
        inputs = tuple(x.to(low_dtype) for x in inner.get_input(CPU, rank=rank, step=step))
        output = model(*inputs)
        if offload_params and is_fsdp and model.sharding_strategy in RESHARD_AFTER_FORWARD:
            for param in model.parameters():
                assert param.device == CPU, f"{where}: a parameter left the CPU after forward"
        loss = inner.get_loss(inputs, output).to(model_device)
        assert loss.dtype == low_dtype, f"{where}: loss dtype {loss.dtype}, expected {low_dtype}"
        loss.backward()
        if offload_params and is_fsdp:
            for param in model.parameters():
                assert param.device == CPU, f"{where}: a parameter left the CPU after backward"
        optim.step()
        if save_model:
            state_dict = {k: v.clone() for k, v in model.state_dict().items()}
            zero_model(model)
            model.load_state_dict(state_dict)
    if is_fsdp:
        states = {unit._runtime.training_state for unit in FSDP.fsdp_modules(model)}
        assert states == {TrainingState.IDLE}, f"{where}: units not IDLE after training: {states}"
    return loss.detach()


def _check_pure_low_precision_parity(low_dtype: torch.dtype) -> int:
    """Every ``cpu_offload`` subtest of ``_test_pure_fp16_training``; returns the count run."""
    num_run = 0
    for subtest in _subtests({"cpu_offload": CPU_OFFLOADS}):
        _check_pure_low_precision_case(low_dtype, **copy.deepcopy(subtest))
        num_run += 1
    return num_run


def _check_pure_low_precision_case(low_dtype: torch.dtype, cpu_offload: CPUOffload) -> None:
    """torch's ``_test_pure_fp16_training`` for one ``cpu_offload`` (``low_dtype`` for fp16)."""
    where = f"rank {dist.get_rank()}, {low_dtype}, cpu_offload={cpu_offload}"
    # Reference: DDP over the converted model (see the module docstring for why not
    # DDP over the fp32 model converted afterwards, as _test_fsdp_parity does).
    ref_model = DDP(_convert(NestedWrappedModule(seed=0), low_dtype))
    ref_loss = _train_for_several_steps(
        ref_model, 1, low_dtype, cpu_offload, save_model=False, where=f"{where}, DDP"
    )
    ddp_params = list(ref_model.module.named_parameters())
    # FSDP: RECURSIVE nesting, every unit with the same arguments, converted after wrapping.
    fsdp_kwargs: dict[str, Any] = {
        "cpu_offload": cpu_offload,
        "backward_prefetch": None,
        "sharding_strategy": None,
        "mixed_precision": None,
        "forward_prefetch": False,
        "use_orig_params": False,
    }
    model = NestedWrappedModule(seed=0)
    nested_wrap(model, lambda m: FSDP(m, **fsdp_kwargs))
    fsdp_model = _convert(FSDP(model, **fsdp_kwargs), low_dtype)
    for param in fsdp_model.parameters():
        assert param.dtype == low_dtype, f"{where}: FSDP parameter dtype {param.dtype}"
        if cpu_offload.offload_params:
            assert param.device == CPU, f"{where}: offloaded parameter on {param.device}"
    fsdp_loss = _train_for_several_steps(
        fsdp_model, 1, low_dtype, cpu_offload, save_model=True, where=f"{where}, FSDP"
    )
    if cpu_offload.offload_params:
        for param in fsdp_model.parameters():
            assert param.device == CPU, f"{where}: offloaded parameter on {param.device}"
    with FSDP.summon_full_params(fsdp_model):
        fsdp_params = [(n, p.detach().clone()) for n, p in fsdp_model.named_parameters()]
    torch.testing.assert_close(
        ref_loss, fsdp_loss, check_dtype=False, msg=lambda m: f"{where}: loss\n{m}"
    )
    # Added (the seed skips parameter parity for pure fp16, see the module docstring).
    assert [n for n, _ in fsdp_params] == [n for n, _ in ddp_params], where
    for (name, fsdp_param), (_, ddp_param) in zip(fsdp_params, ddp_params):
        assert fsdp_param.dtype == low_dtype, f"{where}: summoned {name} is {fsdp_param.dtype}"
        torch.testing.assert_close(
            fsdp_param,
            ddp_param.detach(),
            msg=lambda m, name=name: f"{where}: parameter {name} differs from DDP's\n{m}",
        )


def test_pure_fp16_training() -> None:
    """Pure fp16 training, the model converted with ``.half()`` after FSDP init, matches DDP
    (loss and parameters) with and without parameter CPU offload."""
    assert run_on_ranks(WORLD_SIZE, _check_pure_low_precision_parity, torch.float16) == [2, 2]


def test_pure_bf16_training() -> None:
    """Added: the same parity with the model converted with ``.to(torch.bfloat16)``."""
    assert run_on_ranks(WORLD_SIZE, _check_pure_low_precision_parity, torch.bfloat16) == [2, 2]


# ----------------------------------------------------------------------------------------
# test_fp16_dtypes


def _check_fp16_dtypes_case(
    to_half_before_fsdp_init: bool, use_orig_params: bool, mixed_precision: MixedPrecision
) -> None:
    """torch's ``_test_fp16_dtypes``, every assertion."""
    where = (
        f"rank {dist.get_rank()}, to_half_before_fsdp_init={to_half_before_fsdp_init}, "
        f"use_orig_params={use_orig_params}, {mixed_precision}"
    )
    model: nn.Module = NestedWrappedModule(seed=0)
    fsdp_kwargs = {"use_orig_params": use_orig_params, "mixed_precision": mixed_precision}
    if to_half_before_fsdp_init:
        model = model.half()
    fsdp_model = FSDP(model, **fsdp_kwargs)
    if not to_half_before_fsdp_init:
        fsdp_model = fsdp_model.half()
    for param in fsdp_model.parameters():
        assert param.dtype == torch.float16, f"{where}: parameter dtype {param.dtype}"
    inner: Any = fsdp_model.module
    inp = tuple(
        t.half() if torch.is_tensor(t) else t for t in inner.get_input(CPU, rank=dist.get_rank())
    )
    out = fsdp_model(*inp)
    out.sum().backward()

    handles = _get_fsdp_handles(fsdp_model)
    assert handles, f"{where}: no FSDP handles"
    for handle in handles:
        assert handle.flat_param.dtype == torch.float16, f"{where}: {handle.flat_param.dtype}"
        assert handle.flat_param.grad is not None, f"{where}: flat_param.grad is None"
        assert handle.flat_param.grad.dtype == torch.float16, (
            f"{where}: flat_param.grad dtype {handle.flat_param.grad.dtype}"
        )
        assert handle._orig_param_dtype == torch.float16, (
            f"{where}: _orig_param_dtype {handle._orig_param_dtype}"
        )
        # `mixed_precision` takes precedence over the model's dtype, for `param_dtype` and
        # `reduce_dtype` alike.
        if mixed_precision.param_dtype is not None:
            expected_fwd_bwd = mixed_precision.param_dtype
        else:
            expected_fwd_bwd = torch.float16
        assert handle._fwd_bwd_param_dtype == expected_fwd_bwd, (
            f"{where}: _fwd_bwd_param_dtype {handle._fwd_bwd_param_dtype}, "
            f"expected {expected_fwd_bwd}"
        )
        if mixed_precision.reduce_dtype is not None:
            expected_reduce = mixed_precision.reduce_dtype
        elif mixed_precision.reduce_dtype is None and mixed_precision.param_dtype is not None:
            # Special case: the reduce dtype is inferred from the param dtype.
            expected_reduce = mixed_precision.param_dtype
        else:
            expected_reduce = torch.float16
        assert handle._reduce_dtype == expected_reduce, (
            f"{where}: _reduce_dtype {handle._reduce_dtype}, expected {expected_reduce}"
        )

    for param in fsdp_model.parameters():
        assert param.dtype == torch.float16, f"{where}: parameter dtype {param.dtype}"
        if param.grad is not None:
            assert param.grad.dtype == torch.float16, f"{where}: grad dtype {param.grad.dtype}"


def _check_fp16_dtypes() -> int:
    """Every subtest of ``test_fp16_dtypes``; returns the number run."""
    num_run = 0
    for subtest in _subtests(FP16_DTYPES_SUBTESTS):
        _check_fp16_dtypes_case(**copy.deepcopy(subtest))
        num_run += 1
    return num_run


def test_fp16_dtypes() -> None:
    """User-facing parameter/gradient dtypes and the handles' saved dtypes are as expected
    for an fp16 model, possibly with explicit mixed precision (12 subtests)."""
    assert run_on_ranks(WORLD_SIZE, _check_fp16_dtypes) == [12, 12]


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
