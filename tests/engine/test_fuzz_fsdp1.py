"""The FSDP1 door fuzzed against torch's own ``FullyShardedDataParallel``: the models and
configurations of ``test_fuzz`` (which checks parity with DDP), here held to torch's
engine on what DDP has no counterpart for. Each example trains 3 SGD steps with torch's
FSDP1, then with fullshard's, from the same weights: the losses, the ``FULL_STATE_DICT``
model state, the full optimizer state (``FSDP.optim_state_dict``) and the original
parameters' gradients under ``use_orig_params`` must agree, or both engines must raise
the same error (fullshard's text is torch's with where and how to fix after it).

CPU offload is not drawn: torch's FSDP1 pins host memory, which needs a GPU. Gradients are
compared full (``summon_full_params(with_grads=True)``): the shards' layouts differ under
``use_orig_params``, where torch pads each parameter to a 16-byte boundary of the compute
dtype inside its flat parameter and fullshard does not (docs/conformance.md).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import pytest
import torch
from hypothesis import assume, event, given
from hypothesis import strategies as st
from test_fuzz import Block, ConfigSpec, Tree, TreeSpec, config_specs_with, tree_specs
from test_fuzz_fully_shard import _fuzz_settings, _same_error
from torch import nn

from harness import run_on_ranks

EXAMPLES = int(os.environ.get("FULLSHARD_FUZZ_EXAMPLES", "40"))

configs = config_specs_with(offload=st.just(False))


BEYOND_TORCH = ("ValueError: Must flatten tensors with uniform `requires_grad`",)
"""torch's errors for what fullshard trains on purpose: a unit mixing frozen and trainable
parameters without ``use_orig_params`` ([Note: frozen parameters] in flat_param.py; its
parity with DDP is ``test_fuzz``'s)."""


def _wrap(engine: str, model: nn.Module, config: ConfigSpec) -> nn.Module:
    if engine == "fullshard":
        import fullshard as api
        from fullshard import wrap
    else:
        import torch.distributed.fsdp as api  # type: ignore[no-redef]
        from torch.distributed.fsdp import wrap  # type: ignore[no-redef]
    policy: Any = None
    if config.wrap == "blocks":
        policy = wrap.ModuleWrapPolicy({Block})
    elif config.wrap == "size":
        policy = functools.partial(wrap.size_based_auto_wrap_policy, min_num_params=60)
    precision = api.MixedPrecision(param_dtype=torch.float16) if config.mixed_precision else None
    return api.FullyShardedDataParallel(
        model,
        auto_wrap_policy=policy,
        sharding_strategy=api.ShardingStrategy[config.strategy],
        use_orig_params=config.use_orig_params,
        mixed_precision=precision,
        device_id=torch.device("cpu"),  # torch's FSDP1 asks for an accelerator otherwise
    )


def _train(engine: str, tree: TreeSpec, config: ConfigSpec) -> dict[str, Any]:
    """Losses, full model and optimizer state, last gradients; or the error raised."""
    if engine == "fullshard":
        from fullshard import FullyShardedDataParallel as FSDP
        from fullshard import StateDictType
    else:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP  # type: ignore[assignment]
        from torch.distributed.fsdp import StateDictType  # type: ignore[assignment]
    torch.manual_seed(tree.seed)
    model = Tree(tree)
    try:
        fsdp = _wrap(engine, model, config)
        optim = torch.optim.SGD(fsdp.parameters(), lr=0.05, momentum=0.9)
        losses, grads = [], {}
        for step in range(3):
            (x,) = model.get_input("cpu", torch.distributed.get_rank(), step)
            loss = model.get_loss((x,), fsdp(x))
            loss.backward()
            losses.append(loss.item())
            if config.use_orig_params:  # full gradients: the shard layouts differ (below)
                with FSDP.summon_full_params(fsdp, with_grads=True):
                    grads = {  # frozen ones: torch shows zeros there, fullshard None
                        name: None if p.grad is None else p.grad.detach().float().clone()
                        for name, p in fsdp.named_parameters()
                        if p.requires_grad
                    }
            optim.step()
            optim.zero_grad()
        with FSDP.state_dict_type(fsdp, StateDictType.FULL_STATE_DICT):
            state = {name: value.float().clone() for name, value in fsdp.state_dict().items()}
        optim_state = FSDP.optim_state_dict(fsdp, optim)
    except Exception as error:  # noqa: BLE001: the outcome compared with torch's
        return {"error": f"{type(error).__name__}: {error}"}
    for name, values in optim_state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                state[f"optim {name} {key}"] = value.float().clone()
    return {"losses": losses, "state": state, "grads": grads}


def _compare(tree: TreeSpec, config: ConfigSpec) -> str:
    theirs = _train("torch", tree, config)
    ours = _train("fullshard", tree, config)
    if "error" in theirs and "error" not in ours and theirs["error"].startswith(BEYOND_TORCH):
        return "beyond torch: " + theirs["error"][:40]
    if "error" in theirs or "error" in ours:
        assert _same_error(ours.get("error"), theirs.get("error")), (theirs, ours)
        return "error: " + theirs["error"][:60]
    tolerance = 5e-3 if config.mixed_precision else 1e-5
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=tolerance, abs=tolerance)
    for kind in ("state", "grads"):
        assert ours[kind].keys() == theirs[kind].keys(), (
            kind,
            ours[kind].keys(),
            theirs[kind].keys(),
        )
        for name, expected in theirs[kind].items():
            got = ours[kind][name]
            assert (got is None) == (expected is None), f"{kind} {name}: {got} vs {expected}"
            if expected is not None:
                torch.testing.assert_close(
                    got, expected, rtol=tolerance, atol=tolerance, msg=f"{kind} {name}"
                )
    return "ok"


@_fuzz_settings(EXAMPLES)
@given(tree=tree_specs(), config=configs)
def test_fuzzed_fsdp1_door_trains_as_torchs_fsdp1(tree: TreeSpec, config: ConfigSpec) -> None:
    # Not a weight tied across auto-wrapped blocks: torch's FSDP1 trains that silently
    # differently from DDP, fullshard as DDP (test_fuzz, docs/conformance.md).
    assume(tree.tie is None or config.wrap == "none")
    outcome = run_on_ranks(2, _compare, tree, config, timeout=120)
    assert outcome[0] == outcome[1], outcome
    event(outcome[0])


@_fuzz_settings(max(1, EXAMPLES // 4))
@given(tree=tree_specs(), config=configs)
def test_fuzzed_fsdp1_door_trains_as_torchs_fsdp1_on_three_ranks(
    tree: TreeSpec, config: ConfigSpec
) -> None:
    assume(tree.tie is None or config.wrap == "none")
    outcome = run_on_ranks(3, _compare, tree, config, timeout=120)
    assert len(set(outcome)) == 1, outcome
    event(outcome[0])
