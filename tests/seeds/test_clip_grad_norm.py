"""``FullyShardedDataParallel.clip_grad_norm_``: a port of torch's FSDP clip-grad-norm tests.

Ports ``test/distributed/fsdp/test_fsdp_clip_grad_norm.py`` (seeds
``002_3ccbbe4e00a56134.txt``, and its older revision ``000_044345d0619846af.txt`` with the
same tests): ``test_non_root``, ``test_ddp_parity`` (all 72 subtests), ``test_low_precision_grads``
(all 24) and ``test_no_gradients`` (both). As in torch, every subtest of a method runs in one
call on the ranks (here 2 gloo ranks on the CPU, through ``harness.run_on_ranks``); each
``_check_*`` function returns how many subtests it ran and the pytest test asserts the count,
so a loop that silently runs nothing fails. The assertions and message regexes are the seed's;
``self.assertEqual`` on tensors is ``torch.testing.assert_close`` with its default tolerances
(those of torch's ``assertEqual``).

Deviations from the seed, and why:

- Device: the seed runs on CUDA/HPU/XPU only (``instantiate_device_type_tests`` with
  ``only_for=("cuda", "hpu", "xpu")`` and ``skip_if_lt_x_gpu(2)``); this port runs on the
  CPU with ``device_id="cpu"``, DDP without ``device_ids``, and ``torch.float16`` kept where the
  seed has it (fp16 forward and backward work on the CPU in this torch). There is no CUDA
  variant: the harness only builds gloo groups with no per-rank device, so the CPU port
  covers the device-independent logic (norm assembly over shard groups, NO_SHARD units,
  offloaded and low-precision gradients); ``tests/engine/test_cuda.py`` covers NCCL.
- ``test_ddp_parity`` is split into three pytest tests, one per ``sharding_strategy``
  (24 subtests each), so a failure points at one strategy and each call stays short; together
  they run the seed's 72 combinations.
- Inputs: common_fsdp's ``get_input`` reseeds the global RNG with the rank, so every step of
  the seed's extra iterations sees the same batch; ours come from ``get_input(device, rank,
  step)`` (the same batch for DDP and FSDP in a step, differing by rank as in the seed, and by
  step). The models are our ``tests/support/models.py`` versions of common_fsdp's, built from seed 0
  (common_fsdp's ``deterministic=True``), with common_fsdp's RECURSIVE wrapping done by hand.
- ``assertWarnsRegex`` / ``assertRaisesRegex`` are ``pytest.warns`` / ``pytest.raises`` with
  the same regexes; ``self.assertEqual(param.grad, orig_grad)`` for a ``None`` gradient is
  ``assert orig_grad is None``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import CPUOffload, MixedPrecision, ShardingStrategy
from fullshard import FullyShardedDataParallel as FSDP
from fullshard.wrap import ModuleWrapPolicy
from harness import run_on_ranks
from models import NestedWrappedModule, TransformerWithSharedParams, nested_wrap
from subtests import run_subtests

WORLD_SIZE = 2
DEVICE = "cpu"
MAX_NORMS = [1, 2.5]
NORM_TYPES = [1, 2, float("inf")]
DDP_PARITY_STRATEGIES: list[ShardingStrategy | str] = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.NO_SHARD,
    "mixed_strategy",
]


# ----------------------------------------------------------------------------------------
# test_non_root


class _NonRootModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 5)
        self.lin2 = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))


def _check_non_root(device: str) -> int:
    model = _NonRootModel().to(device)
    model.lin2 = FSDP(model.lin2)
    fsdp_model = FSDP(model)
    fsdp_model(torch.randn((2, 5), device=device)).sum().backward()
    error_regex = "should only be called on the root FSDP instance"
    with pytest.raises(RuntimeError, match=error_regex):
        fsdp_model.lin2.clip_grad_norm_(max_norm=2)
    return 1


def test_non_root() -> None:
    """``clip_grad_norm_()`` on a non-root FSDP instance raises."""
    counts = run_on_ranks(WORLD_SIZE, _check_non_root, DEVICE)
    assert counts == [1] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_ddp_parity


def _transformer_fsdp(
    sharding_strategy: ShardingStrategy | str, fsdp_kwargs: dict[str, Any]
) -> FSDP:
    """The seed's FSDP model: a NO_SHARD encoder and FULL_SHARD decoder under a FULL_SHARD
    root for "mixed_strategy", else common_fsdp's RECURSIVE TransformerWithSharedParams."""
    if sharding_strategy == "mixed_strategy":
        model = TransformerWithSharedParams(seed=0)
        # Apply `NO_SHARD` to the encoder
        model.transformer.encoder = FSDP(
            model.transformer.encoder,
            sharding_strategy=ShardingStrategy.NO_SHARD,
            **fsdp_kwargs,
        )
        # Apply `FULL_SHARD` to the decoder
        model.transformer.decoder = FSDP(
            model.transformer.decoder,
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            **fsdp_kwargs,
        )
        # FSDP's `clip_grad_norm_()` is not a static method: the root must be FSDP
        return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, **fsdp_kwargs)
    fsdp_kwargs = dict(fsdp_kwargs)
    fsdp_kwargs.update(
        {
            "sharding_strategy": sharding_strategy,
            "auto_wrap_policy": ModuleWrapPolicy(
                {
                    TransformerEncoderLayer,
                    TransformerDecoderLayer,
                }
            ),
        }
    )
    return FSDP(TransformerWithSharedParams(seed=0), **fsdp_kwargs)


def _test_ddp_parity(
    device: str,
    max_norm: float,
    norm_type: float,
    sharding_strategy: ShardingStrategy | str,
    use_orig_params: bool,
    offload_params: bool,
) -> None:
    rank = dist.get_rank()
    local_model = TransformerWithSharedParams(seed=0).to(device)
    ddp_model = DDP(local_model)
    fsdp_kwargs = {
        "cpu_offload": CPUOffload(offload_params=offload_params),
        "use_orig_params": use_orig_params,
        "device_id": device,
    }
    fsdp_model = _transformer_fsdp(sharding_strategy, fsdp_kwargs)
    LR = 1e-2
    ddp_optim = torch.optim.Adam(ddp_model.parameters(), lr=LR)
    fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=LR)
    LARGE_FACTOR = 100
    inp = ddp_model.module.get_input(device, rank=rank, step=0)
    for model in (ddp_model, fsdp_model):
        out = model(*inp)
        loss = model.module.get_loss(inp, out)
        loss.backward()
    # Multiply gradients by a large factor to ensure that gradients will
    # actually be clipped
    for param in itertools.chain(ddp_model.parameters(), fsdp_model.parameters()):
        if param.grad is not None:  # gradients may be `None` for `use_orig_params=True`
            param.grad *= LARGE_FACTOR
    orig_ddp_grads = [param.grad.detach().clone() for param in ddp_model.parameters()]
    orig_fsdp_grads = [
        param.grad.detach().clone() if param.grad is not None else None
        for param in fsdp_model.parameters()
    ]
    ddp_total_norm = torch.nn.utils.clip_grad_norm_(
        ddp_model.parameters(),
        max_norm=max_norm,
        norm_type=norm_type,
    )
    fsdp_total_norm = fsdp_model.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)
    torch.testing.assert_close(ddp_total_norm, fsdp_total_norm)
    # Check that the gradients were modified by `clip_grad_norm_()`
    for param, orig_grad in zip(ddp_model.parameters(), orig_ddp_grads, strict=True):
        assert not torch.equal(param.grad, orig_grad)
    for param, orig_grad in zip(fsdp_model.parameters(), orig_fsdp_grads, strict=True):
        if param.grad is None:
            assert orig_grad is None
        else:
            assert not torch.equal(param.grad, orig_grad)
    # Run an optimizer step to ensure gradients matched after clipping
    ddp_optim.step()
    fsdp_optim.step()
    with FSDP.summon_full_params(fsdp_model):
        for (n1, p1), (n2, p2) in zip(
            ddp_model.module.named_parameters(),
            fsdp_model.named_parameters(),
            strict=True,
        ):
            assert n1 == n2
            torch.testing.assert_close(p1, p2)
    if offload_params:
        # As in the seed: torch skips the further iterations with offloading
        # (https://github.com/pytorch/pytorch/issues/89133, CPU vs GPU gradient drift).
        return
    # Run a few more iterations (not too many: https://github.com/pytorch/pytorch/issues/89136)
    for i in range(3):
        set_to_none = i % 2 == 0  # exercise both
        ddp_optim.zero_grad(set_to_none=set_to_none)
        fsdp_optim.zero_grad(set_to_none=set_to_none)
        inp = ddp_model.module.get_input(device, rank=rank, step=i + 1)
        for model in (ddp_model, fsdp_model):
            out = model(*inp)
            out.sum().backward()
        ddp_total_norm = torch.nn.utils.clip_grad_norm_(
            ddp_model.parameters(),
            max_norm=max_norm,
            norm_type=norm_type,
        )
        fsdp_total_norm = fsdp_model.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)
        torch.testing.assert_close(ddp_total_norm, fsdp_total_norm)
        ddp_optim.step()
        fsdp_optim.step()


def _check_ddp_parity(device: str, sharding_strategy: ShardingStrategy | str) -> int:
    return run_subtests(
        {
            "device": [device],
            "max_norm": MAX_NORMS,
            "norm_type": NORM_TYPES,
            "sharding_strategy": [sharding_strategy],
            "use_orig_params": [False, True],
            "offload_params": [False, True],
        },
        _test_ddp_parity,
    )


@pytest.mark.parametrize(
    "sharding_strategy",
    DDP_PARITY_STRATEGIES,
    ids=lambda s: s if isinstance(s, str) else s.name,
)
def test_ddp_parity(sharding_strategy: ShardingStrategy | str) -> None:
    """FSDP's ``clip_grad_norm_()`` matches ``torch.nn.utils.clip_grad_norm_`` under DDP in
    full precision: same total norm, gradients clipped, same parameters after Adam steps
    (max_norm x norm_type x use_orig_params x offload_params for one strategy)."""
    counts = run_on_ranks(WORLD_SIZE, _check_ddp_parity, DEVICE, sharding_strategy, timeout=300)
    assert counts == [len(MAX_NORMS) * len(NORM_TYPES) * 2 * 2] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_low_precision_grads


def _test_low_precision_grads(
    device: str,
    max_norm: float,
    norm_type: float,
    sharding_strategy: ShardingStrategy,
    use_orig_params: bool,
) -> None:
    fsdp_kwargs = {
        "sharding_strategy": sharding_strategy,
        "use_orig_params": use_orig_params,
        "mixed_precision": MixedPrecision(
            param_dtype=torch.float16,
            reduce_dtype=torch.float16,
            keep_low_precision_grads=True,
        ),
        "device_id": device,
    }
    # common_fsdp's NestedWrappedModule.init(RECURSIVE, fsdp_kwargs): inner units, no root
    model = NestedWrappedModule(seed=0).to(device)
    nested_wrap(model, lambda module: FSDP(module, **fsdp_kwargs))
    fsdp_model = FSDP(model, **fsdp_kwargs)
    inp = fsdp_model.module.get_input(device, rank=dist.get_rank(), step=0)
    out = fsdp_model(*inp)
    out.sum().backward()
    for param in fsdp_model.parameters():
        if param.grad is not None:
            assert param.grad.dtype == torch.float16
    total_norm = fsdp_model.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)
    # Check that the total norm is in FP16 to match the gradient dtype
    assert total_norm.dtype == torch.float16
    # As a best effort, check that each gradient has norm at most the max
    # norm (since DDP does not support mixed precision natively, we cannot
    # directly compare for parity)
    for param in fsdp_model.parameters():
        if param.grad is not None:
            assert torch.linalg.vector_norm(param.grad, norm_type).item() <= max_norm


def _check_low_precision_grads(device: str) -> int:
    return run_subtests(
        {
            "device": [device],
            "max_norm": MAX_NORMS,
            "norm_type": NORM_TYPES,
            "sharding_strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD],
            "use_orig_params": [False, True],
        },
        _test_low_precision_grads,
    )


def test_low_precision_grads() -> None:
    """With fp16 gradients kept (``keep_low_precision_grads``), the total norm is fp16 and
    each clipped gradient's norm is at most ``max_norm``."""
    counts = run_on_ranks(WORLD_SIZE, _check_low_precision_grads, DEVICE)
    assert counts == [len(MAX_NORMS) * len(NORM_TYPES) * 2 * 2] * WORLD_SIZE


# ----------------------------------------------------------------------------------------
# test_no_gradients


def _test_no_gradients(device: str, use_orig_params: bool) -> None:
    rank = dist.get_rank()
    lin_module = nn.Linear(24, 24)
    mixed_precision_config = MixedPrecision(
        param_dtype=torch.float16,
        reduce_dtype=torch.float32,
        buffer_dtype=torch.float32,
    )
    fsdp_module = FSDP(
        lin_module,
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=mixed_precision_config,
        device_id=device,
        use_orig_params=use_orig_params,
    )
    inp = torch.randn(32, 24, device=device)
    fsdp_module(inp)
    with pytest.warns(
        UserWarning,
        match="on rank "
        rf"{rank} with no gradients -- returning the total "
        "norm in the default dtype torch.float32",
    ):
        total_norm = fsdp_module.clip_grad_norm_(1)
    assert total_norm.dtype == torch.float32
    torch.testing.assert_close(total_norm, torch.tensor(0.0, device=device))


def _check_no_gradients(device: str) -> int:
    return run_subtests(
        {"device": [device], "use_orig_params": [False, True]},
        _test_no_gradients,
    )


def test_no_gradients() -> None:
    """With no gradients, ``clip_grad_norm_()`` warns (naming the rank) and returns a
    float32 scalar zero."""
    counts = run_on_ranks(WORLD_SIZE, _check_no_gradients, DEVICE)
    assert counts == [2] * WORLD_SIZE
