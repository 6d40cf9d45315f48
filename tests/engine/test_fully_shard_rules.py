"""FSDP2's rules as torch's ``fully_shard`` has them, each checked against torch's own FSDP2 (or
DDP) on gloo ranks: parameters with fewer rows than ranks, torch's own config objects, when
the root and kept units register unsharded parameters, ``register_fsdp_forward_method`` on
plain modules, and the ``FSDPModule`` methods of torch 2.13 (issue 30)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_on_ranks

D = 5


class FewRows(nn.Module):
    """Parameters of 1, 2, 3 and 5 rows: on 2 to 4 ranks some ranks hold none of them."""

    def __init__(self) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.randn(1, D))  # a start token: 1 row
        self.gate = nn.Parameter(torch.randn(2, D))  # 2 rows
        self.proj = nn.Linear(D, 3)  # 3 rows, and a bias of 3
        self.out = nn.Linear(3, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x + self.start) * torch.sigmoid(self.gate).mean(0)
        return self.out(torch.relu(self.proj(h)))


def _fully_shard(api: str) -> Any:
    if api == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard
    return fully_shard


def _batch(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(4, D, generator=generator)


def _few_rows(api: str) -> nn.Module:
    torch.manual_seed(0)
    model = FewRows()
    if api == "ddp":
        return DDP(model)
    fully_shard = _fully_shard(api)
    fully_shard(model.proj)
    fully_shard(model)
    return model


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _train_few_rows(api: str, steps: int, norm_type: float) -> tuple[list[float], dict[str, Any]]:
    model = _few_rows(api)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(steps):
        loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        if api != "ddp":  # every rank holds a DTensor gradient, empty where it has no rows
            for name, param in model.named_parameters():
                assert isinstance(param.grad, DTensor), name
                rows = torch.chunk(torch.empty(param.shape[0]), dist.get_world_size())
                mine = rows[dist.get_rank()].numel() if dist.get_rank() < len(rows) else 0
                assert param.grad.to_local().shape[0] == mine, name
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05, norm_type=norm_type)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    params = {n.removeprefix("module."): _full(p) for n, p in model.named_parameters()}
    return losses, params


def _few_rows_parity(norm_type: float) -> None:
    ours, our_params = _train_few_rows("fullshard", 5, norm_type)
    ddp, ddp_params = _train_few_rows("ddp", 5, norm_type)
    assert ours == pytest.approx(ddp, rel=1e-5), (ours, ddp)
    for name, value in ddp_params.items():
        torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parameters_with_fewer_rows_than_ranks_train_as_ddp(world_size: int) -> None:
    """Parameters of 1, 2 and 3 rows on 2, 3 and 4 ranks: every rank gets a DTensor gradient
    (empty local tensors included), torch's clip_grad_norm_ runs the same collectives on every
    rank, and 5 AdamW steps match DDP."""
    run_on_ranks(world_size, _few_rows_parity, 2.0)


def _train_few_rows_fsdp1(
    use_orig_params: bool, norm_type: float
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """FSDP1's door on the same model: ``proj`` a unit of its own, clipped by the root's
    ``clip_grad_norm_``; a parameter with no piece on a rank has no gradient there (as
    torch's FSDP1)."""
    from fullshard import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FewRows()
    model.proj = FSDP(model.proj, use_orig_params=use_orig_params)
    wrapped = FSDP(model, use_orig_params=use_orig_params)
    optim = torch.optim.AdamW(wrapped.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(5):
        loss = wrapped(_batch(step)).pow(2).mean()
        loss.backward()
        wrapped.clip_grad_norm_(0.05, norm_type=norm_type)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    with FSDP.summon_full_params(wrapped):
        params = {
            n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
            for n, p in wrapped.named_parameters()
        }
    return losses, params


def _few_rows_parity_fsdp1() -> None:
    for norm_type in (2.0, float("inf")):
        ddp, ddp_params = _train_few_rows("ddp", 5, norm_type)
        for use_orig_params in (False, True):
            ours, our_params = _train_few_rows_fsdp1(use_orig_params, norm_type)
            assert ours == pytest.approx(ddp, rel=1e-5), (use_orig_params, norm_type)
            for name, value in ddp_params.items():
                torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_fsdp1_door_with_fewer_rows_than_ranks_trains_as_ddp(world_size: int) -> None:
    """The FSDP1 door on the same parameters (1 to 3 rows on 2 to 4 ranks), both
    ``use_orig_params``, clipping with norm types 2 and inf: 5 AdamW steps match DDP."""
    run_on_ranks(world_size, _few_rows_parity_fsdp1)


def _few_rows_inf_norm() -> None:
    """The inf-norm where no local gradient is empty (every parameter has a row per rank)."""
    for api in ("fullshard", "ddp"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(D, 4), nn.Linear(4, 2))
        if api == "ddp":
            model = DDP(model)
        else:
            _fully_shard(api)(model[0])
            _fully_shard(api)(model)
        model(_batch(0)).pow(2).sum().backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=float("inf"))
        if api == "fullshard":
            ours, our_grads = _full(norm), [_full(p.grad) for p in model.parameters()]
    torch.testing.assert_close(ours, _full(norm))
    for mine, theirs in zip(our_grads, (p.grad for p in model.parameters())):
        torch.testing.assert_close(mine, theirs)


def test_inf_norm_clips_as_ddp() -> None:
    run_on_ranks(2, _few_rows_inf_norm)


def _save_few_rows(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _few_rows("fullshard")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        model(_batch(step)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _few_rows_state(model, optim)


def _few_rows_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    full = {}
    for name, param in model.named_parameters():
        full[name] = _full(param)
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = _full(optim.state[param][key])
    return full


def _load_few_rows(path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = _few_rows("fullshard")
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batch(0)).sum().backward()  # Adam's state exists before loading into it
    optim.step()
    optim.zero_grad()
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _few_rows_state(model, optim)


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 3), (4, 2)])
def test_dcp_of_parameters_with_fewer_rows_than_ranks(
    saved_on: int, loaded_on: int, tmp_path: Any
) -> None:
    """Saved with empty local shards on some ranks, loaded at another world size: every
    parameter and AdamW moment comes back exactly."""
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(saved_on, _save_few_rows, path)[0]
    loaded = run_on_ranks(loaded_on, _load_few_rows, path)[0]
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


def _fsdp1_few_rows(use_orig_params: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    from fullshard import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    model = FewRows()
    model.proj = FSDP(model.proj, use_orig_params=use_orig_params)
    wrapped = FSDP(model, use_orig_params=use_orig_params)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-2)


def _fsdp1_full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The full parameters and AdamW moments, by parameter name (FULL optimizer state)."""
    from fullshard import FullyShardedDataParallel as FSDP

    full = {name: value.clone() for name, value in model.state_dict().items()}
    osd = FSDP.optim_state_dict(model, optim)
    for name, state in osd["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = state[key].clone()
    return full


def _fsdp1_save_few_rows(path: str, use_orig_params: bool) -> dict[str, torch.Tensor]:
    from fullshard import checkpoint

    model, optim = _fsdp1_few_rows(use_orig_params)
    for step in range(3):
        model(_batch(step)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    checkpoint.save(path, model, optim, step=3)
    return _fsdp1_full_state(model, optim)


def _fsdp1_load_few_rows(path: str, use_orig_params: bool) -> dict[str, torch.Tensor]:
    from fullshard import checkpoint

    model, optim = _fsdp1_few_rows(use_orig_params)
    assert checkpoint.load(path, model, optim)["step"] == 3
    return _fsdp1_full_state(model, optim)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_door_checkpoint_with_fewer_rows_than_ranks(
    use_orig_params: bool, tmp_path: Any
) -> None:
    """The FSDP1 door's sharded checkpoint (DCP) with parameters of 1 to 3 rows, saved on 4
    ranks (some hold no piece of them) and loaded on 3: every parameter and moment exact."""
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(4, _fsdp1_save_few_rows, path, use_orig_params)[0]
    loaded = run_on_ranks(3, _fsdp1_load_few_rows, path, use_orig_params)[0]
    assert saved.keys() == loaded.keys()
    for name, value in saved.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)


# -- torch's own config objects ------------------------------------------------------------


def _torch_configs() -> None:
    from torch.distributed import fsdp as torch_fsdp

    import fullshard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4), nn.Linear(4, 2))
    fullshard.fully_shard(
        model,
        mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16),
        offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False),
    )
    unit = fullshard.fully_shard.state(model)
    assert unit.settings.offload_params  # torch's CPUOffloadPolicy was silently dropped
    assert model(_batch(0)).dtype == torch.bfloat16
    with pytest.raises(TypeError, match="mp_policy must be a MixedPrecisionPolicy"):
        fullshard.fully_shard(nn.Linear(2, 2), mp_policy=torch_fsdp.MixedPrecision())

    wrapped = fullshard.FullyShardedDataParallel(
        nn.Linear(D, 4),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.float16),
        cpu_offload=torch_fsdp.CPUOffload(offload_params=True),
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
    )
    assert wrapped.sharding_strategy is fullshard.ShardingStrategy.SHARD_GRAD_OP
    assert wrapped.mixed_precision.param_dtype == torch.float16
    assert wrapped.cpu_offload.offload_params
    assert wrapped.backward_prefetch is fullshard.BackwardPrefetch.BACKWARD_POST
    with fullshard.FullyShardedDataParallel.state_dict_type(
        wrapped,
        torch_fsdp.StateDictType.SHARDED_STATE_DICT,
        torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True),
    ):
        assert all(isinstance(v, DTensor) for v in wrapped.state_dict().values())
    settings = fullshard.FullyShardedDataParallel.get_state_dict_type(wrapped)
    assert settings.state_dict_type is fullshard.StateDictType.FULL_STATE_DICT


def test_torch_config_objects_are_taken_field_for_field() -> None:
    """Both doors take torch's own MixedPrecisionPolicy, CPUOffloadPolicy, ShardingStrategy,
    MixedPrecision, CPUOffload, BackwardPrefetch, StateDictType and state-dict configs."""
    run_on_ranks(2, _torch_configs)


# -- what is registered after forward -------------------------------------------------------


def _registrations(api: str, reshard_after_forward: bool | None, no_grad: bool) -> list[Any]:
    """Per parameter after one forward: (is a DTensor, its full values)."""
    fully_shard = _fully_shard(api)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4), nn.Linear(4, 2))
    kwargs = (
        {} if reshard_after_forward is None else {"reshard_after_forward": reshard_after_forward}
    )
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
    with torch.set_grad_enabled(not no_grad):
        output = model(_batch(0))
    seen = [(isinstance(p, DTensor), _full(p)) for p in model.parameters()]
    if not no_grad:
        output.sum().backward()
    return seen


def _registered_as_torch() -> None:
    for reshard_after_forward in (None, True, False):
        for no_grad in (False, True):
            ours = _registrations("fullshard", reshard_after_forward, no_grad)
            theirs = _registrations("torch", reshard_after_forward, no_grad)
            assert [s for s, _ in ours] == [s for s, _ in theirs], (reshard_after_forward, no_grad)
            for (_, mine), (_, their) in zip(ours, theirs):
                torch.testing.assert_close(mine, their)


def test_parameters_registered_after_forward_are_torchs() -> None:
    """The root (reshard_after_forward=None) and units given False keep their unsharded
    parameters registered after forward, also under no_grad; True reshards the root too."""
    run_on_ranks(2, _registered_as_torch)


def _kept_across_eval() -> None:
    from fullshard import fully_shard
    from fullshard._comm.collectives import COUNTERS

    model = nn.Sequential(nn.Linear(D, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    fully_shard(model)
    model.set_reshard_after_forward(False)
    with torch.no_grad():
        model(_batch(0))
        COUNTERS.reset()
        model(_batch(1))
    assert COUNTERS.calls["all_gather"] == 0
    assert not isinstance(model[0].weight, DTensor)
    assert all(isinstance(v, DTensor) for v in model.state_dict().values())  # resharded first
    assert isinstance(model[0].weight, DTensor)


def test_set_reshard_after_forward_false_keeps_parameters_across_no_grad_forwards() -> None:
    run_on_ranks(2, _kept_across_eval)


def _forward_method_on_plain_modules() -> None:
    from fullshard import register_fsdp_forward_method

    module = nn.Linear(2, 2)
    register_fsdp_forward_method(module, "forward")  # torch: a no-op, scripts call it anyway
    assert "forward" not in module.__dict__
    from fullshard import fully_shard

    fully_shard(module)
    with pytest.raises(ValueError, match="does not have a method generate"):
        register_fsdp_forward_method(module, "generate")


def test_register_fsdp_forward_method_on_a_plain_module_does_nothing() -> None:
    run_on_ranks(2, _forward_method_on_plain_modules)


# -- the methods of torch 2.13's FSDPModule -------------------------------------------------


class _Comm:
    """A custom all-gather / reduce-scatter (torch's ``Comm`` interface) over c10d."""

    def __init__(self, kind: str) -> None:
        self.kind, self.calls, self.allocations = kind, 0, 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: Any, input_tensor: Any, group: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.kind == "all_gather":
            return dist.all_gather_into_tensor(
                output_tensor, input_tensor, group=group, async_op=kwargs.get("async_op", False)
            )
        return dist.reduce_scatter_tensor(
            output_tensor,
            input_tensor,
            op=kwargs.get("op", dist.ReduceOp.SUM),
            group=group,
            async_op=kwargs.get("async_op", False),
        )


def _train_with_methods(api: str) -> tuple[list[float], list[torch.Tensor], list[int], int]:
    """force-sum reductions, an all-reduce hook doubling the sum, custom collectives, and
    post-accumulate-grad hooks stepping an optimizer per parameter, on torch's or ours."""
    torch.manual_seed(0)
    model = FewRows()
    fully_shard = _fully_shard(api)
    fully_shard(model.proj)
    fully_shard(model)
    hooked: list[int] = []
    for module in (model.proj, model):
        module.set_force_sum_reduction_for_comms(True)  # gloo has no average
        module.set_all_reduce_hook(lambda reduced: (hooked.append(1), reduced.mul_(2)))
    gather, scatter = _Comm("all_gather"), _Comm("reduce_scatter")
    model.proj.set_custom_all_gather(gather)
    model.proj.set_custom_reduce_scatter(scatter)
    optims = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    steps: list[int] = []

    def step_in_backward(param: torch.Tensor) -> None:
        steps.append(1)
        optims[param].step()
        optims[param].zero_grad()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(step_in_backward)
    losses = []
    for step in range(3):
        loss = model(_batch(step)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
    params = [_full(p) for p in model.parameters()]
    return losses, params, [gather.calls, scatter.calls, len(hooked)], len(steps)


def _methods_as_torch() -> None:
    ours = _train_with_methods("fullshard")
    theirs = _train_with_methods("torch")
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5), (ours[0], theirs[0])
    for mine, their in zip(ours[1], theirs[1]):
        torch.testing.assert_close(mine, their, rtol=1e-5, atol=1e-6)
    assert ours[2] == theirs[2] and ours[3] == theirs[3]
    assert ours[2][0] > 0 and ours[2][1] > 0 and ours[3] > 0


def test_reduction_hooks_custom_collectives_and_post_accumulate_hooks_as_torch() -> None:
    """set_force_sum_reduction_for_comms, set_all_reduce_hook (it sees the sum and may change
    it), set_custom_all_gather / set_custom_reduce_scatter (called, and the training is
    torch's), and hooks on the DTensor parameters stepping optimizers in backward."""
    run_on_ranks(2, _methods_as_torch)


class _MaybeSkips(FewRows):
    """``proj`` runs only where ``uses_proj``."""

    def __init__(self, uses_proj: bool) -> None:
        super().__init__()
        self.uses_proj = uses_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = (x + self.start) * torch.sigmoid(self.gate).mean(0)
        if self.uses_proj:
            h = h + self.proj(h).sum(-1, keepdim=True)
        return self.out(h[..., :3])


def _unused(api: str, flag: bool, rank_uses: bool) -> list[bool]:
    """Which parameters have a gradient after a backward in which ``proj`` is skipped on
    every rank, or (``rank_uses``) used on rank 0 only."""
    torch.manual_seed(0)
    model = _MaybeSkips(uses_proj=rank_uses and dist.get_rank() == 0)
    _fully_shard(api)(model)
    if flag:
        model.set_reduce_scatter_unused_params(True)
    model(_batch(0)).sum().backward()
    return [p.grad is not None for p in model.parameters()]


def _unused_as_torch() -> None:
    for flag in (False, True):
        assert _unused("fullshard", flag, False) == _unused("torch", flag, False), flag
    assert _unused("fullshard", False, False) == [True, True, False, False, True, True]
    # Ranks that disagree: torch needs the flag (else its collectives mismatch); fullshard
    # gives every rank the reduced gradient either way.
    assert _unused("fullshard", False, True) == _unused("torch", True, True)


def test_parameters_without_a_gradient_keep_none_as_torch() -> None:
    """A parameter no rank's backward reached keeps no gradient (AdamW then skips it), unless
    set_reduce_scatter_unused_params(True); see [Note: parameters without a gradient]."""
    run_on_ranks(2, _unused_as_torch)


class _Fails(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise ValueError("a failing forward")
        return self.lin(x)


def _reset_after_failure(api: str) -> list[float]:
    fully_shard = _fully_shard(api)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, D), _Fails(), nn.Linear(D, 1))
    for module in model:
        fully_shard(module)
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        model[1].fail = step == 1
        try:
            loss = model(_batch(step)).sum()
        except ValueError:
            model.reset_iter_state()
            continue
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _reset_as_torch() -> None:
    ours, theirs = _reset_after_failure("fullshard"), _reset_after_failure("torch")
    assert len(ours) == 2 and ours == pytest.approx(theirs, rel=1e-6)
    from fullshard import fully_shard

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(1, 2))
    with pytest.raises(RuntimeError, match="reset_iter_state must be called on the root"):
        model[0].reset_iter_state()


def test_reset_iter_state_after_a_forward_raised() -> None:
    run_on_ranks(2, _reset_as_torch)


def _accumulate(flags: str | None) -> tuple[list[torch.Tensor], dict[str, float]]:
    from fullshard import fully_shard
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = FewRows()
    fully_shard(model.proj)
    fully_shard(model)
    if flags == "unshard_async_op":
        model._set_unshard_async_op(True)
    COUNTERS.reset()
    for micro in range(3):
        if flags == "is_last_backward":
            model.set_is_last_backward(micro == 2)
        model(_batch(micro)).sum().backward()
    return [_full(p.grad) for p in model.parameters()], dict(COUNTERS.calls)


def _flag_changes_nothing(flag: str) -> None:
    plain, plain_calls = _accumulate(None)
    flagged, flagged_calls = _accumulate(flag)
    assert plain_calls == flagged_calls
    for a, b in zip(plain, flagged):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("flag", ["is_last_backward", "unshard_async_op"])
def test_set_is_last_backward_and_unshard_async_op_change_nothing_observable(flag: str) -> None:
    """fullshard's backward always ends with its gradients reduced into ``.grad``, and its
    all-gathers have no stream of their own: the same gradients and the same collectives
    with or without set_is_last_backward, or torch's _set_unshard_async_op(True) (which
    torch's test_train_parity_multi_group_unshard_async_op calls)."""
    run_on_ranks(2, _flag_changes_nothing, flag)


class _Event:
    """Stands in for an accelerator's event recorded after an optimizer step."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1


def _other_methods() -> None:
    import fullshard
    from fullshard import DataParallelMeshDims, fully_shard, share_comm_ctx

    model = FewRows()
    fully_shard(model.proj)
    fully_shard(model)
    with pytest.warns(DeprecationWarning, match="Use `set_gradient_divide_factor` instead"):
        model.set_reduce_scatter_divide_factor(4.0)
    assert fully_shard.state(model).handle.gradient_divide_factor == 4.0
    model.set_reduce_scatter_max_input_buffers(2)
    with pytest.raises(TypeError, match="max_input_buffers must be an int, got bool"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="max_input_buffers must be a positive int, got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    with pytest.warns(UserWarning, match="ignores set_allocate_memory_from_process_group"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    model.set_custom_all_gather(_Comm("all_gather"))  # replaces it, as in torch; then refused
    with pytest.raises(AssertionError, match="cannot be used with set_custom_all_gather"):
        model.set_allocate_memory_from_process_group_for_comm(True)
    for method, args in [
        ("set_symm_mem_for_comm", ()),
        ("set_separate_reduce_scatter_group", ()),
    ]:
        with pytest.raises(NotImplementedError, match=f"FSDPModule.{method} is not implemented"):
            getattr(model, method)(*args)
    share_comm_ctx([model, model.proj])
    with pytest.raises(ValueError, match="Expects list of FSDPModules"):
        share_comm_ctx([model, nn.Linear(2, 2)])
    scalar = nn.Linear(2, 2)
    scalar.register_parameter("scalar_p", nn.Parameter(torch.tensor(1.0)))
    with pytest.raises(ValueError, match="Change scalar_p to a 1D tensor with numel equal to 1"):
        fully_shard(scalar)
    channels_last = nn.Conv2d(8, 8, 3).to(memory_format=torch.channels_last)
    with pytest.raises(NotImplementedError, match="does not support non-contiguous parameters"):
        fully_shard(channels_last)
    with pytest.raises(ValueError, match="At least one of shard or replicate"):
        DataParallelMeshDims()
    with pytest.raises(NotImplementedError, match="dp_mesh_dims"):
        fully_shard(nn.Linear(2, 2), dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    event = _Event()  # torch.Event cannot be recorded on the CPU
    model.set_post_optim_event(event)
    model(_batch(0)).sum().backward()
    model(_batch(1)).sum().backward()
    assert event.waits == 1  # waited for at the next forward, then discarded
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fullshard.FSDPModule._orig_cls_mro_index == 2


def test_the_rest_of_torchs_fsdp_module_methods() -> None:
    run_on_ranks(2, _other_methods)


def test_the_public_surface_is_torchs() -> None:
    """Every public name of torch's ``torch.distributed.fsdp`` and every public method of its
    ``FSDPModule`` exists in fullshard (a stub raises NotImplementedError naming itself)."""
    import inspect

    from torch.distributed import fsdp as torch_fsdp

    import fullshard

    assert [n for n in torch_fsdp.__all__ if not hasattr(fullshard, n)] == []
    public = [n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")]
    assert [n for n in public if not hasattr(fullshard.FSDPModule, n)] == []
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(fullshard.fully_shard).parameters
    assert list(ours) == list(theirs)


# -- sub-meshes and tensor parallel ----------------------------------------------------------


def _build_on(api: str, mesh: Any, tp_mesh: Any, seed: int = 0) -> nn.Module:
    """Two blocks (tensor parallel over ``tp_mesh`` first, if given), then ``fully_shard``
    over ``mesh``."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(seed)
    dim = 6  # the hidden width, 18, splits over 2 TP ranks (torch's TP needs it)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(dim, 3 * dim), nn.ReLU(), nn.Linear(3 * dim, dim)),
        nn.Sequential(nn.Linear(dim, 3 * dim), nn.ReLU(), nn.Linear(3 * dim, dim)),
    )
    for block in model:
        if tp_mesh is not None:
            plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
            parallelize_module(block, tp_mesh, plan)
        _fully_shard(api)(block, mesh=mesh)
    _fully_shard(api)(model, mesh=mesh)
    return model


def _steps(model: nn.Module, optim: torch.optim.Optimizer, mesh: Any, steps: range) -> list[float]:
    losses = []
    data_rank = mesh.get_local_rank(mesh.ndim - 1)
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + data_rank)
        loss = model(torch.randn(4, 6, generator=generator)).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _train_on(
    api: str, mesh: Any, tp_mesh: Any
) -> tuple[list[float], list[torch.Tensor], list[Any]]:
    model = _build_on(api, mesh, tp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = _steps(model, optim, mesh, range(4))
    placements = [(p.device_mesh.mesh_dim_names, p.placements) for p in model.parameters()]
    return losses, [_full(p) for p in model.parameters()], placements


def _composed_as_torch(dims: tuple[str, ...], shape: tuple[int, ...], dp: str, tp: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    tp_mesh = world["tp"] if tp else None
    ours = _train_on("fullshard", world[dp], tp_mesh)
    theirs = _train_on("torch", world[dp], tp_mesh)
    assert ours[2] == theirs[2]  # the same meshes and placements
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5), (ours[0], theirs[0])
    for mine, their in zip(ours[1], theirs[1]):
        torch.testing.assert_close(mine, their, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("dims", "shape", "dp", "tp"),
    [
        (("pp", "dp"), (2, 2), "dp", False),
        (("dp", "tp"), (2, 2), "dp", True),
    ],
    ids=["pp2-dp2-sub-mesh", "dp2-tp2"],
)
def test_sub_meshes_and_tensor_parallel_train_as_torch(
    dims: tuple[str, ...], shape: tuple[int, ...], dp: str, tp: bool
) -> None:
    """On 4 ranks: fully_shard over the "dp" rows of a (pp, dp) mesh (each row its own data
    parallel group), and over "dp" of a (dp, tp) mesh after ColwiseParallel / RowwiseParallel
    (parameters then DTensors on both dims with torch's placements, _StridedShard included):
    the same losses and parameters as torch's FSDP2 (+ TP) on the same meshes."""
    run_on_ranks(4, _composed_as_torch, dims, shape, dp, tp)


def _checkpoint_interchange(path: str, saver: str, loader: str) -> None:
    """``saver``'s FSDP2 + TP trains 2 steps and saves model and optimizer through torch's
    ``get_state_dict`` and DCP; ``loader``'s, built from other weights, loads them with
    ``set_state_dict``; both train 2 more steps to the same losses and parameters."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh, tp_mesh = world["dp"], world["tp"]
    first = _build_on(saver, mesh, tp_mesh)
    first_optim = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _steps(first, first_optim, mesh, range(2))
    model_state, optim_state = get_state_dict(first, first_optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    expected = _steps(first, first_optim, mesh, range(2, 4))

    second = _build_on(loader, mesh, tp_mesh, seed=1)
    second_optim = torch.optim.AdamW(second.parameters(), lr=1e-2)
    model_state, optim_state = get_state_dict(second, second_optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        second, second_optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    assert _steps(second, second_optim, mesh, range(2, 4)) == pytest.approx(expected, rel=1e-5)
    for mine, theirs in zip(second.parameters(), first.parameters()):
        torch.testing.assert_close(_full(mine), _full(theirs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("saver", "loader"), [("torch", "fullshard"), ("fullshard", "torch")], ids=lambda a: a
)
def test_tensor_parallel_checkpoints_interchange_with_torch(
    saver: str, loader: str, tmp_path: Any
) -> None:
    """On a (dp 2, tp 2) mesh: a checkpoint torch's FSDP2 + TP writes resumes on
    fullshard's, and the reverse, each continuing as the run that saved it."""
    run_on_ranks(4, _checkpoint_interchange, str(tmp_path / "ckpt"), saver, loader)


def _other_dims_kept_over_k_ranks() -> None:
    from torch.distributed.tensor import Shard

    from fullshard import fully_shard

    with pytest.raises(NotImplementedError, match="reshard_after_forward as an int is not"):
        fully_shard(
            nn.Linear(4, 8), reshard_after_forward=2, shard_placement_fn=lambda p: Shard(p.ndim - 1)
        )


def test_reshard_to_k_ranks_with_other_shard_dims_is_refused() -> None:
    """reshard_after_forward=2 on 4 ranks with parameters sharded on their last dim: a
    NotImplementedError naming the alternatives, not a wrong post-forward shard."""
    run_on_ranks(4, _other_dims_kept_over_k_ranks)


def _placement_results() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    from fullshard import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    # torch 2.13's result type on the call's own mesh: its placement is used
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    own = ShardPlacementResult(Shard(1), FSDPMeshInfo(mesh, shard_mesh_dim=0))
    fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: own if p.ndim == 2 else None)
    assert model[0].weight.placements == (Shard(1),) and model[0].bias.placements == (Shard(0),)
    assert model[0].weight.to_local().shape == (6, 2)
    # a mesh fully_shard cannot shard over: refused, naming the parameter and the fix
    mesh_2d = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "edp"))
    odd = ShardPlacementResult(Shard(0), FSDPMeshInfo(mesh_2d, shard_mesh_dim=0))
    experts = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"'1\.weight' on mesh .* shard_mesh_dim=0 and"):
        fully_shard(
            experts, mesh=mesh, shard_placement_fn=lambda p: odd if p is experts[1].weight else None
        )


def test_shard_placement_results_are_honoured_and_unshardable_meshes_refused() -> None:
    """torch 2.13's ``ShardPlacementResult`` from ``shard_placement_fn``: its placement is
    honoured on the call's mesh; a mesh fully_shard cannot shard over (a dim of a 2-D mesh
    without its replicate dim) is a ValueError naming the parameter and the meshes it takes
    (before: a ValueError calling the result an invalid placement)."""
    run_on_ranks(2, _placement_results)


class _Attention(nn.Module):
    """Causal self-attention whose projections tensor parallel splits by heads: the head
    count is what the local width holds (all heads unsplit, half of them on each of 2 TP
    ranks)."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        )
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class _SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class _Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = _Attention(dim, head_dim=4)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = _SwiGLU(dim, 3 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class _Llama(nn.Module):
    VOCAB, DIM = 40, 16

    def __init__(self, tied: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, self.DIM)
        self.layers = nn.ModuleList(_Block(self.DIM) for _ in range(2))
        self.norm = nn.RMSNorm(self.DIM)
        self.output = nn.Linear(self.DIM, self.VOCAB, bias=False)
        if tied:
            self.output.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def _llama_tokens(step: int, data_rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + data_rank)
    return torch.randint(0, _Llama.VOCAB, (2, 9), generator=generator)


def _llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _llama_dp_tp(
    api: str, tied: bool, steps: int, hsdp: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    if hsdp:  # 8 ranks: HSDP (replicate 2, shard 2) x TP 2, fully_shard on the 2-D sub-mesh
        world = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_rep", "dp_shard", "tp"))
        dp = world["dp_rep", "dp_shard"]
    else:
        world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp = world["dp"]
    data_rank = dist.get_rank() // 2  # tp is the innermost dim
    model = _Llama(tied)
    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    shard = _fully_shard(api)
    for layer in model.layers:
        parallelize_module(layer, world["tp"], plan)
        shard(layer, mesh=dp)
    shard(model, mesh=dp)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = _llama_loss(model, _llama_tokens(step, data_rank))
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, [_full(p) for p in model.parameters()]


def _llama_parity(tied: bool, hsdp: bool = False) -> None:
    steps = 5
    ours = _llama_dp_tp("fullshard", tied, steps, hsdp)
    theirs = _llama_dp_tp("torch", tied, steps, hsdp)
    assert ours[0] == pytest.approx(theirs[0], rel=1e-5), (ours[0], theirs[0])
    # one process, no parallelism: the mean loss of every data-parallel rank's batch
    reference = _Llama(tied)
    optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    data_ranks = dist.get_world_size() // 2
    data_rank = dist.get_rank() // 2  # tp is the innermost dim
    reference_losses = []
    for step in range(steps):
        losses = [_llama_loss(reference, _llama_tokens(step, r)) for r in range(data_ranks)]
        reference_losses.append(losses[data_rank].item())
        (sum(losses) / data_ranks).backward()
        optim.step()
        optim.zero_grad()
    assert ours[0] == pytest.approx(reference_losses, rel=1e-5), (ours[0], reference_losses)
    for mine, their, ref in zip(ours[1], theirs[1], reference.parameters()):
        torch.testing.assert_close(mine, their, rtol=1e-5, atol=1e-6)
        # the summation order differs from one process's, and Adam normalises a gradient
        # near 0 into a full step: ~1e-5 moves where torch's FSDP2 + TP moves the same
        torch.testing.assert_close(mine, ref.detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_under_dp_and_tensor_parallel_trains_as_torch_and_one_process(tied: bool) -> None:
    """On a (dp 2, tp 2) mesh: a Llama-style model (attention heads split by TP, SwiGLU,
    RMSNorm, tied or untied head) trains 5 AdamW steps to torch's FSDP2 + TP losses and
    parameters, and to a single process's parameters."""
    run_on_ranks(4, _llama_parity, tied)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama_under_hsdp_and_tensor_parallel_trains_as_torch_and_one_process(tied: bool) -> None:
    """On 8 ranks, (dp_replicate 2, dp_shard 2, tp 2): ``fully_shard`` on the 2-D HSDP
    sub-mesh of TP-parallelized blocks trains 5 AdamW steps to torch's losses and
    parameters, and to one process's."""
    run_on_ranks(8, _llama_parity, tied, True)
