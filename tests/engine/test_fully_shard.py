"""FSDP2's ``fully_shard`` front door on gloo ranks: DTensor parameters, parity with DDP and with
torch's own ``fully_shard``, the ``FSDPModule`` methods, and its errors."""

from __future__ import annotations

import copy
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import run_on_ranks

DIM = 12


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, 2 * DIM + 1)  # 25 rows: uneven on 2, 3 and 4 ranks
        self.fc2 = nn.Linear(2 * DIM + 1, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


class Net(nn.Module):
    """An embedding tied to the output projection, blocks, a norm."""

    def __init__(self, vocab: int = 11, num_blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(num_blocks))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _tokens(step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randint(0, 11, (4, 6), generator=generator)


def _loss(output: torch.Tensor, step: int) -> torch.Tensor:
    target = _tokens(step + 50)
    return nn.functional.cross_entropy(output.float().reshape(-1, 11), target.reshape(-1))


def _shard(model: Net, api: str, mesh: Any, **kwargs: Any) -> Net:
    if api == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def _policies(api: str, mixed: bool, offload: bool) -> dict[str, Any]:
    if api == "fullshard":
        from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import (  # type: ignore[assignment]
            CPUOffloadPolicy,
            MixedPrecisionPolicy,
        )
    kwargs: dict[str, Any] = {}
    if mixed:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    return kwargs


def _train(
    api: str,
    reshard_after_forward: bool | None,
    mixed: bool,
    offload: bool,
    hsdp: bool = False,
    steps: int = 5,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    world = dist.get_world_size()
    if api == "ddp":
        sharded: nn.Module = DDP(model)
    else:
        shape = (2, world // 2) if hsdp else (world,)
        names = ("replicate", "shard") if hsdp else ("shard",)
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        kwargs = _policies(api, mixed, offload)
        if reshard_after_forward is not None:
            kwargs["reshard_after_forward"] = reshard_after_forward
        sharded = _shard(model, api, mesh, **kwargs)
    optim = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    losses = _steps(sharded, optim, range(steps))
    full = {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().clone()
        for name, value in sharded.state_dict().items()
    }
    return losses, {name.removeprefix("module."): value for name, value in full.items()}


def _compare(reshard_after_forward: bool | None, mixed: bool, offload: bool, hsdp: bool) -> None:
    ours, our_params = _train("fullshard", reshard_after_forward, mixed, offload, hsdp)
    theirs, their_params = _train("torch", reshard_after_forward, mixed, offload, hsdp)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)
    for name, value in their_params.items():
        torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-5, msg=name)
    if not mixed:
        ddp, ddp_params = _train("ddp", None, False, False)
        assert ours == pytest.approx(ddp, rel=1e-5, abs=1e-6), (ours, ddp)
        for name, value in ddp_params.items():
            torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-5, msg=name)


def _parity_matrix(test: Any) -> Any:
    """reshard_after_forward x mixed precision x offload, the parity tests' matrix."""
    test = pytest.mark.parametrize("offload", [False, True], ids=["device", "offload"])(test)
    test = pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16"])(test)
    return pytest.mark.parametrize("reshard_after_forward", [None, True, False])(test)


@_parity_matrix
def test_parity_on_two_ranks(
    reshard_after_forward: bool | None, mixed: bool, offload: bool
) -> None:
    """5 Adam steps: the same losses and parameters as torch's fully_shard (and as DDP in
    fp32), for a model with a tied embedding and uneven dim-0 chunks."""
    run_on_ranks(2, _compare, reshard_after_forward, mixed, offload, False)


@_parity_matrix
def test_parity_on_three_ranks(
    reshard_after_forward: bool | None, mixed: bool, offload: bool
) -> None:
    run_on_ranks(3, _compare, reshard_after_forward, mixed, offload, False)


@_parity_matrix
def test_parity_hsdp_on_a_2x2_mesh(
    reshard_after_forward: bool | None, mixed: bool, offload: bool
) -> None:
    run_on_ranks(4, _compare, reshard_after_forward, mixed, offload, True)


def _grads_kept_across_steps(api: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Gradients the user keeps, zeroes in place or drops one by one between backwards."""
    torch.manual_seed(0)
    model = Net()
    if api == "ddp":
        sharded: nn.Module = DDP(model)
    else:
        _shard(model, api, init_device_mesh("cpu", (dist.get_world_size(),)))
        sharded = model
    optim = torch.optim.SGD(sharded.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        for micro in range(2):  # accumulated: no zero_grad between the two
            loss = _loss(sharded(_tokens(2 * step + micro)), 2 * step + micro)
            loss.backward()
            losses.append(loss.item())
        optim.step()
        if step == 0:
            optim.zero_grad(set_to_none=False)  # zeroed in place
        elif step == 1:  # some dropped, some kept: the kept ones add to the next backward
            for name, param in sharded.named_parameters():
                if "blocks.1" in name or "norm" in name:
                    param.grad = None
        else:
            optim.zero_grad()
    full = {
        name.removeprefix("module."): (param.full_tensor() if isinstance(param, DTensor) else param)
        .detach()
        .clone()
        for name, param in sharded.named_parameters()
    }
    return losses, full


def _compare_kept_grads() -> None:
    ours, our_params = _grads_kept_across_steps("fullshard")
    for api in ("torch", "ddp"):
        theirs, their_params = _grads_kept_across_steps(api)
        assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (api, ours, theirs)
        for name, value in their_params.items():
            torch.testing.assert_close(
                our_params[name], value, rtol=1e-5, atol=1e-5, msg=f"{api}: {name}"
            )


def test_gradients_accumulated_zeroed_in_place_or_dropped_one_by_one() -> None:
    """What the user does to the DTensor gradients between backwards is what the next
    backward adds to: accumulation, zero_grad(set_to_none=False), some set to None and
    others kept. The same losses and parameters as torch's fully_shard and as DDP."""
    run_on_ranks(2, _compare_kept_grads)


def _dtensor_parameters() -> None:
    from fullshard import FSDPModule, fully_shard

    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    _shard(model, "fullshard", mesh)
    assert isinstance(model, FSDPModule) and isinstance(model, Net)
    assert type(model).__name__ == "FSDPNet"
    assert isinstance(model.blocks[0], FSDPModule)
    assert fully_shard.state(model.blocks[0]).handle is not None
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [name for name, _ in model.named_parameters()]
    assert names == [name for name, _ in reference.named_parameters()]
    for (name, param), (_, original) in zip(model.named_parameters(), reference.named_parameters()):
        assert isinstance(param, DTensor) and isinstance(param, nn.Parameter), name
        assert param.placements == (Shard(0),) and param.shape == original.shape
        expected = torch.chunk(original.detach(), world, dim=0)
        local = (
            expected[rank] if rank < len(expected) else original.new_empty(0, *original.shape[1:])
        )
        torch.testing.assert_close(param.to_local(), local, rtol=0, atol=0)
        torch.testing.assert_close(param.full_tensor(), original.detach(), rtol=0, atol=0)
    state = model.state_dict()  # no communication: DTensors under the plain module's keys
    assert list(state) == list(reference.state_dict())
    assert all(isinstance(value, DTensor) for value in state.values())
    model(_tokens(0)).sum().backward()
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor), name
        assert param.grad.placements == (Shard(0),)
        assert param.grad.to_local().shape == param.to_local().shape
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.5)
    assert isinstance(norm, (torch.Tensor, DTensor))


def test_parameters_and_gradients_are_dim0_dtensors() -> None:
    run_on_ranks(3, _dtensor_parameters)


def _assert_grads_equal(model: Net, ddp: DDP) -> None:
    for (name, param), other in zip(model.named_parameters(), ddp.parameters()):
        torch.testing.assert_close(
            param.grad.full_tensor(), other.grad, rtol=1e-5, atol=1e-6, msg=name
        )


def _clip_grad_norm_matches_ddp() -> None:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(copy.deepcopy(model))
    _shard(model, "fullshard", init_device_mesh("cpu", (dist.get_world_size(),)))
    for net in (model, ddp):
        _loss(net(_tokens(0)), 0).backward()
    ours = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    theirs = torch.nn.utils.clip_grad_norm_(ddp.parameters(), max_norm=0.1)
    ours = ours.full_tensor() if isinstance(ours, DTensor) else ours
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    _assert_grads_equal(model, ddp)


def test_clip_grad_norm_of_dtensor_gradients_matches_ddp() -> None:
    run_on_ranks(2, _clip_grad_norm_matches_ddp)


def _unshard_reshard_and_gradient_sync() -> None:
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(copy.deepcopy(model))
    _shard(model, "fullshard", init_device_mesh("cpu", (dist.get_world_size(),)))
    block = model.blocks[1]
    handle = block.unshard(async_op=True)
    assert handle is not None
    handle.wait()
    assert not isinstance(block.fc1.weight, DTensor) and block.fc1.weight.shape == (25, DIM)
    torch.testing.assert_close(block.fc1.weight, ddp.module.blocks[1].fc1.weight)
    block.reshard()
    assert isinstance(block.fc1.weight, DTensor)
    # Accumulate two micro-batches without reduce-scatter, then sync on the last.
    model.set_requires_gradient_sync(False)
    with ddp.no_sync():
        _loss(ddp(_tokens(0)), 0).backward()
    _loss(model(_tokens(0)), 0).backward()
    assert all(p.grad is None for p in model.parameters())
    model.set_requires_gradient_sync(True)
    _loss(ddp(_tokens(1)), 1).backward()
    _loss(model(_tokens(1)), 1).backward()
    _assert_grads_equal(model, ddp)


def test_unshard_reshard_and_requires_gradient_sync() -> None:
    run_on_ranks(2, _unshard_reshard_and_gradient_sync)


def _forward_method() -> None:
    """A registered method runs as the module's forward: on its unsharded parameters, its
    output cast to ``output_dtype`` as forward's is."""
    from fullshard import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    class Doubler(Block):
        def double(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * self.fc1(x)

    torch.manual_seed(0)
    module = Doubler()
    reference = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(module, mesh=mesh, mp_policy=MixedPrecisionPolicy(output_dtype=torch.float64))
    register_fsdp_forward_method(module, "double")
    x = torch.randn(3, DIM)
    output = module.double(x)
    assert output.dtype == torch.float64
    torch.testing.assert_close(output, reference.double(x).double())
    # The root keeps its unsharded parameters after it, as after forward (torch's rule).
    assert not isinstance(module.fc1.weight, DTensor)
    assert module.fc1.weight.shape == reference.fc1.weight.shape
    module.reshard()
    assert isinstance(module.fc1.weight, DTensor)


def test_register_fsdp_forward_method() -> None:
    run_on_ranks(2, _forward_method)


def _misuse() -> None:
    from fullshard import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = Net()
    fully_shard(model.blocks[0], mesh=mesh)
    with pytest.raises(ValueError, match="fully_shard was already applied to this Block"):
        fully_shard(model.blocks[0], mesh=mesh)
    top_down = Net()
    fully_shard(top_down, mesh=mesh)
    with pytest.raises(
        ValueError, match=r"parameter 'fc1.weight' of this Block is already sharded"
    ):
        fully_shard(top_down.blocks[0], mesh=mesh)
    early = Net()
    optim = torch.optim.SGD(early.parameters(), lr=0.1)
    _shard(early, "fullshard", mesh)
    _loss(early(_tokens(0)), 0).backward()
    with pytest.raises(RuntimeError) as stale:
        optim.step()
    assert re.fullmatch(
        r"SGD holds parameters that fully_shard replaced \(e\.g\. [\w.]+\): fully_shard gives "
        r".*Build the optimizer after fully_shard, over model\.parameters\(\)",
        str(stale.value),
    ), str(stale.value)  # names the API called, not FullyShardedDataParallel
    with pytest.raises(ValueError, match="it should be a factor of 2, not 3"):
        fully_shard(Net(), mesh=mesh, reshard_after_forward=3)
    with pytest.raises(ValueError, match=r"should be a bool or an int .* not 2\.5"):
        fully_shard(Net(), mesh=mesh, reshard_after_forward=2.5)  # type: ignore[arg-type]
    lonely = DeviceMesh("cpu", torch.tensor([0]))  # made on every rank; rank 1 is not in it
    if dist.get_rank() == 1:
        with pytest.raises(ValueError, match="rank 1 is not in fully_shard's mesh"):
            fully_shard(Net(), mesh=lonely)
    with pytest.raises(ValueError, match="fully_shard expects a 1D or 2D DeviceMesh but got"):
        fully_shard(Net(), mesh=init_device_mesh("cpu", (1, 1, 2)))
    with pytest.raises(AssertionError, match="init the 2D mesh for HSDP with mesh_dim_names"):
        fully_shard(Net(), mesh=init_device_mesh("cpu", (1, 2)))
    with pytest.raises(ValueError, match=r"returned Replicate\(\) for parameter 'weight'"):
        fully_shard(nn.Linear(2, 2), mesh=mesh, shard_placement_fn=lambda p: Replicate())
    with pytest.raises(ValueError, match="containers that do not implement forward: ModuleList"):
        fully_shard(nn.ModuleList([nn.Linear(2, 2)]), mesh=mesh)
    tied = Net()
    fully_shard(tied.head, mesh=mesh)  # the embedding outside it shares its weight
    torch_text = (  # torch raises it at the first forward; fullshard at the call
        r"Parameter 'embed\.weight' is shared with a parameter already managed by another "
        r"FSDP group\. For shared/tied parameters, use fully_shard\(\[module_a, module_b\]\)"
    )
    with pytest.raises(ValueError, match=torch_text + r".*'embed\.weight' of this Net is tied"):
        fully_shard(tied, mesh=mesh)
    with pytest.raises(ValueError, match=r"Expects FSDPModule but got <class .*Linear.*>"):
        early.set_modules_to_forward_prefetch([early.head])


def test_misuse_is_refused_with_the_fix() -> None:
    run_on_ranks(2, _misuse)


def _hsdp_placements() -> None:
    from fullshard import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fully_shard(Net(), mesh=mesh)
    for param in model.parameters():
        assert param.placements == (Replicate(), Shard(0))


def test_hsdp_parameters_are_replicated_then_sharded() -> None:
    run_on_ranks(4, _hsdp_placements)


# -- checkpoints through torch's checkpoint API, interchangeable with torch's FSDP2 ----------


def _sharded_net(api: str) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = _shard(Net(), api, init_device_mesh("cpu", (dist.get_world_size(),)))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _steps(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss = _loss(model(_tokens(step)), step)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _full_state(model: Net, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and Adam moment, full, keyed by parameter name."""
    full = {}
    for name, param in model.named_parameters():
        full[name] = param.full_tensor().detach().clone()
        for key in ("exp_avg", "exp_avg_sq"):
            full[f"{name}.{key}"] = optim.state[param][key].full_tensor().clone()
    return full


def _save(api: str, path: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _sharded_net(api)
    _steps(model, optim, range(3))
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    return _full_state(model, optim)


def _resume(api: str, path: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, optim = _sharded_net(api)
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return _full_state(model, optim), _steps(model, optim, range(3, 7))


@pytest.mark.parametrize("writer", ["torch", "fullshard"])
def test_checkpoints_interchange_with_torch_fsdp2_across_world_sizes(
    writer: str, tmp_path: Any
) -> None:
    """Saved by ``writer``'s fully_shard on 2 ranks (get_state_dict + dcp.save), loaded on 3
    ranks by both (dcp.load + set_state_dict): both resume to the same losses."""
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(2, _save, writer, path)[0]
    our_state, ours = run_on_ranks(3, _resume, "fullshard", path)[0]
    their_state, theirs = run_on_ranks(3, _resume, "torch", path)[0]
    for name, value in saved.items():  # the parameters and the optimizer state came back
        torch.testing.assert_close(our_state[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(their_state[name], value, rtol=0, atol=0, msg=name)
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)


def _save_with_fullshard(path: str) -> dict[str, torch.Tensor]:
    from fullshard import checkpoint

    model, optim = _sharded_net("fullshard")
    _steps(model, optim, range(3))
    checkpoint.save(path, model, optim, step=3)
    return _full_state(model, optim)


def _resume_with_fullshard(path: str) -> tuple[dict[str, torch.Tensor], list[float], Any]:
    from fullshard import checkpoint

    model, optim = _sharded_net("fullshard")
    extra = checkpoint.load(path, model, optim)
    return _full_state(model, optim), _steps(model, optim, range(3, 7)), extra["step"]


def test_fullshard_checkpoint_serves_fully_shard(tmp_path: Any) -> None:
    """fullshard.checkpoint.save / load with a fully_shard model: saved on 2 ranks, loaded on
    3 with the parameters and Adam state exact, resuming as torch's FSDP2 does from the same
    folder (it is a DCP checkpoint under torch's state-dict names)."""
    path = str(tmp_path / "checkpoint")
    saved = run_on_ranks(2, _save_with_fullshard, path)[0]
    our_state, ours, step = run_on_ranks(3, _resume_with_fullshard, path)[0]
    their_state, theirs = run_on_ranks(3, _resume, "torch", path)[0]
    assert step == 3
    for name, value in saved.items():
        torch.testing.assert_close(our_state[name], value, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(their_state[name], value, rtol=0, atol=0, msg=name)
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)


def _schedule_and_memory(reshard_after_forward: bool) -> None:
    """One all-gather per group in forward, one per resharded group in backward, one
    reduce-scatter per group; the unsharded parameters a resharded block computed with (that
    autograd saved for backward) hold no storage between its forward and its backward, and no
    unit holds any after backward."""
    from fullshard import fully_shard
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = _shard(
        Net(),
        "fullshard",
        init_device_mesh("cpu", (2,)),
        reshard_after_forward=reshard_after_forward,
    )
    seen: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(
                lambda m, args, name=name: seen.__setitem__(name, m.weight)
            )
    groups = {"blocks.0", "blocks.1", "blocks.2", "(root)"}
    COUNTERS.reset()
    output = model(_tokens(0))
    forward_gathers = [label for kind, label in COUNTERS.labels if kind == "all_gather"]
    assert sorted(forward_gathers) == sorted(groups)
    held = {name: w.untyped_storage().nbytes() > 0 for name, w in seen.items()}
    # Given explicitly, reshard_after_forward holds for the root too (torch's rule; only
    # the default, None, keeps the root's parameters for backward).
    assert held["head"] == (not reshard_after_forward)
    assert all(
        held[f"blocks.{i}.{fc}"] == (not reshard_after_forward)
        for i in range(3)
        for fc in ("fc1", "fc2")
    )
    COUNTERS.reset()
    _loss(output, 0).backward()
    kinds = [(kind, label) for kind, label in COUNTERS.labels]
    backward_gathers = {label for kind, label in kinds if kind == "all_gather"}
    assert backward_gathers == (groups if reshard_after_forward else set())
    assert sorted(label for kind, label in kinds if kind == "reduce_scatter") == sorted(groups)
    assert all(w.untyped_storage().nbytes() == 0 for w in seen.values())
    for module in [*model.blocks, model]:
        handle = fully_shard.state(module).handle
        assert handle.unsharded_storage_size() == 0, module


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_collective_schedule_and_no_unsharded_storage_left(reshard_after_forward: bool) -> None:
    run_on_ranks(2, _schedule_and_memory, reshard_after_forward)


def _gathers_at(module: nn.Module, backward: bool, seen: list[int]) -> None:
    """Record how many all-gathers were issued when ``module`` computes (its forward, or
    its input gradients in backward)."""
    from fullshard._comm.collectives import COUNTERS

    def record(*_: Any) -> None:
        seen.append(COUNTERS.calls["all_gather"])

    if backward:
        module.register_full_backward_hook(record)
    else:
        module.register_forward_pre_hook(record)


def _explicit_prefetch() -> None:
    """set_modules_to_forward_prefetch / _backward_prefetch issue the listed modules'
    all-gathers from this module's pre-forward / pre-backward; gradients are unchanged."""
    from fullshard._comm.collectives import COUNTERS

    mesh = init_device_mesh("cpu", (2,))
    counts: dict[bool, tuple[list[int], list[int]]] = {}
    for explicit in (False, True):
        torch.manual_seed(0)
        model = _shard(Net(), "fullshard", mesh)
        if explicit:
            model.blocks[0].set_modules_to_forward_prefetch([model.blocks[1], model.blocks[2]])
            model.blocks[2].set_modules_to_backward_prefetch([model.blocks[1], model.blocks[0]])
        forward_seen: list[int] = []
        backward_seen: list[int] = []
        _gathers_at(model.blocks[0].fc1, False, forward_seen)
        _gathers_at(model.blocks[2].fc2, True, backward_seen)
        COUNTERS.reset()
        _loss(model(_tokens(0)), 0).backward()
        counts[explicit] = (forward_seen, backward_seen)
        assert COUNTERS.calls["all_gather"] == 4 + 3  # no extra gathers either way
    # root + blocks.0 gathered by blocks.0's forward; + blocks.1, blocks.2 when prefetched.
    assert counts[False][0] == [2] and counts[True][0] == [4]
    # In backward (forward's 4 done): blocks.2, plus blocks.1 (the engine's BACKWARD_PRE) or
    # plus blocks.1 and blocks.0 (explicit).
    assert counts[False][1] == [6] and counts[True][1] == [7]


def test_explicit_forward_and_backward_prefetch() -> None:
    run_on_ranks(2, _explicit_prefetch)


def _accumulation_controls() -> None:
    """Gradient accumulation with the parameters kept unsharded between micro-batches
    (set_reshard_after_backward(False): no all-gather at the next forward) matches DDP; after
    an optimizer step the kept parameters are stale, and the next forward gathers again."""
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(copy.deepcopy(model))
    _shard(model, "fullshard", init_device_mesh("cpu", (2,)))
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    ddp_optim = torch.optim.SGD(ddp.parameters(), lr=0.5)
    model.set_reshard_after_backward(False)
    model.set_is_last_backward(False)
    _loss(model(_tokens(0)), 0).backward()
    with ddp.no_sync():
        _loss(ddp(_tokens(0)), 0).backward()
    # Kept unsharded: the modules hold the unsharded parameters until resharded (torch's)
    weight = model.blocks[0].fc1.weight
    assert not isinstance(weight, DTensor) and weight.shape == (2 * DIM + 1, DIM)
    COUNTERS.reset()
    model.set_reshard_after_backward(True)
    model.set_is_last_backward(True)
    _loss(model(_tokens(1)), 1).backward()
    _loss(ddp(_tokens(1)), 1).backward()
    assert COUNTERS.calls["all_gather"] == 3  # backward's re-gathers only, none in forward
    _assert_grads_equal(model, ddp)
    model.set_reshard_after_backward(False)
    _loss(model(_tokens(2)), 2).backward()
    _loss(ddp(_tokens(2)), 2).backward()
    optim.step()
    ddp_optim.step()
    COUNTERS.reset()
    output = model(_tokens(3))
    assert COUNTERS.calls["all_gather"] == 4  # the kept parameters predate the step
    torch.testing.assert_close(output, ddp(_tokens(3)), rtol=1e-5, atol=1e-5)


def test_reshard_after_backward_and_is_last_backward() -> None:
    run_on_ranks(2, _accumulation_controls)


def _unshard_in_backward() -> None:
    """An embedding's backward needs no weights: set_unshard_in_backward(False) skips its
    all-gather in backward, with the same gradients."""
    from fullshard import fully_shard
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = Net()
    model.head = nn.Linear(DIM, 11, bias=False)  # untied: the embedding is a group alone
    ddp = DDP(copy.deepcopy(model))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model.embed, mesh=mesh)
    _shard(model, "fullshard", mesh)
    model.embed.set_unshard_in_backward(False)
    output = model(_tokens(0))
    COUNTERS.reset()
    _loss(output, 0).backward()
    assert "embed" not in {label for kind, label in COUNTERS.labels if kind == "all_gather"}
    _loss(ddp(_tokens(0)), 0).backward()
    _assert_grads_equal(model, ddp)


def test_unshard_in_backward() -> None:
    run_on_ranks(2, _unshard_in_backward)


def _requires_all_reduce() -> None:
    """HSDP on 2x2: the first micro-batch's gradients stay in the shard group
    (set_requires_all_reduce(False): no all-reduce, no .grad yet); the last one's all-reduce
    carries both, matching DDP's accumulated gradients."""
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = Net()
    ddp = DDP(copy.deepcopy(model))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    _shard(model, "fullshard", mesh)
    model.set_requires_all_reduce(False)
    COUNTERS.reset()
    _loss(model(_tokens(0)), 0).backward()
    assert COUNTERS.calls["all_reduce"] == 0
    assert all(p.grad is None for p in model.parameters())
    with ddp.no_sync():
        _loss(ddp(_tokens(0)), 0).backward()
    model.set_requires_all_reduce(True)
    _loss(model(_tokens(1)), 1).backward()
    _loss(ddp(_tokens(1)), 1).backward()
    assert COUNTERS.calls["all_reduce"] == 4  # one per group, once
    _assert_grads_equal(model, ddp)


def test_requires_all_reduce_on_a_2x2_mesh() -> None:
    run_on_ranks(4, _requires_all_reduce)


def _meta_init(api: str) -> tuple[dict[str, torch.Tensor], list[float]]:
    """torchtitan's initialisation: build on the meta device, shard, ``to_empty``, then
    initialise (each module's ``reset_parameters`` on the DTensor parameters)."""
    with torch.device("meta"):
        model = Net()
    _shard(model, api, init_device_mesh("cpu", (2,)))
    assert model.blocks[0].fc1.weight.is_meta  # not materialised by fully_shard
    model.to_empty(device="cpu")
    assert model.head.weight is model.embed.weight  # still tied
    torch.manual_seed(0)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    initial = {name: p.full_tensor() for name, p in model.named_parameters()}
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    return initial, _steps(model, optim, range(3))


def _meta_device_init() -> None:
    ours, our_losses = _meta_init("fullshard")
    theirs, their_losses = _meta_init("torch")
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)
    assert our_losses == pytest.approx(their_losses, rel=1e-6), (our_losses, their_losses)


def test_meta_device_init_then_to_empty_matches_torch() -> None:
    run_on_ranks(2, _meta_device_init)


def _train_group(api: str) -> tuple[list[float], dict[str, torch.Tensor], list[str]]:
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = Net()
    model.head = nn.Linear(DIM, 11, bias=False)  # untied: the group owns it
    fully_shard: Any = _fully_shard_of(api)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard([model.norm, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    COUNTERS.reset()
    losses = _steps(model, optim, range(3))
    gathers = [label for kind, label in COUNTERS.labels if kind == "all_gather"]
    full = {name: p.full_tensor() for name, p in model.named_parameters()}
    return losses, full, gathers


def _fully_shard_of(api: str) -> Any:
    if api == "fullshard":
        from fullshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard  # type: ignore[no-redef]
    return fully_shard


def _group_of_modules() -> None:
    """fully_shard([norm, head]): one group, gathered once before norm's forward and
    resharded after head's (once more in backward), trained as torch's own grouping."""
    from fullshard import fully_shard

    ours, our_params, gathers = _train_group("fullshard")
    theirs, their_params, _ = _train_group("torch")
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)
    for name, value in their_params.items():
        torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-5, msg=name)
    assert gathers.count("norm") == 3 * 2  # per step: forward, backward
    model = Net()
    mesh = init_device_mesh("cpu", (2,))
    fully_shard([model.norm, model.blocks[0]], mesh=mesh)
    assert fully_shard.state(model.norm) is fully_shard.state(model.blocks[0])
    with pytest.raises(RuntimeError):  # raises inside the group, between its two modules
        model.blocks[0](torch.randn(2, DIM + 1))
    x = torch.randn(2, DIM)  # the group's next forward gathers again
    torch.testing.assert_close(model.norm(model.blocks[0](x)), _unsharded(model)(x))
    with pytest.raises(ValueError, match="a Block and a Linear inside it in one list"):
        fully_shard([model.blocks[1], model.blocks[1].fc1], mesh=mesh)


def _unsharded(model: Net) -> nn.Module:
    """blocks[0] then norm with the full parameters of ``model``."""
    reference = nn.Sequential(Block(), nn.LayerNorm(DIM))
    state = {
        name: value.full_tensor()
        for name, value in {
            **{f"0.{k}": v for k, v in model.blocks[0].state_dict().items()},
            **{f"1.{k}": v for k, v in model.norm.state_dict().items()},
        }.items()
    }
    reference.load_state_dict(state)
    return reference


def test_a_list_of_modules_is_one_group() -> None:
    run_on_ranks(2, _group_of_modules)


TRANSPORTS = {
    "shared-memory": {"FULLSHARD_SHM_CELL_MIB": str(64 / 2**20)},  # pieces straddle parameters
    "rings": {"FULLSHARD_SHM": "0"},
    "gloo": {"FULLSHARD_SHM": "0", "FULLSHARD_GLOO_RINGS": "0"},
}


def _over_transport(into_params: bool) -> None:
    """Same training as torch's on every transport. fullshard's transports put each peer's
    rows straight into the unsharded parameters (the gathered buffer is never allocated):
    the shared-memory one copies them there, the rings receive them there; gloo's own
    all-gather fills the buffer, which is copied out. Either way the unsharded parameters
    lie in one block of the unit's size ([Note: one block per unit])."""
    from fullshard import fully_shard

    _compare(None, mixed=False, offload=False, hsdp=False)
    torch.manual_seed(0)
    model = _shard(Net(), "fullshard", init_device_mesh("cpu", (2,)))
    seen: list[tuple[bool, int]] = []

    def record(module: nn.Module, args: Any) -> None:
        unsharded = fully_shard.state(model.blocks[1]).handle._segments[0].active
        seen.append((unsharded.params_gathered, module.weight.untyped_storage().nbytes()))

    model.blocks[1].fc1.register_forward_pre_hook(record)
    model(_tokens(0))
    unit_numel = sum(p.numel() for p in model.blocks[1].parameters())  # DTensors: global
    assert unit_numel > 25 * DIM  # fc1's weight and the rest of the unit
    assert seen == [(into_params, unit_numel * 4)]  # one block (see dim0_unsharded.py)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_parity_and_gathered_buffer_on_each_transport(transport: str) -> None:
    run_on_ranks(2, _over_transport, transport != "gloo", env=TRANSPORTS[transport])


def _train_ignoring(api: str) -> tuple[list[float], torch.Tensor, tuple[bool, bool]]:
    torch.manual_seed(0)
    model = Net()
    _shard(model, api, init_device_mesh("cpu", (2,)), ignored_params={model.norm.weight})
    sharded = (isinstance(model.norm.weight, DTensor), isinstance(model.norm.bias, DTensor))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = _steps(model, optim, range(3))
    return losses, model.norm.weight.detach().clone(), sharded


def _ignored_params() -> None:
    """An ignored parameter stays a plain, unsharded parameter whose gradient is this rank's
    own (no reduction), as in torch; its module's other parameters are still sharded."""
    ours, our_weight, our_sharded = _train_ignoring("fullshard")
    theirs, their_weight, their_sharded = _train_ignoring("torch")
    assert our_sharded == their_sharded == (False, True)  # weight plain, bias sharded
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)
    torch.testing.assert_close(our_weight, their_weight, rtol=1e-5, atol=1e-6)
    weights = [torch.empty_like(our_weight) for _ in range(2)]
    dist.all_gather(weights, our_weight)
    assert not torch.equal(weights[0], weights[1])  # trained on each rank's own data


def test_ignored_params_stay_local() -> None:
    run_on_ranks(2, _ignored_params)


def _on_dim_1(param: nn.Parameter) -> Any:
    return Shard(1) if param.ndim == 2 else None


def _on_even_dim_1(param: nn.Parameter) -> Any:
    return Shard(1) if param.ndim == 2 and param.shape[1] % 2 == 0 else None


def _train_placed(api: str, placement_fn: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Net()
    if api == "ddp":
        sharded: nn.Module = DDP(model)
    else:
        sharded = _shard(model, api, init_device_mesh("cpu", (2,)), shard_placement_fn=placement_fn)
    optim = torch.optim.Adam(sharded.parameters(), lr=1e-2)
    losses = _steps(sharded, optim, range(3))
    full = {
        name.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
        for name, p in sharded.named_parameters()
    }
    return losses, full


def _shard_placement() -> None:
    """shard_placement_fn's Shard(1): each matrix's local tensor is its torch.chunk piece on
    dim 1, training as DDP and torch's fully_shard do; a dim that does not split evenly (other
    than 0) is refused as torch refuses it, and so is a dim the parameter lacks."""
    from fullshard import fully_shard

    mesh = init_device_mesh("cpu", (2,))
    model = _shard(Net(), "fullshard", mesh, shard_placement_fn=_on_even_dim_1)
    for name, param in model.named_parameters():
        dim = 1 if _on_even_dim_1(param) is not None else 0
        assert param.placements == (Shard(dim),), name
        expected = torch.chunk(param.full_tensor(), 2, dim=dim)[dist.get_rank()]
        torch.testing.assert_close(param.to_local(), expected, rtol=0, atol=0, msg=name)
    ours, our_params = _train_placed("fullshard", _on_even_dim_1)
    ddp, ddp_params = _train_placed("ddp", None)
    theirs, their_params = _train_placed("torch", _on_even_dim_1)
    assert ours == pytest.approx(ddp, rel=1e-5, abs=1e-6), (ours, ddp)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)
    for name, value in their_params.items():
        torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-5, msg=name)
        torch.testing.assert_close(our_params[name], ddp_params[name], rtol=1e-5, atol=1e-5)
    with pytest.raises(NotImplementedError, match="does not support uneven sharding on dim 1"):
        _shard(Net(), "fullshard", mesh, shard_placement_fn=_on_dim_1)  # fc2.weight: 25 columns
    with pytest.raises(AssertionError, match=r"Shard dim 2 is invalid for 2D tensor"):
        fully_shard(Block(), shard_placement_fn=lambda p: Shard(2))


def test_shard_placement_fn_on_dim_1() -> None:
    run_on_ranks(2, _shard_placement)


def _train_resharding_to(api: str, k: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _shard(Net(), api, init_device_mesh("cpu", (4,)), reshard_after_forward=k)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = _steps(model, optim, range(3))
    return losses, {name: p.full_tensor() for name, p in model.named_parameters()}


def _backward_gathers(k: int) -> tuple[float, list[str]]:
    """Bytes and labels of backward's all-gathers with reshard_after_forward=k on 4 ranks."""
    from fullshard._comm.collectives import COUNTERS

    torch.manual_seed(0)
    model = _shard(Net(), "fullshard", init_device_mesh("cpu", (4,)), reshard_after_forward=k)
    output = model(_tokens(0))
    COUNTERS.reset()
    _loss(output, 0).backward()
    labels = [label for kind, label in COUNTERS.labels if kind == "all_gather"]
    return COUNTERS.bytes_sent["all_gather"], labels


def _reshard_to_smaller_group() -> None:
    """reshard_after_forward=2 on 4 ranks: after forward each block keeps its parameters
    sharded over 2 ranks, so backward's all-gather moves half the bytes of forward's
    (each rank receives 1 of 2 shards, not 3 of 4), training as torch's does."""
    from fullshard import fully_shard

    ours, our_params = _train_resharding_to("fullshard", 2)
    theirs, their_params = _train_resharding_to("torch", 2)
    assert ours == pytest.approx(theirs, rel=1e-5, abs=1e-6), (ours, theirs)
    for name, value in their_params.items():
        torch.testing.assert_close(our_params[name], value, rtol=1e-5, atol=1e-5, msg=name)
    full, full_labels = _backward_gathers(4)
    smaller, smaller_labels = _backward_gathers(2)
    # Given explicitly, the root reshards too (torch's rule), over k ranks as the blocks do
    assert smaller_labels == full_labels == ["(root)", "blocks.2", "blocks.1", "blocks.0"]
    assert smaller < 0.7 * full, (smaller, full)  # 1/2 of each block against 3/4, plus padding
    with pytest.warns(UserWarning, match=r"reshard_after_forward=1 \(int\) means resharding"):
        fully_shard(Block(), reshard_after_forward=1)
    # Modules sharded over the same ranks share the 2-rank groups, whichever mesh object they
    # were given (mesh=None makes a new one per call): one gloo group and one shared-memory
    # file per group of ranks, not one per module.
    blocks = [Block() for _ in range(3)]
    for block in blocks[:2]:
        fully_shard(block, reshard_after_forward=2)
    fully_shard(blocks[2], mesh=init_device_mesh("cpu", (4,)), reshard_after_forward=2)
    groups = [_post_forward_group(block) for block in blocks]
    assert groups[0] is not None and all(group is groups[0] for group in groups), groups


def _post_forward_group(module: nn.Module) -> dist.ProcessGroup | None:
    from fullshard import fully_shard

    handle = fully_shard.state(module).handle
    assert handle is not None and handle._dtensor_params is not None
    return handle._dtensor_params.post_forward_group


@pytest.mark.parametrize("transport", ["shared-memory", "rings"])
def test_reshard_after_forward_to_a_smaller_group(transport: str) -> None:
    run_on_ranks(4, _reshard_to_smaller_group, env=TRANSPORTS[transport])


def _one_rank() -> None:
    """On one rank fully_shard trains as the plain model does, without FSDP1's warning about
    switching to NO_SHARD (torch's fully_shard has none)."""
    import warnings

    torch.manual_seed(0)
    reference = Net()
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _shard(model, "fullshard", init_device_mesh("cpu", (1,)))
    ours = _steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), range(3))
    theirs = _steps(reference, torch.optim.Adam(reference.parameters(), lr=1e-2), range(3))
    assert ours == pytest.approx(theirs, rel=1e-6)


def test_one_rank() -> None:
    run_on_ranks(1, _one_rank)


def _grads_held_in_forward(api: str, set_to_none: bool) -> list[bool]:
    """Per step after the first, whether the first block's unit held a sharded gradient
    while its next forward ran."""
    from fullshard import FullyShardedDataParallel, fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    run: nn.Module = model
    if api == "fsdp2":
        fully_shard(model[0])
        fully_shard(model)
        handle = fully_shard.state(model[0]).handle  # type: ignore[attr-defined]
        inner = model[0]
    else:
        model[0] = FullyShardedDataParallel(model[0], use_orig_params=True)
        run = FullyShardedDataParallel(model, use_orig_params=True)
        handle = model[0]._handle
        inner = model[0].module
    held: list[bool] = []
    inner.register_forward_hook(lambda *_: held.append(handle.flat_param.grad is not None))
    optim = torch.optim.Adam(run.parameters())
    for _ in range(3):
        run(torch.randn(2, 4)).sum().backward()
        optim.step()
        optim.zero_grad(set_to_none=set_to_none)
    return held[1:]


def _grads_released_after_zero_grad() -> None:
    for api in ("fsdp2", "fsdp1"):
        assert _grads_held_in_forward(api, set_to_none=True) == [False, False], api
        assert _grads_held_in_forward(api, set_to_none=False) == [True, True], api


def test_sharded_gradient_released_at_the_next_forward_after_zero_grad() -> None:
    """``zero_grad(set_to_none=True)`` drops every original gradient: the unit's sharded
    gradient they viewed is gone by its next forward (``fully_shard``, and FSDP1 with
    ``use_orig_params``), not held through the forward into the next reduction; with
    ``set_to_none=False`` (zeroed in place) it stays."""
    run_on_ranks(2, _grads_released_after_zero_grad)
