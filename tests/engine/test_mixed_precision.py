"""Mixed precision, CPU offload and clip_grad_norm_ semantics beyond the seed ports.

- bf16 parity: FSDP with ``MixedPrecision(param_dtype=bfloat16)`` against a local model
  that applies the same casts by hand (bf16 copy of the fp32 master for compute, bf16
  gradients averaged over ranks, fp32 optimizer step), for every strategy.
- Bytes on the wire: the all-gather carries ``param_dtype`` bytes, the reduction
  ``reduce_dtype`` bytes.
- dtype resolution, ``keep_low_precision_grads``, buffers, input casts, full-precision eval,
  ``_module_classes_to_ignore``, summon_full_params in full precision with writeback.
- CPU offload parity with DDP for every strategy x use_orig_params (5 Adam steps).
- clip_grad_norm_ for a p-norm other than 1, 2 and inf, and on hybrid sharding.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import CPUOffload, MixedPrecision
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._comm.collectives import COUNTERS
from fullshard._engine.unit import handles_in as _get_fsdp_handles
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import (
    HYBRID_STRATEGY_NAMES,
    STRATEGY_NAMES,
    NestedWrappedModule,
    nested_wrap,
    strategy_kwargs,
)
from parity import check_ddp_parity

STRATEGIES = STRATEGY_NAMES + HYBRID_STRATEGY_NAMES
BF16 = torch.bfloat16
BF16_TOL = {"rtol": 1.6e-2, "atol": 1e-5}  # torch.testing's defaults for bfloat16


def _nested_fsdp(strategy: str, **kwargs: Any) -> FSDP:
    torch.manual_seed(0)
    model = NestedWrappedModule()
    kwargs.update(strategy_kwargs(strategy))
    nested_wrap(model, lambda m: FSDP(m, **kwargs))
    return FSDP(model, **kwargs)


# ----------------------------------------------------------------------------------------
# bf16 parity with the same casts done by hand


def _bf16_parity(strategy: str, use_orig_params: bool) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    master = NestedWrappedModule()  # the reference's fp32 master weights
    model = _nested_fsdp(
        strategy, use_orig_params=use_orig_params, mixed_precision=MixedPrecision(BF16)
    )
    lr = 0.1
    ref_optim = torch.optim.SGD(master.parameters(), lr=lr)
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(3):
        (x,) = master.get_input("cpu", rank, step)
        low = copy.deepcopy(master).to(BF16)
        ref_out = low(x.to(BF16))
        ref_out.sum().backward()
        for p_master, p_low in zip(master.parameters(), low.parameters()):
            grad = p_low.grad.div(world)  # reduce in bf16, as reduce_dtype defaults to it
            dist.all_reduce(grad)
            p_master.grad = grad.float()
        out = model(x)
        assert out.dtype == BF16, "compute runs in param_dtype"
        torch.testing.assert_close(out, ref_out, **BF16_TOL)
        out.sum().backward()
        for handle in _get_fsdp_handles(model):
            grad = handle.flat_param.grad
            assert grad is not None and grad.dtype == torch.float32, handle.label
            assert handle.flat_param.dtype == torch.float32, "the shard stays the fp32 master"
        with FSDP.summon_full_params(model):
            before = [p.detach().clone() for p in model.parameters()]
        ref_before = [p.detach().clone() for p in master.parameters()]
        ref_optim.step()
        optim.step()
        with FSDP.summon_full_params(model):
            after = [p.detach().clone() for p in model.parameters()]
        ref_after = [p.detach() for p in master.parameters()]
        # The update isolates the gradient: -lr * grad, compared in bf16's tolerance.
        for i, (b, a, rb, ra) in enumerate(zip(before, after, ref_before, ref_after)):
            torch.testing.assert_close(a - b, ra - rb, **BF16_TOL, msg=f"param {i} step {step}")
        optim.zero_grad()
        ref_optim.zero_grad()


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_bf16_mixed_precision_matches_local_model_with_same_casts(
    strategy: str, use_orig_params: bool
) -> None:
    """Outputs and gradient updates match a local bf16 copy within bf16 tolerance, 3 steps."""
    run_on_ranks(2, _bf16_parity, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# bytes on the wire


def _collective_bytes(mixed_precision: MixedPrecision | None) -> dict[str, float]:
    model = _nested_fsdp("FULL_SHARD", mixed_precision=mixed_precision)
    (x,) = NestedWrappedModule().get_input("cpu", dist.get_rank())
    COUNTERS.reset()
    model(x).sum().backward()
    return dict(COUNTERS.bytes_sent)


def test_all_gather_carries_param_dtype_bytes() -> None:
    """bf16 params halve all-gather bytes; the reduction follows reduce_dtype."""
    fp32 = run_on_ranks(2, _collective_bytes, None)[0]
    bf16 = run_on_ranks(2, _collective_bytes, MixedPrecision(param_dtype=BF16))[0]
    bf16_fp32_reduce = run_on_ranks(
        2, _collective_bytes, MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32)
    )[0]
    assert fp32["all_gather"] > 0
    assert bf16["all_gather"] == fp32["all_gather"] / 2
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"] / 2
    assert bf16_fp32_reduce["all_gather"] == fp32["all_gather"] / 2
    assert bf16_fp32_reduce["reduce_scatter"] == fp32["reduce_scatter"]


# ----------------------------------------------------------------------------------------
# dtype resolution and gradient dtypes


def _handle_dtypes(mixed_precision: MixedPrecision, use_orig_params: bool) -> list[str]:
    model = _nested_fsdp(
        "FULL_SHARD", mixed_precision=mixed_precision, use_orig_params=use_orig_params
    )
    (x,) = NestedWrappedModule().get_input("cpu", dist.get_rank())
    model(x).sum().backward()
    handle = _get_fsdp_handles(model)[0]
    grad_dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    assert len(grad_dtypes) == 1, grad_dtypes
    return [
        str(d)
        for d in (
            handle._orig_param_dtype,
            handle._fwd_bwd_param_dtype,
            handle._reduce_dtype,
            grad_dtypes.pop(),
        )
    ]


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize(
    "mixed_precision,expected",
    [
        (MixedPrecision(param_dtype=BF16), ["float32", "bfloat16", "bfloat16", "float32"]),
        (
            MixedPrecision(param_dtype=BF16, reduce_dtype=torch.float32),
            ["float32", "bfloat16", "float32", "float32"],
        ),
        (
            MixedPrecision(param_dtype=BF16, keep_low_precision_grads=True),
            ["float32", "bfloat16", "bfloat16", "bfloat16"],
        ),
        (MixedPrecision(reduce_dtype=BF16), ["float32", "float32", "bfloat16", "float32"]),
        (  # torch keeps the gradient in param_dtype, not in reduce_dtype
            MixedPrecision(
                param_dtype=torch.float16, reduce_dtype=BF16, keep_low_precision_grads=True
            ),
            ["float32", "float16", "bfloat16", "float16"],
        ),
    ],
    ids=[
        "param_only",
        "fp32_reduce",
        "keep_low_precision_grads",
        "reduce_only",
        "keep_low_precision_grads_other_reduce_dtype",
    ],
)
def test_dtypes_resolve_as_torch(
    mixed_precision: MixedPrecision, expected: list[str], use_orig_params: bool
) -> None:
    """reduce_dtype defaults to param_dtype; .grad is fp32 unless keep_low_precision_grads."""
    results = run_on_ranks(2, _handle_dtypes, mixed_precision, use_orig_params)
    assert [f"torch.{e}" for e in expected] == results[0] == results[1]


# ----------------------------------------------------------------------------------------
# buffers, input casts, full-precision eval


class _Recorder(nn.Module):
    """A linear that records its input dtype and adds a floating-point buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.scale: torch.Tensor
        self.steps: torch.Tensor
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        assert ids.dtype == torch.long, "integer inputs are never cast"
        return self.lin(x.to(self.lin.weight.dtype)) * self.scale  # records, then adapts


class _TwoRecorders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = _Recorder()
        self.second = _Recorder()

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x, ids).float(), ids)


def _buffers_and_inputs(cast_forward_inputs: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    mp = MixedPrecision(
        param_dtype=BF16, buffer_dtype=BF16, cast_forward_inputs=cast_forward_inputs
    )
    module = _TwoRecorders()
    module.second = FSDP(module.second, mixed_precision=mp)  # type: ignore[assignment]
    model = FSDP(module, mixed_precision=mp)
    x, ids = torch.randn(2, 4), torch.arange(2)
    result: dict[str, Any] = {}
    out = model(x, ids)
    out.float().sum().backward()
    first, second = module.first, module.second.module
    result["train"] = (first.seen[-1], second.seen[-1], first.scale.dtype, first.steps.dtype)
    model.eval()
    with torch.no_grad():
        out = model(x, ids)
    result["eval"] = (out.dtype, first.seen[-1], second.scale.dtype)
    model.train()
    model(x, ids)
    result["train_again"] = (first.seen[-1], first.scale.dtype)
    return result


def test_buffers_and_inputs_cast_for_compute() -> None:
    """Root inputs cast to param_dtype; nested units' only with cast_forward_inputs; float
    buffers in buffer_dtype (integer ones untouched); plain eval stays in low precision."""
    by_flag = {flag: run_on_ranks(2, _buffers_and_inputs, flag)[0] for flag in (False, True)}
    assert by_flag[False]["train"] == (BF16, torch.float32, BF16, torch.long)
    assert by_flag[True]["train"] == (BF16, BF16, BF16, torch.long)
    assert by_flag[False]["eval"] == (BF16, BF16, BF16)


class _Seen(nn.Module):
    """Records the dtype of its input, then runs ``body`` on it in fp16 (the compute dtype;
    as it came where ``cast`` is false: a wrapper handing its input on) and ``after`` on the
    body's output in fp32."""

    def __init__(self, body: nn.Module, after: nn.Module | None = None, cast: bool = True) -> None:
        super().__init__()
        self.body, self.after, self.cast = body, after, cast
        self.seen: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(x.dtype)
        out = self.body(x.to(torch.float16) if self.cast else x).float()
        return out if self.after is None else self.after(out)


def _input_dtypes_by_flags(engine: str, cast_forward: bool, cast_root: bool) -> list[str]:
    """The dtypes the root, a nested unit without parameters of its own and a nested unit
    with parameters see, under ``engine``'s FSDP1."""
    if engine == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision

        wrap: Any = functools.partial(TorchFSDP, device_id=torch.device("cpu"))
        policy: Any = TorchMixedPrecision
    else:
        wrap, policy = FSDP, MixedPrecision
    mp = policy(
        param_dtype=torch.float16,
        cast_forward_inputs=cast_forward,
        cast_root_forward_inputs=cast_root,
    )
    torch.manual_seed(0)
    leaf = _Seen(nn.Linear(4, 4))
    bare = _Seen(wrap(leaf, mixed_precision=mp), cast=False)  # no parameters of its own
    root = _Seen(nn.Linear(4, 4), wrap(bare, mixed_precision=mp))
    model = wrap(root, mixed_precision=mp)
    model(torch.randn(2, 4)).sum().backward()
    return [str(m.seen[-1]) for m in (root, bare, leaf)]


@pytest.mark.parametrize("cast_root", [False, True])
@pytest.mark.parametrize("cast_forward", [False, True])
def test_input_casts_by_flags_are_torchs(cast_forward: bool, cast_root: bool) -> None:
    """torch's FSDP1 casts the root's inputs if either flag is set (its root hook by
    ``cast_root_forward_inputs``, every unit's own hook by ``cast_forward_inputs``), and a
    unit without parameters of its own never by ``cast_forward_inputs``. fullshard cast the
    root's by ``cast_root_forward_inputs`` alone, so ``cast_forward_inputs=True,
    cast_root_forward_inputs=False`` fed fp32 inputs to fp16 weights."""
    torchs = run_on_ranks(2, _input_dtypes_by_flags, "torch", cast_forward, cast_root)[0]
    ours = run_on_ranks(2, _input_dtypes_by_flags, "fullshard", cast_forward, cast_root)[0]
    assert ours == torchs, (ours, torchs)


def test_full_precision_eval_with_env_flag() -> None:
    """FSDP_USE_FULL_PREC_IN_EVAL=1: eval computes, casts nothing, in fp32; train returns
    to bf16 (and buffers follow)."""
    result = run_on_ranks(2, _buffers_and_inputs, False, env={"FSDP_USE_FULL_PREC_IN_EVAL": "1"})[0]
    assert result["train"] == (BF16, torch.float32, BF16, torch.long)
    assert result["eval"] == (torch.float32, torch.float32, torch.float32)
    assert result["train_again"] == (BF16, BF16)


class _ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.lin2 = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.bn(self.lin1(x)))


def _batchnorm_in_full_precision() -> None:
    torch.manual_seed(0)
    local = _ConvBN()
    module = copy.deepcopy(local)
    seen: dict[str, torch.dtype] = {}
    module.bn.register_forward_pre_hook(lambda m, args: seen.update(bn_in=args[0].dtype))
    module.lin2.register_forward_pre_hook(lambda m, args: seen.update(lin2_in=args[0].dtype))
    with pytest.warns(UserWarning, match="Both mixed precision and an auto_wrap_policy"):
        model = FSDP(
            module,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            mixed_precision=MixedPrecision(param_dtype=BF16, buffer_dtype=BF16),
        )
    assert isinstance(model.module.bn, FSDP), "BatchNorm became a unit of its own"
    bn_handle = model.module.bn._handle
    assert bn_handle is not None and bn_handle._fwd_bwd_param_dtype == torch.float32
    x = torch.randn(4, 6)
    out = model(x)
    assert seen == {"bn_in": torch.float32, "lin2_in": BF16}, seen
    assert model.module.bn.module.running_mean.dtype == torch.float32
    out.float().sum().backward()
    for handle in _get_fsdp_handles(model):
        grad = handle.flat_param.grad
        assert grad is not None and grad.dtype == torch.float32, handle.label


def test_module_classes_to_ignore_run_in_full_precision() -> None:
    """BatchNorm (the default of _module_classes_to_ignore) is auto-wrapped alone, without
    mixed precision: fp32 inputs, params and buffers, output cast back; torch's warning."""
    run_on_ranks(2, _batchnorm_in_full_precision)


def _summon_in_full_precision(strategy: str, use_orig_params: bool) -> None:
    model = _nested_fsdp(
        strategy, use_orig_params=use_orig_params, mixed_precision=MixedPrecision(BF16)
    )
    (x,) = NestedWrappedModule().get_input("cpu", dist.get_rank())
    out = model(x)  # SHARD_GRAD_OP/NO_SHARD keep bf16 parameters unsharded after forward
    with FSDP.summon_full_params(model):
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32, name
            with torch.no_grad():
                p.fill_(0.25)  # exactly representable in bf16
    out.sum().backward()  # the graph of the forward before summon is intact
    with FSDP.summon_full_params(model):
        assert all(bool((p == 0.25).all()) for p in model.parameters()), "written back"
    out = model(x)
    assert out.dtype == BF16
    # Every layer computes 0.25 * sum(inputs) + 0.25: the last layer's outputs are all equal.
    assert torch.equal(out, out[:, :1].expand_as(out))


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"])
def test_summon_full_params_is_full_precision_and_writes_back(
    strategy: str, use_orig_params: bool
) -> None:
    """Under mixed precision summon shows fp32 parameters; edits reach the fp32 shard."""
    run_on_ranks(2, _summon_in_full_precision, strategy, use_orig_params)


def _invalid_mixed_precision() -> None:
    with pytest.raises(TypeError, match=r"MixedPrecision.param_dtype must be a floating-point"):
        FSDP(nn.Linear(2, 2), mixed_precision=MixedPrecision(param_dtype=torch.int8))
    with pytest.raises(TypeError, match=r"mixed_precision must be a fullshard\.MixedPrecision"):
        FSDP(nn.Linear(2, 2), mixed_precision=torch.float16)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"cpu_offload must be a fullshard\.CPUOffload"):
        FSDP(nn.Linear(2, 2), cpu_offload=True)  # type: ignore[arg-type]


def test_invalid_precision_and_offload_arguments_raise() -> None:
    """Wrong types for mixed_precision / cpu_offload say what was expected."""
    run_on_ranks(2, _invalid_mixed_precision)


# ----------------------------------------------------------------------------------------
# CPU offload


def _offload_parity(strategy: str, use_orig_params: bool) -> None:
    kwargs = {
        **strategy_kwargs(strategy),
        "use_orig_params": use_orig_params,
        "cpu_offload": CPUOffload(offload_params=True),
    }

    def wrap(model: nn.Module) -> nn.Module:
        nested_wrap(model, lambda m: FSDP(m, **kwargs))  # type: ignore[arg-type]
        fsdp = FSDP(model, **kwargs)
        for handle in _get_fsdp_handles(fsdp):
            # The offload path copies to the compute device even when that is the CPU.
            assert handle._offload_params
            assert not any(u.aliases_shard for s in handle.segments for u in s.buffers())
            assert handle.flat_param.device.type == "cpu"
        return fsdp

    check_ddp_parity(NestedWrappedModule, wrap, num_steps=5)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_cpu_offload_matches_ddp(strategy: str, use_orig_params: bool) -> None:
    """CPUOffload(offload_params=True) trains as DDP does, 5 Adam steps, every strategy."""
    run_on_ranks(2, _offload_parity, strategy, use_orig_params)


# ----------------------------------------------------------------------------------------
# clip_grad_norm_ beyond the seed's norm types


def _clip_parity(strategy: str, norm_type: float, max_norm: float) -> None:
    rank = dist.get_rank()
    torch.manual_seed(0)
    local = NestedWrappedModule()
    ddp = DDP(copy.deepcopy(local))
    model = _nested_fsdp(strategy, use_orig_params=True)
    (x,) = local.get_input("cpu", rank)
    ddp(x).sum().backward()
    model(x).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm, norm_type)
    total = model.clip_grad_norm_(max_norm, norm_type)
    torch.testing.assert_close(total, expected)
    with FSDP.summon_full_params(model, with_grads=True):
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=functools.partial(str, name))


@pytest.mark.parametrize("norm_type,max_norm", [(3.0, 0.5), (0.5, 2.0), (float("inf"), 0.1)])
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"])
def test_clip_grad_norm_any_p_matches_torch(
    strategy: str, norm_type: float, max_norm: float
) -> None:
    """Total norm and clipped gradients equal torch.nn.utils.clip_grad_norm_ on DDP."""
    run_on_ranks(2, _clip_parity, strategy, norm_type, max_norm)
