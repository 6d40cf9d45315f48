"""``ShardedGradScaler``: loss scaling whose skip/back-off decision is agreed over the ranks.

Port of torch's ``test/distributed/fsdp/test_fsdp_sharded_grad_scaler.py`` (seed
``001_7ff862e8b83722a8``), every method with the seed's assertions:

- ``TestShardGradScaler``: ``test_grad_scaling``, ``test_scaling_unscaling_sparse`` and
  ``test_inf_gradients_skip_optim_step``, in this process (no process group: a
  ``DummyProcessGroup``, as in the seed).
- ``TestShardedGradScalerParityWithDDP``: ``test_fsdp_ddp_parity_with_grad_scaler`` (all 16
  configs of cpu_offload x sharding_strategy x mixed_precision x use_orig_params, as 16
  pytest cases, each running the seed's init modes) and ``test_sharded_grad_scaler_found_inf``
  (all 4 subtests), on 2 gloo ranks on the CPU through ``harness.run_on_ranks``; each
  ``_check_*`` returns how many subtests it ran and the pytest test asserts the count.

Deviations from the seed, and why:

- Device: the seed runs the unit tests only where CUDA (or XLA) exists and the FSDP tests on
  2+ GPUs; here everything runs on the CPU (CPU fp16 Linear/Transformer forward and backward
  work in this torch), with gloo and ``DDP(model)`` without ``device_ids``. Scalers are built
  with ``device="cpu"``: the seed's default ``"cuda"`` makes ``GradScaler`` (and so
  ``ShardedGradScaler``, as in torch) warn and disable itself where CUDA is missing.
  ``torch.cuda.amp.GradScaler`` is ``torch.amp.GradScaler("cpu")``. The only CUDA-specific
  part, scale on the GPU with gradients on the CPU (offload), is
  ``test_found_inf_on_cpu_and_cuda_grads`` (``requires_cuda_gpus(1)``).
- Init modes of the parity test: CUDA_BEFORE is "model on the CPU before wrapping",
  CUDA_AFTER "``.to('cpu')`` after wrapping" (which still runs FSDP's ``_apply``),
  CUDA_NEVER (offload only) the same as CUDA_BEFORE. The seed's expected error for
  offload + CUDA_AFTER ("... has parameters on cuda") cannot arise on the CPU: the
  parameters stay on the CPU, so that mode trains and is checked like the others.
- ``common_fsdp._test_fsdp_parity`` is written out (:func:`_train_for_several_steps`,
  :func:`_check_fsdp_parity`) with its defaults: ``num_iters=2``, ``save_model=True``,
  SGD(lr=1e-2, momentum=0.9), the DDP reference under autocast when mixed precision is on,
  loss dtypes asserted, losses compared with ``check_dtype=False``, parameters compared
  (``summon_full_params``) only without mixed precision. On the CPU the reference uses
  ``torch.autocast("cpu", dtype=torch.float16)`` (CUDA autocast's default dtype), and its
  loss is summed in fp32: CUDA autocast runs ``sum`` in fp32 (the seed asserts the DDP loss
  is fp32), CPU autocast's op list does not, so the reference applies that cast itself.
- The DDP reference steps with ``torch.amp.GradScaler`` rather than a second
  ``ShardedGradScaler`` (common_fsdp uses the class under test for both sides): DDP's
  gradients are already averaged, so torch's own scaler is an independent reference.
  Observed (as the seed's settings imply): with mixed precision and NestedWrappedModule the
  default ``init_scale=2**16`` overflows the fp16 gradients on both sides at both
  iterations, so both skip their steps and back off twice; the ``use_orig_params`` configs
  (``init_scale=2**11``) step. Real skips on one rank only are checked by the tests below.
- Models and inputs: our ``tests/support/models.py`` versions of common_fsdp's, built from seed 0,
  RECURSIVE wrapping done by hand (``nested_wrap``); inputs from ``get_input(device, rank,
  step)`` (common_fsdp reseeds per call, so its every step sees the same batch).
- ``test_sharded_grad_scaler_found_inf`` compares ``scaled_losses[0]`` with
  ``scaled_losses[1]`` at every iteration, as the seed does (that is always the first
  iteration's pair); added: each iteration's DDP and FSDP scaled losses are compared too.
- ``test_scaling_unscaling_sparse``: the seed's third case builds a new fp16 sparse tensor but
  unscales through the optimizer of the first one, whose gradient still holds the inf of
  the second case, so it does not test the fp16 overflow it describes. The seed's code is
  kept as is; added: the same fp16 gradient through an optimizer that holds it, which finds
  the overflow of coalescing ``2**15 + 2**15`` in fp16.

Added beyond the seed (issue 4's acceptance test and checks of the port's own code):

- ``test_inf_in_one_rank_shard_skips_step_on_every_rank``: an inf in rank 1's gradient shard
  only makes every rank skip the step and halve its scale; the next clean step updates
  the parameters and keeps the scale (strategies x use_orig_params x offload, explicit
  ``unscale_`` + ``clip_grad_norm_`` or not). Also with a fused Adam, whose step takes the
  scaler's other path (``_check_inf_per_device``).
- ``test_plain_grad_scaler_diverges_without_sync``: why the all-reduce exists.
- The plain-op fallbacks of the two AMP kernels match the kernels, and are used when a
  kernel is missing; the scaler's state, errors and multi-device ``scale``.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.parallel import DistributedDataParallel as DDP

import fullshard.sharded_grad_scaler as sgs
from fullshard import CPUOffload, MixedPrecision, ShardedGradScaler, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._engine.runtime import TrainingState
from fullshard._engine.sharding import RESHARD_AFTER_FORWARD
from fullshard.wrap import ModuleWrapPolicy
from harness import requires_cuda_gpus, run_on_ranks
from models import (
    DummyProcessGroup,
    NestedWrappedModule,
    NonUniformReqGradNWM,
    TransformerWithSharedParams,
    nested_wrap,
)
from subtests import run_subtests, zero_model

WORLD_SIZE = 2
CPU = torch.device("cpu")
DEVICE = "cpu"

PARAMS = "cpu_offload,sharding_strategy,mixed_precision,use_orig_params"
CPU_OFFLOAD_CONFIG = [CPUOffload(offload_params=True), CPUOffload(offload_params=False)]
SHARDING_STRATEGY_CONFIG = [ShardingStrategy.SHARD_GRAD_OP, None]
MIXED_PRECISION = ["enable_mixed_precision", None]
USE_ORIG_PARAMS = ["enable_use_orig_params", None]
CONFIGS = list(
    itertools.product(
        CPU_OFFLOAD_CONFIG, SHARDING_STRATEGY_CONFIG, MIXED_PRECISION, USE_ORIG_PARAMS
    )
)
TEST_NAME_MAPPING = {
    str(CPUOffload(offload_params=True)): "offload_true",
    str(CPUOffload(offload_params=False)): "offload_false",
    str(ShardingStrategy.SHARD_GRAD_OP): "shard_grad_op",
    "enable_mixed_precision": "mixed_precision",
    "enable_use_orig_params": "use_orig_params",
}


def _subtest_name(*args: Any) -> str:
    """common_fsdp's ``subtest_name``: the config's values joined, None as "none"."""
    return "_".join(TEST_NAME_MAPPING[str(s)] if s is not None else "none" for s in args)


# ----------------------------------------------------------------------------------------
# TestShardGradScaler (in this process)


def test_grad_scaling() -> None:
    """``scale`` multiplies nested outputs (a tensor, a tuple, a list) and creates the scale
    on the outputs' device."""
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0, process_group=pg, enabled=True)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t1 = torch.full((1,), 8.0, dtype=torch.float32, device="cpu")
    outputs = [t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]]
    outputs = scaler.scale(outputs)
    assert outputs[0] == 16.0 and outputs[1][0] == 8.0 and outputs[1][1] == 16.0
    assert outputs[2][0] == 8.0 and outputs[2][1] == 16.0
    assert scaler._scale is not None and scaler._scale.device == t1.device


@pytest.fixture
def sparse_invariants_checked() -> Iterator[None]:
    """Sparse constructors check their invariants (torch warns when left to its default)."""
    with torch.sparse.check_sparse_tensor_invariants():
        yield


@pytest.mark.usefixtures("sparse_invariants_checked")
def test_scaling_unscaling_sparse() -> None:
    """Sparse gradients are unscaled (coalesced) and checked for inf, and the fp16 overflow
    of summing duplicate entries is found."""
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0, process_group=pg, enabled=True)
    inv_scale = torch.full((1,), 0.5, dtype=torch.float, device="cpu")
    found_inf = torch.full((1,), 0, dtype=torch.float, device="cpu")

    i = torch.tensor([[0, 1, 1], [2, 0, 2]], device="cpu", dtype=torch.int64)
    v = torch.tensor([16.0, 32.0, 64.0], dtype=torch.float, device="cpu")
    s = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float)

    # unscale sparse tensors
    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    torch.testing.assert_close(found_inf, torch.tensor([0.0]))
    torch.testing.assert_close(s1.grad.to_dense(), (s / 2).to_dense())

    # unscale sparse tensor: inf
    v = torch.tensor([16.0, 32.0, float("inf")], dtype=torch.float, device="cpu")
    s1.grad = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float)
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    torch.testing.assert_close(found_inf, torch.tensor([1.0]))

    # unscale sparse tensor: overflow (marked as inf)
    i = torch.tensor([[1, 1, 1], [0, 0, 2]], device="cpu", dtype=torch.int64)
    # coalescing sparse tensor here will cause the value to be Inf
    v = torch.tensor([2**15, 2**15, 1.0], dtype=torch.float16, device="cpu")
    s1 = torch.sparse_coo_tensor(i, v, torch.Size([2, 3]), device="cpu", dtype=torch.float16)
    s1.grad = s1.clone()
    found_inf.zero_()
    found_inf = scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device]
    torch.testing.assert_close(found_inf, torch.tensor([1.0]))

    # Added: the same fp16 gradient through an optimizer that holds it (the seed's `opt`
    # still holds the first tensor, whose gradient has the inf of the previous case).
    fp16_opt = torch.optim.SGD([s1], lr=1.0)
    found_inf = scaler._unscale_grads_(fp16_opt, inv_scale, torch.zeros(1))[s1.device]
    torch.testing.assert_close(found_inf, torch.tensor([1.0]))
    assert s1.grad.is_coalesced() and s1.grad.dtype == torch.float16
    expected = torch.tensor([[0.0, 0.0, 0.0], [float("inf"), 0.0, 0.5]], dtype=torch.float16)
    torch.testing.assert_close(s1.grad.to_dense(), expected)


def test_inf_gradients_skip_optim_step() -> None:
    """``step`` skips ``optimizer.step()`` (and returns None) for an inf gradient."""
    pg = DummyProcessGroup(0, 1)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0, process_group=pg, enabled=True)
    loss = torch.full((1,), 4.0, dtype=torch.float32, device="cpu")
    t0 = torch.tensor([float("inf")], dtype=torch.float32, device="cpu")
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    scaler.scale(loss)
    ret_val = scaler.step(opt)
    assert ret_val is None


# ----------------------------------------------------------------------------------------
# TestShardedGradScalerParityWithDDP.test_fsdp_ddp_parity_with_grad_scaler


def _nested_model(model_cls: type[NestedWrappedModule], fsdp_kwargs: dict[str, Any] | None) -> Any:
    """common_fsdp's ``model_cls.init(NO_FSDP or RECURSIVE, ..., deterministic=True)``."""
    model = model_cls(seed=0)
    if fsdp_kwargs is not None:
        nested_wrap(model, lambda m: FSDP(m, **fsdp_kwargs))
    return model


def _train_for_several_steps(
    model: nn.Module,
    num_steps: int,
    autocast: bool,
    lr: float,
    fsdp_cpu_offload: CPUOffload,
    save_model: bool,
    mixed_precision: MixedPrecision | None,
    scaler: torch.amp.GradScaler,
) -> Tensor:
    """common_fsdp's ``_train_for_several_steps`` with the grad scaler on (no pure fp16)."""
    is_fsdp = isinstance(model, FSDP)
    cpu_offload_params = fsdp_cpu_offload.offload_params
    model_device = next(model.parameters()).device
    inner: Any = model.module
    rank = dist.get_rank()
    # use SGD with momentum instead of Adam, since Adam is scale invariant
    # and this makes it bad for tests
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = torch.zeros(())
    for step in range(num_steps):
        optim.zero_grad()
        with torch.autocast(DEVICE, dtype=torch.float16, enabled=autocast):
            inp = inner.get_input(CPU, rank=rank, step=step)
            if mixed_precision is not None and not is_fsdp:
                inp = tuple(x.half() for x in inp)
            output = model(*inp)
            # Post-forward, if CPU offloading, model params should be on CPU.
            if cpu_offload_params and is_fsdp and model.sharding_strategy in RESHARD_AFTER_FORWARD:
                for p in model.parameters():
                    assert p.device == CPU  # Params should always be on CPU
            # CUDA autocast runs `sum` in fp32; CPU autocast does not (see the docstring).
            loss_output = output.float() if autocast else output
            loss = inner.get_loss(inp, loss_output).to(model_device)
        loss = scaler.scale(loss)
        if mixed_precision is None:
            assert loss.dtype == torch.float32, (
                "loss data type should be float32, as the original parameter data type is float32."
            )
        elif is_fsdp:
            # FSDP loss is fp16, DDP AMP loss is fp32
            assert loss.dtype == mixed_precision.param_dtype
        else:
            assert loss.dtype == torch.float32
        loss.backward()
        # Post-backward, if CPU offloading, model params should be on CPU.
        if cpu_offload_params and is_fsdp:
            for p in model.parameters():
                assert p.device == CPU  # Params should always be on CPU
        # Unscale the gradients and step
        scaler.step(optim)
        # Update the scale factor
        scaler.update()
        # if save_model, simulate save + load.
        if save_model:
            state_dict = {k: v.clone() for k, v in model.state_dict().items()}
            # Zero params, if save/load state_dict did not work properly, this
            # would break the parity test with DDP.
            zero_model(model)
            model.load_state_dict(state_dict)
    if is_fsdp:
        states = {unit._runtime.training_state for unit in FSDP.fsdp_modules(model)}
        assert states == {TrainingState.IDLE}, f"units not IDLE after training: {states}"
    return loss.detach()


def _check_fsdp_parity(
    model_cls: type[NestedWrappedModule],
    device_init_mode: str,
    cpu_offload: CPUOffload,
    sharding_strategy: ShardingStrategy | None,
    mixed_precision: MixedPrecision | None,
    use_orig_params: bool,
    sharded_grad_scaler_kwargs: dict[str, Any] | None,
) -> None:
    """common_fsdp's ``_test_fsdp_parity(model_cls, RECURSIVE, device_init_mode, ...,
    enable_sharded_grad_scaler=True)``: DDP reference first, then FSDP, then compare."""
    lr = 1e-2
    scaler_kwargs = sharded_grad_scaler_kwargs or {}
    ref_model = DDP(_nested_model(model_cls, None))
    ref_loss = _train_for_several_steps(
        ref_model,
        2,
        autocast=mixed_precision is not None,
        lr=lr,
        fsdp_cpu_offload=cpu_offload,
        save_model=False,
        mixed_precision=mixed_precision,
        scaler=torch.amp.GradScaler(DEVICE, **scaler_kwargs),
    )
    ddp_params = list(ref_model.parameters())
    fsdp_kwargs: dict[str, Any] = {
        "cpu_offload": cpu_offload,
        "backward_prefetch": None,
        "sharding_strategy": sharding_strategy,
        "mixed_precision": mixed_precision,
        "forward_prefetch": False,
        "use_orig_params": use_orig_params,
    }
    fsdp_model: nn.Module = FSDP(_nested_model(model_cls, fsdp_kwargs), **fsdp_kwargs)
    if device_init_mode == "CUDA_AFTER":
        fsdp_model = fsdp_model.to(DEVICE)
    if cpu_offload.offload_params:
        for param in fsdp_model.parameters():
            assert param.device == CPU
    fsdp_loss = _train_for_several_steps(
        fsdp_model,
        2,
        autocast=False,
        lr=lr,
        fsdp_cpu_offload=cpu_offload,
        save_model=True,
        mixed_precision=mixed_precision,
        scaler=ShardedGradScaler(DEVICE, **scaler_kwargs),
    )
    if cpu_offload.offload_params:
        for param in fsdp_model.parameters():
            assert param.device == CPU
    with FSDP.summon_full_params(fsdp_model):
        fsdp_unsharded_params = copy.deepcopy(list(fsdp_model.parameters()))
    # Do not check dtype since the reference DDP loss may not be the same
    # dtype as the FSDP loss in the case of mixed precision
    torch.testing.assert_close(ref_loss, fsdp_loss, check_dtype=False)
    # Do not check for parameter parity if using mixed precision (DDP runs under autocast)
    if mixed_precision is None:
        assert len(ddp_params) == len(fsdp_unsharded_params)
        for ddp_param, fsdp_param in zip(ddp_params, fsdp_unsharded_params, strict=True):
            assert ddp_param.device == fsdp_param.device
            torch.testing.assert_close(
                ddp_param, fsdp_param, msg=lambda m: f"FSDP did not match DDP\n{m}"
            )


def _get_init_modes_for_test(cpu_offload: CPUOffload) -> list[str]:
    modes = ["CUDA_AFTER", "CUDA_BEFORE"]
    if cpu_offload.offload_params:
        modes.append("CUDA_NEVER")
    return modes


def _check_ddp_parity_with_grad_scaler(
    cpu_offload: CPUOffload,
    sharding_strategy: ShardingStrategy | None,
    mixed_precision: str | None,
    use_orig_params: str | None,
) -> int:
    init_modes = _get_init_modes_for_test(cpu_offload)
    mp = (
        MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            buffer_dtype=torch.float16,
        )
        if mixed_precision is not None
        else None
    )
    model_cls: type[NestedWrappedModule]
    if use_orig_params == "enable_use_orig_params":
        use_orig = True
        model_cls = NonUniformReqGradNWM
        sharded_grad_scaler_kwargs: dict[str, Any] | None = {"init_scale": 2.0**11}
    else:
        use_orig = False
        model_cls = NestedWrappedModule
        sharded_grad_scaler_kwargs = None
    for device_init_mode in init_modes:
        try:
            _check_fsdp_parity(
                model_cls,
                device_init_mode,
                cpu_offload=cpu_offload,
                sharding_strategy=sharding_strategy,
                mixed_precision=mp,
                use_orig_params=use_orig,
                sharded_grad_scaler_kwargs=sharded_grad_scaler_kwargs,
            )
        except BaseException:
            print(f"rank {dist.get_rank()}: init mode {device_init_mode} failed", flush=True)
            raise
        dist.barrier()
    return len(init_modes)


@pytest.mark.parametrize(PARAMS, CONFIGS, ids=[_subtest_name(*config) for config in CONFIGS])
def test_fsdp_ddp_parity_with_grad_scaler(
    cpu_offload: CPUOffload,
    sharding_strategy: ShardingStrategy | None,
    mixed_precision: str | None,
    use_orig_params: str | None,
) -> None:
    """FSDP + ShardedGradScaler trains like DDP + GradScaler: same last (scaled) loss, and
    without mixed precision the same parameters, for every init mode."""
    counts = run_on_ranks(
        WORLD_SIZE,
        _check_ddp_parity_with_grad_scaler,
        cpu_offload,
        sharding_strategy,
        mixed_precision,
        use_orig_params,
    )
    assert counts == [len(_get_init_modes_for_test(cpu_offload))] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# TestShardedGradScalerParityWithDDP.test_sharded_grad_scaler_found_inf


def _build_model_and_optim(
    cpu_offload: CPUOffload, use_orig_params: bool
) -> tuple[FSDP, torch.optim.Optimizer, DDP, torch.optim.Optimizer]:
    model = TransformerWithSharedParams(seed=0)
    ref_model = DDP(copy.deepcopy(model))
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    fsdp_kwargs = {
        "use_orig_params": use_orig_params,
        "cpu_offload": cpu_offload,
        "auto_wrap_policy": ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer}),
    }
    fsdp_model = FSDP(model, **fsdp_kwargs)
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
    return fsdp_model, optim, ref_model, ref_optim


def _test_sharded_grad_scaler_found_inf(use_orig_params: bool, cpu_offload: CPUOffload) -> None:
    rank = dist.get_rank()
    model, optim, ref_model, ref_optim = _build_model_and_optim(cpu_offload, use_orig_params)
    grad_scaler = ShardedGradScaler(DEVICE, init_scale=2.0)
    ref_grad_scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0)
    scaled_losses: list[Tensor] = []
    for iter in range(10):
        for _model, _optim, _grad_scaler in (
            (ref_model, ref_optim, ref_grad_scaler),
            (model, optim, grad_scaler),
        ):
            module: Any = _model.module
            inp = module.get_input(CPU, rank=rank, step=iter)
            _optim.zero_grad()
            output = _model(*inp)
            loss = module.get_loss(inp, output)
            scaled_loss = _grad_scaler.scale(loss)
            scaled_losses.append(scaled_loss)
            scaled_loss.backward()
            orig_params = [
                param.detach().clone() for param in _model.parameters() if param.grad is not None
            ]
            should_find_inf = iter % 2 == 0
            if should_find_inf and (_model is ref_model or (_model is model and rank == 0)):
                # other ranks should find infs from rank 0 after collectives
                for param in _model.parameters():
                    if param.grad is None:
                        continue
                    param.grad.fill_(float("inf"))
                    break
            _grad_scaler.step(_optim)
            orig_scale = _grad_scaler.get_scale()
            _grad_scaler.update()
            if should_find_inf:
                assert _grad_scaler.get_scale() == orig_scale * _grad_scaler.get_backoff_factor(), (
                    f"rank: {rank} iter: {iter} expect origin scale {orig_scale} "
                    f"to be backed off by {_grad_scaler.get_backoff_factor()} "
                    f"but got {_grad_scaler.get_scale()}"
                )
            else:
                assert _grad_scaler.get_scale() == orig_scale, (
                    f"rank: {rank} iter: {iter} expect same scale {orig_scale} "
                    f"but got {_grad_scaler.get_scale()}"
                )
            for param, orig_param in zip(
                [param for param in _model.parameters() if param.grad is not None],
                orig_params,
                strict=True,
            ):
                if should_find_inf:
                    torch.testing.assert_close(
                        param,
                        orig_param,
                        msg=lambda m, iter=iter: (
                            f"rank: {rank} iter: {iter} expect the same params before "
                            f"and after optim.step\n{m}"
                        ),
                    )
                else:
                    assert not torch.equal(param, orig_param), (
                        f"rank: {rank} iter: {iter} expect the updated params after "
                        f"optim.step but got {param} vs {orig_param}"
                    )
        torch.testing.assert_close(
            scaled_losses[0],
            scaled_losses[1],
            msg=lambda m, iter=iter: f"iter: {iter} {scaled_losses[0]} vs {scaled_losses[1]}\n{m}",
        )
        # Added: this iteration's DDP and FSDP scaled losses, not only the first ones.
        torch.testing.assert_close(
            scaled_losses[-2],
            scaled_losses[-1],
            msg=lambda m, iter=iter: f"iter: {iter}: DDP vs FSDP scaled loss\n{m}",
        )


def _check_sharded_grad_scaler_found_inf() -> int:
    return run_subtests(
        {
            "use_orig_params": [False, True],
            "cpu_offload": [CPUOffload(offload_params=True), CPUOffload(offload_params=False)],
        },
        _test_sharded_grad_scaler_found_inf,
    )


def test_sharded_grad_scaler_found_inf() -> None:
    """An inf in rank 0's gradient only (FSDP) backs off the scale and skips the step on
    every rank, like an inf everywhere under DDP; clean iterations step and keep the scale."""
    counts = run_on_ranks(WORLD_SIZE, _check_sharded_grad_scaler_found_inf)
    assert counts == [4] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# Added: the acceptance test, an inf in one rank's shard only


def _sharded_state(model: nn.Module) -> list[Tensor]:
    """Clones of this rank's parameters as the optimizer sees them (shards)."""
    return [param.detach().clone() for param in model.parameters()]


def _full_state(model: nn.Module) -> list[Tensor]:
    """Clones of the full parameters (a collective)."""
    with FSDP.summon_full_params(model):
        return [param.detach().clone() for param in model.parameters()]


def _has_local_grad(model: nn.Module) -> bool:
    return any(p.grad is not None and p.grad.numel() > 0 for p in model.parameters())


def _inf_into_local_shard(model: nn.Module) -> None:
    """Put one inf into the first non-empty gradient this rank holds."""
    for param in model.parameters():
        if param.grad is not None and param.grad.numel() > 0:
            param.grad.view(-1)[0] = float("inf")
            return
    raise AssertionError(f"rank {dist.get_rank()} holds no gradient to corrupt")


def _scaler_step(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    scaler: ShardedGradScaler,
    step: int,
    inf_on_rank: int | None,
    unscale_and_clip: bool,
) -> None:
    """One training step; ``inf_on_rank`` (after backward) corrupts that rank's shard."""
    inner: Any = model.module
    inp = inner.get_input(CPU, rank=dist.get_rank(), step=step)
    optim.zero_grad()
    scaler.scale(inner.get_loss(inp, model(*inp))).backward()
    if dist.get_rank() == inf_on_rank:
        _inf_into_local_shard(model)
    if unscale_and_clip:
        scaler.unscale_(optim)
        assert isinstance(model, FSDP)
        model.clip_grad_norm_(1.0)
    scaler.step(optim)
    scaler.update()


def _all_equal(tensors: list[Tensor], others: list[Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(tensors, others, strict=True))


def _test_inf_in_one_rank_shard(
    sharding_strategy: ShardingStrategy,
    use_orig_params: bool,
    offload_params: bool,
    unscale_and_clip: bool,
    fused: bool = False,
) -> None:
    rank = dist.get_rank()
    where = (
        f"rank {rank}, {sharding_strategy.name}, use_orig_params={use_orig_params}, "
        f"offload_params={offload_params}, unscale_and_clip={unscale_and_clip}, fused={fused}"
    )
    model = NestedWrappedModule(seed=0)
    fsdp_kwargs = {
        "sharding_strategy": sharding_strategy,
        "use_orig_params": use_orig_params,
        "cpu_offload": CPUOffload(offload_params=offload_params),
    }
    nested_wrap(model, lambda m: FSDP(m, **fsdp_kwargs))
    fsdp_model = FSDP(model, **fsdp_kwargs)
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2, fused=fused)
    scaler = ShardedGradScaler(DEVICE, init_scale=2.0**10)
    # Warm-up step, so the Adam state exists and the check below sees a real skip.
    _scaler_step(fsdp_model, optim, scaler, 0, None, unscale_and_clip)
    assert scaler.get_scale() == 2.0**10, f"{where}: warm-up step changed the scale"

    shards, full = _sharded_state(fsdp_model), _full_state(fsdp_model)
    _scaler_step(fsdp_model, optim, scaler, 1, 1, unscale_and_clip)
    assert scaler.get_scale() == 2.0**9, f"{where}: the scale did not halve"
    assert _all_equal(_sharded_state(fsdp_model), shards), f"{where}: a shard changed"
    assert _all_equal(_full_state(fsdp_model), full), f"{where}: a parameter changed"
    assert scaler._get_growth_tracker() == 0, where

    shards, full = _sharded_state(fsdp_model), _full_state(fsdp_model)
    _scaler_step(fsdp_model, optim, scaler, 2, None, unscale_and_clip)
    assert scaler.get_scale() == 2.0**9, f"{where}: a clean step changed the scale"
    assert scaler._get_growth_tracker() == 1, where
    new_full = _full_state(fsdp_model)
    for old, new in zip(full, new_full, strict=True):
        assert not torch.equal(old, new), f"{where}: a parameter did not change"
    if _has_local_grad(fsdp_model):
        assert not _all_equal(_sharded_state(fsdp_model), shards), f"{where}: no shard changed"
    # Every rank ends with the same scale and the same full parameters.
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (scaler.state_dict(), [p.tolist() for p in new_full]))
    assert all(g == gathered[0] for g in gathered), f"{where}: ranks disagree"


def _check_inf_in_one_rank_shard() -> int:
    return run_subtests(
        {
            "sharding_strategy": [
                ShardingStrategy.FULL_SHARD,
                ShardingStrategy.SHARD_GRAD_OP,
                ShardingStrategy.NO_SHARD,
            ],
            "use_orig_params": [False, True],
            "offload_params": [False, True],
            "unscale_and_clip": [False, True],
        },
        _test_inf_in_one_rank_shard,
    )


def test_inf_in_one_rank_shard_skips_step_on_every_rank() -> None:
    """Issue 4's acceptance test: an inf in rank 1's gradient shard only makes every rank
    skip ``optimizer.step()`` and halve its scale; the next clean step updates every
    parameter and keeps the scale (strategy x use_orig_params x offload x explicit
    ``unscale_`` followed by ``clip_grad_norm_``)."""
    counts = run_on_ranks(WORLD_SIZE, _check_inf_in_one_rank_shard)
    assert counts == [3 * 2 * 2 * 2] * WORLD_SIZE


def _check_inf_in_one_rank_shard_fused_adam() -> int:
    return run_subtests(
        {
            "sharding_strategy": [ShardingStrategy.FULL_SHARD],
            "use_orig_params": [False, True],
            "offload_params": [False],
            "unscale_and_clip": [False, True],
            "fused": [True],
        },
        _test_inf_in_one_rank_shard,
    )


def test_inf_in_one_rank_shard_skips_fused_adam_step_on_every_rank() -> None:
    """The same with ``Adam(fused=True)``: its step unscales in its own kernel, and the
    scaler's check for it (``_check_inf_per_device``) is agreed over the ranks too."""
    counts = run_on_ranks(WORLD_SIZE, _check_inf_in_one_rank_shard_fused_adam)
    assert counts == [2 * 2] * WORLD_SIZE


def _check_plain_grad_scaler_diverges() -> list[float]:
    model = NestedWrappedModule(seed=0)
    fsdp_model = FSDP(model)
    optim = torch.optim.SGD(fsdp_model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler(DEVICE, init_scale=2.0**10)
    inp = model.get_input(CPU, rank=dist.get_rank())
    scaler.scale(fsdp_model(*inp).sum()).backward()
    if dist.get_rank() == 1:
        _inf_into_local_shard(fsdp_model)
    scaler.step(optim)
    scaler.update()
    return [scaler.get_scale()]


def test_plain_grad_scaler_diverges_without_sync() -> None:
    """Why ``ShardedGradScaler`` exists: with ``torch.amp.GradScaler`` only the rank whose
    shard overflowed backs off (and skips); the other steps and keeps its scale."""
    assert run_on_ranks(WORLD_SIZE, _check_plain_grad_scaler_diverges) == [[2.0**10], [2.0**9]]


# ----------------------------------------------------------------------------------------
# Added: the scaler's own code, in this process


def _kernel_cases() -> Iterator[tuple[torch.dtype, list[float]]]:
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for values in ([2.0, -4.0, 0.0], [1.0, float("inf")], [float("nan"), 3.0], [6e4, 1.0]):
            yield dtype, values


@pytest.mark.parametrize("inv_scale_value", [0.5, 4.0])
def test_unscale_fallback_matches_kernel(inv_scale_value: float) -> None:
    """The plain-op unscale/check matches ``_amp_foreach_non_finite_check_and_unscale_``
    (values, found-inf, checking before the multiplication)."""
    for dtype, values in _kernel_cases():
        grads = [torch.tensor(values, dtype=dtype), torch.tensor([1.5, -2.5], dtype=dtype)]
        expected_grads = [g.clone() for g in grads]
        expected_found = torch.zeros(1)
        inv_scale = torch.full((1,), inv_scale_value)
        torch._amp_foreach_non_finite_check_and_unscale_(expected_grads, expected_found, inv_scale)
        found = torch.zeros(1)
        sgs._unscale_and_check_fallback_(grads, found, inv_scale)
        torch.testing.assert_close(found, expected_found, msg=f"{dtype} {values}")
        for grad, expected in zip(grads, expected_grads, strict=True):
            torch.testing.assert_close(grad, expected, equal_nan=True, msg=f"{dtype} {values}")


def test_update_scale_fallback_matches_kernel() -> None:
    """The plain-op scale update matches ``_amp_update_scale_``: back-off on inf, growth at
    the interval, no growth to a non-finite scale."""
    cases = [
        # (scale, tracker, found_inf, growth_interval)
        (4.0, 0, 1.0, 3),
        (4.0, 2, 2.0, 3),
        (4.0, 0, 0.0, 3),
        (4.0, 2, 0.0, 3),
        (4.0, 0, 0.0, 1),
        (3e38, 0, 0.0, 1),
    ]
    for scale_value, tracker_value, found_value, interval in cases:
        scale = torch.tensor(scale_value)
        tracker = torch.tensor(tracker_value, dtype=torch.int32)
        expected_scale, expected_tracker = scale.clone(), tracker.clone()
        found = torch.tensor(found_value)
        torch._amp_update_scale_(expected_scale, expected_tracker, found, 2.0, 0.5, interval)
        sgs._update_scale_fallback_(scale, tracker, found, 2.0, 0.5, interval)
        case = (scale_value, tracker_value, found_value, interval)
        torch.testing.assert_close(scale, expected_scale, msg=f"{case}")
        torch.testing.assert_close(tracker, expected_tracker, msg=f"{case}")


def _missing_kernel(*args: Any, **kwargs: Any) -> None:
    raise NotImplementedError("Could not run this kernel with arguments from this backend")


def test_missing_kernels_fall_back_to_plain_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a device has no AMP kernel, unscale/step/update still work (plain tensor ops)."""
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", _missing_kernel)
    monkeypatch.setattr(torch, "_amp_update_scale_", _missing_kernel)
    scaler = ShardedGradScaler(DEVICE, init_scale=4.0, growth_interval=1)
    param = nn.Parameter(torch.ones(2))
    optim = torch.optim.SGD([param], lr=1.0)
    scaler.scale(param.sum()).backward()
    scaler.step(optim)
    scaler.update()
    torch.testing.assert_close(param.detach(), torch.zeros(2))  # grad 4 / scale 4 = 1
    assert scaler.get_scale() == 8.0  # grown after growth_interval=1 clean step
    param.grad = torch.tensor([float("inf"), 1.0])
    scaler.step(optim)
    scaler.update()
    torch.testing.assert_close(param.detach(), torch.zeros(2))
    assert scaler.get_scale() == 4.0


def test_scale_keeps_dtype_and_device_per_output() -> None:
    """Each scaled output keeps its dtype (an fp16 0-dim loss stays fp16) and device; the
    scale tensor lives on the first output's device."""
    scaler = ShardedGradScaler(DEVICE, init_scale=4.0)
    loss = torch.tensor(3.0, dtype=torch.float16)
    assert scaler.scale(loss).dtype == torch.float16
    cpu_out, meta_out = scaler.scale([torch.ones(2), torch.ones(2, device="meta")])
    assert cpu_out.device == CPU and meta_out.device.type == "meta"
    torch.testing.assert_close(cpu_out, torch.full((2,), 4.0))
    assert scaler._scale is not None and scaler._scale.device == CPU
    lazy = scaler.scale(iter([torch.ones(1)]))
    assert not isinstance(lazy, (list, tuple))
    torch.testing.assert_close(list(lazy), [torch.full((1,), 4.0)])
    with pytest.raises(ValueError, match="outputs must be a Tensor or an iterable of Tensors"):
        scaler.scale([torch.ones(1), 2.0])  # type: ignore[list-item]


def test_fp16_dense_grads_unscaled_and_refused_without_allow_fp16() -> None:
    """fp16 gradients (kept by FSDP in low precision) are unscaled; ``allow_fp16=False``
    refuses them with GradScaler's error."""
    scaler = ShardedGradScaler(DEVICE, init_scale=4.0, process_group=DummyProcessGroup(0, 1))
    param = nn.Parameter(torch.ones(2, dtype=torch.float16))
    param.grad = torch.tensor([8.0, 4.0], dtype=torch.float16)
    optim = torch.optim.SGD([param], lr=1.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optim)
    torch.testing.assert_close(param.grad, torch.tensor([2.0, 1.0], dtype=torch.float16))
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(optim)
    scaler.step(optim)
    with pytest.raises(RuntimeError, match=r"unscale_\(\) is being called after step\(\)"):
        scaler.unscale_(optim)
    with pytest.raises(ValueError, match=r"Attempting to unscale FP16 gradients\."):
        scaler._unscale_grads_(optim, torch.ones(1), torch.zeros(1), allow_fp16=False)


def test_no_gradients_gives_one_flag_on_found_inf_device() -> None:
    """A rank with no gradient (all its shards empty or frozen) still reports one found-inf
    flag, so it joins the all-reduce, and ``step``/``update`` work."""
    scaler = ShardedGradScaler(DEVICE, process_group=DummyProcessGroup(0, 1))
    optim = torch.optim.SGD([nn.Parameter(torch.ones(2))], lr=1.0)
    flags = scaler._unscale_grads_(optim, torch.ones(1), torch.zeros(1))
    assert list(flags) == [CPU]
    scaler.scale(torch.ones(()))
    scaler.step(optim)
    scaler.update()
    assert scaler.get_scale() == 2.0**16


def test_state_dict_round_trip_and_disabled() -> None:
    """``state_dict``/``load_state_dict`` carry scale and tracker; a disabled scaler only
    calls ``optimizer.step()``."""
    scaler = ShardedGradScaler(DEVICE, init_scale=8.0, growth_interval=5)
    param = nn.Parameter(torch.ones(1))
    optim = torch.optim.SGD([param], lr=1.0)
    scaler.scale(param.sum()).backward()
    scaler.step(optim)
    scaler.update()
    state = scaler.state_dict()
    assert state == {
        "scale": 8.0,
        "growth_factor": 2.0,
        "backoff_factor": 0.5,
        "growth_interval": 5,
        "_growth_tracker": 1,
    }
    other = ShardedGradScaler(DEVICE)
    other.load_state_dict(state)
    assert other.state_dict() == state
    assert other.process_group is None  # the default group, resolved when reducing
    disabled = ShardedGradScaler(DEVICE, enabled=False)
    loss = torch.ones(())
    assert disabled.scale(loss) is loss and disabled.get_scale() == 1.0
    param.grad = torch.full((1,), float("inf"))
    disabled.step(optim)
    assert torch.isinf(param).all()  # stepped: nothing was checked
    assert disabled.state_dict() == {}


@requires_cuda_gpus(1)
def test_found_inf_on_cpu_and_cuda_grads() -> None:
    """CUDA: scale on the GPU, gradients on the CPU (parameter offload) and the GPU; every
    device gets a flag, and an inf on the CPU skips the step."""
    scaler = ShardedGradScaler("cuda", init_scale=4.0, process_group=DummyProcessGroup(0, 1))
    cpu_param = nn.Parameter(torch.ones(2))
    cuda_param = nn.Parameter(torch.ones(2, device="cuda"))
    optim = torch.optim.SGD([cpu_param, cuda_param], lr=1.0)
    scaler.scale(torch.ones((), device="cuda"))
    cpu_param.grad = torch.tensor([4.0, float("inf")])
    cuda_param.grad = torch.tensor([4.0, 8.0], device="cuda")
    scaler.step(optim)
    flags = scaler._found_inf_per_device(optim)
    assert {device.type for device in flags} == {"cpu", "cuda"}
    assert all(flag.item() == 1.0 for flag in flags.values())
    scaler.update()
    torch.testing.assert_close(cuda_param.grad, torch.tensor([1.0, 2.0], device="cuda"))
    torch.testing.assert_close(cuda_param.detach(), torch.ones(2, device="cuda"))
    assert scaler.get_scale() == 2.0
