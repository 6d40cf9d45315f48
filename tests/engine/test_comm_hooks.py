"""FSDP1's ``register_comm_hook``: a unit's gradient reduction replaced by the user's hook,
held to torch's FSDP1 on 2 gloo ranks (see [Note: communication hooks] in
``fullshard/_engine/grads.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks

from harness import run_on_ranks


def _scaled_hook(calls: list[tuple[Any, ...]]) -> Any:
    """torch's default reduction of each form, times 0.5, recording how it was called."""

    def hook(state: Any, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
        calls.append((grad.numel(), grad.dtype, None if output is None else output.numel()))
        if output is None:
            default_hooks.allreduce_hook(state, grad)
            grad.mul_(0.5)
        else:
            default_hooks.reduce_scatter_hook(state, grad, output)
            output.mul_(0.5)

    return hook


def _train(engine: str, strategy: str, hook_name: str, precision: bool) -> dict[str, Any]:
    if engine == "torch":
        import torch.distributed.fsdp as api
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        extra: dict[str, Any] = {"device_id": torch.device("cpu")}
    else:
        import fullshard as api  # type: ignore[no-redef]
        from fullshard.wrap import ModuleWrapPolicy  # type: ignore[assignment]

        extra = {}
    torch.manual_seed(0)
    model = api.FullyShardedDataParallel(
        nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3), nn.Linear(3, 1)),
        sharding_strategy=api.ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if precision
        else None,
        **extra,
    )
    calls: list[tuple[Any, ...]] = []
    if hook_name == "scaled":
        hook, state = _scaled_hook(calls), default_hooks.DefaultState(dist.group.WORLD)
    elif hook_name.endswith("compress_hook"):
        hook = getattr(default_hooks, hook_name)
        state = default_hooks.LowPrecisionState(dist.group.WORLD)
    else:
        hook = getattr(default_hooks, hook_name)
        state = default_hooks.DefaultState(dist.group.WORLD)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        model.register_comm_hook(state, hook)
        losses = []
        for step in range(3):
            generator = torch.Generator().manual_seed(10 * step + dist.get_rank())
            loss = model(torch.randn(4, 5, generator=generator)).float().pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    except RuntimeError as error:  # torch's low-precision hooks on the CPU
        return {"error": str(error)}
    with api.FullyShardedDataParallel.summon_full_params(model):
        params = [p.detach().clone() for p in model.parameters()]
    return {"losses": losses, "params": params, "calls": calls}


def _as_torchs(strategy: str, hook_name: str, precision: bool) -> None:
    ours = _train("fullshard", strategy, hook_name, precision)
    theirs = _train("torch", strategy, hook_name, precision)
    assert ours.keys() == theirs.keys(), (ours, theirs)
    if "error" in theirs:
        assert ours["error"] == theirs["error"]
        return
    assert ours["calls"] == theirs["calls"]
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6), (ours, theirs)
    for mine, their in zip(ours["params"], theirs["params"]):
        torch.testing.assert_close(mine, their, rtol=1e-6, atol=1e-7)


CASES = [
    ("FULL_SHARD", "reduce_scatter_hook", False),
    ("SHARD_GRAD_OP", "reduce_scatter_hook", True),
    ("NO_SHARD", "allreduce_hook", False),
    ("FULL_SHARD", "scaled", False),
    ("FULL_SHARD", "scaled", True),
    ("NO_SHARD", "scaled", True),
    ("FULL_SHARD", "bf16_compress_hook", False),
    ("NO_SHARD", "fp16_compress_hook", False),
]


@pytest.mark.parametrize(
    "strategy, hook_name, precision", CASES, ids=[f"{a}-{b}-mp{c}" for a, b, c in CASES]
)
def test_comm_hook_trains_as_torchs(strategy: str, hook_name: str, precision: bool) -> None:
    """torch's default hooks, and a hook of the user's that scales the result (each call's
    gradient and output sizes and dtype recorded), give torch's FSDP1's losses, parameters
    and calls: once per unit per backward, the padded unsharded gradient in
    ``reduce_dtype`` and this rank's shard (NO_SHARD: the gradient alone). torch's
    low-precision hooks fail on the CPU in their own code ("unknown parameter type" from a
    stream call), under both engines alike."""
    run_on_ranks(2, _as_torchs, strategy, hook_name, precision)


def _misuse() -> None:
    import fullshard
    from fullshard.wrap import ModuleWrapPolicy

    model = fullshard.FullyShardedDataParallel(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    state = default_hooks.DefaultState(dist.group.WORLD)
    with pytest.raises(ValueError, match="The communication hook must be callable but got 3"):
        model.register_comm_hook(state, 3)  # type: ignore[arg-type]
    model(torch.randn(2, 4)).sum().backward()  # the root is known after a forward
    with pytest.raises(AssertionError, match="can only be called on a root instance"):
        model.module[0].register_comm_hook(state, default_hooks.reduce_scatter_hook)
    model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    with pytest.raises(AssertionError, match="A communication hook is already registered"):
        model.register_comm_hook(state, default_hooks.reduce_scatter_hook)
    from torch.distributed.device_mesh import init_device_mesh

    hybrid = fullshard.FullyShardedDataParallel(
        nn.Linear(4, 4),
        sharding_strategy=fullshard.ShardingStrategy.HYBRID_SHARD,
        device_mesh=init_device_mesh("cpu", (1, 2)),
    )
    with pytest.raises(AssertionError, match="not supported for hybrid strategies"):
        hybrid.register_comm_hook(state, default_hooks.reduce_scatter_hook)


def test_comm_hook_misuse_raises_torchs_errors() -> None:
    """A hook that is not callable, one registered on an inner unit or twice, or on a
    hybrid-sharded model: torch's errors."""
    run_on_ranks(2, _misuse)
