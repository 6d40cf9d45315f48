"""One ``fully_shard`` call, several units: parameters on meshes of their own (torch 2.13's
``ShardPlacementResult``, expert parallel) and parameters of several dtypes (beyond torch,
which refuses them). See [Note: sibling units] in ``fullshard/_engine/unit.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_on_ranks

_DIM, _HIDDEN, _EXPERTS, _ROWS = 6, 5, 3, 4
"""Odd sizes: 3 experts split over 2 shard ranks unevenly (2 and 1)."""


class _Experts(nn.Module):
    """Grouped experts (torchtitan's layout: one (experts, in, out) weight per projection),
    every token weighted over every expert by the router."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(_EXPERTS, _DIM, _HIDDEN) * 0.3)
        self.w2 = nn.Parameter(torch.randn(_EXPERTS, _HIDDEN, _DIM) * 0.3)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        hidden = torch.einsum("nd,edh->enh", x, self.w1).relu()  # (E, N, H)
        out = torch.einsum("enh,ehd->end", hidden, self.w2)  # (E, N, D)
        return torch.einsum("end,ne->nd", out, weights)  # (N, D)


class _MoEBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(_DIM)
        self.router = nn.Linear(_DIM, _EXPERTS)
        self.experts = _Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.experts(h, self.router(h).softmax(-1))


class _MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(3, _DIM)
        self.blocks = nn.ModuleList([_MoEBlock(), _MoEBlock()])
        self.head = nn.Linear(_DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(_ROWS, 3, generator=torch.Generator().manual_seed(100 * step + rank))


def _train(model: nn.Module, steps: int, rank: int) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        loss = model(_batch(step, rank)).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _moe_on_per_parameter_meshes(api: str, steps: int = 5) -> tuple[nn.Module, list[float]]:
    """Experts sharded over 2 ranks and replicated over the other 2 (HSDP), everything
    else over all 4, in one ``fully_shard`` call per block."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import HSDPMeshInfo

    dp_mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    expert_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ep_replicate", "ep_shard"))
    experts_info = HSDPMeshInfo(expert_mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    model = _MoE()
    _shard_moe(api, model, dp_mesh, experts_info)
    return model, _train(model, steps, dist.get_rank())


def _shard_moe(
    api: str, model: nn.Module, dp_mesh: object, experts_info: object, divide_by: int = 0
) -> None:
    """``fully_shard`` (torch's or fullshard's) each block over ``dp_mesh``, its experts by a
    ``ShardPlacementResult`` on ``experts_info``, then the root; ``divide_by``: each block's
    gradient divide factor, reduced as sums."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Shard

    if api == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard  # type: ignore[assignment]
    expert_params = {id(p) for block in model.blocks for p in block.experts.parameters()}

    def placement(param: nn.Parameter) -> object:
        if id(param) in expert_params:
            return ShardPlacementResult(Shard(0), experts_info)
        return None

    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement)
        if divide_by:
            block.set_gradient_divide_factor(divide_by)
            block.set_force_sum_reduction_for_comms(True)
    fully_shard(model, mesh=dp_mesh)


def _per_parameter_meshes() -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import Replicate, Shard

    from fullshard._comm.collectives import COUNTERS

    COUNTERS.reset()
    ours, our_losses = _moe_on_per_parameter_meshes("fullshard")
    # the experts' unit is named apart from the rest of its block's
    labels = {label for _, label in COUNTERS.labels}
    assert {"blocks.0", "blocks.0 [mesh (ep_replicate 2, ep_shard 2)]"} <= labels, labels
    theirs, their_losses = _moe_on_per_parameter_meshes("torch")
    assert our_losses == pytest.approx(their_losses, rel=1e-5), (our_losses, their_losses)
    experts = ours.blocks[0].experts  # type: ignore[index]
    assert experts.w1.placements == (Replicate(), Shard(0))
    assert experts.w1.device_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    assert experts.w1.to_local().shape[0] == (2 if dist.get_rank() % 2 == 0 else 1)
    assert ours.blocks[0].router.weight.placements == (Shard(0),)  # type: ignore[index]
    assert ours.blocks[0].router.weight.device_mesh.ndim == 1  # type: ignore[index]
    # one process, the mean loss of the 4 ranks' batches
    reference = _MoE()
    optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(5):
        losses = [reference(_batch(step, r)).square().mean() for r in range(4)]
        (sum(losses) / 4).backward()
        optim.step()
        optim.zero_grad()
    for (name, mine), their, ref in zip(
        ours.named_parameters(), theirs.parameters(), reference.parameters()
    ):
        torch.testing.assert_close(mine.full_tensor(), their.full_tensor(), msg=name)
        torch.testing.assert_close(mine.full_tensor(), ref.detach(), rtol=1e-4, atol=1e-5)
    # torch's checkpoint API: full state dicts equal torch's, and load back into ours
    options = StateDictOptions(full_state_dict=True)
    our_state = get_model_state_dict(ours, options=options)
    their_state = get_model_state_dict(theirs, options=options)
    assert our_state.keys() == their_state.keys() == reference.state_dict().keys()
    for key, value in our_state.items():
        torch.testing.assert_close(value, their_state[key], msg=key)
    fresh, _ = _moe_on_per_parameter_meshes("fullshard", steps=0)
    set_model_state_dict(fresh, reference.state_dict(), options=options)
    for (name, loaded), ref in zip(fresh.named_parameters(), reference.parameters()):
        torch.testing.assert_close(loaded.full_tensor(), ref.detach(), msg=name)


def test_experts_on_their_own_mesh_train_as_torch_and_one_process() -> None:
    """Per-parameter meshes in one call (torch 2.13's ``ShardPlacementResult``): experts
    sharded over 2 of 4 ranks and replicated over the other 2, routers, norms and the rest
    over all 4. 5 AdamW steps reach torch's FSDP2 losses and parameters and one process's,
    with torch's placements and meshes; torch's checkpoint API reads and loads them."""
    run_on_ranks(4, _per_parameter_meshes)


class _MixedDtypes(nn.Module):
    """Float64 projections with float32 norms and bias: each module computes in its own
    parameters' dtype (a bf16 block keeping fp32 norms, in dtypes exact enough to compare)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc1 = nn.Linear(3, 5).double()
        self.norm = nn.LayerNorm(5)
        self.fc2 = nn.Linear(5, 2).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x.to(self.fc1.weight.dtype))
        h = self.norm(h.to(self.norm.weight.dtype)).relu()
        return self.fc2(h.to(self.fc2.weight.dtype))


def _train_mixed(policy_dtype: torch.dtype | None) -> None:
    from fullshard import MixedPrecisionPolicy, fully_shard

    model = _MixedDtypes()
    reference = copy.deepcopy(model)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=policy_dtype))
    units = fully_shard.state(model).siblings  # type: ignore[attr-defined]
    assert len(units) == 1, "one sibling: the float32 parameters beside the float64 ones"
    losses = _train(model, 4, dist.get_rank())
    unit = fully_shard.state(model)  # type: ignore[attr-defined]
    labels = [each.label for each in (unit, *unit.siblings)]
    assert labels == ["(root) [float64]", "(root) [float32]"], labels
    assert {p.dtype for p in model.norm.parameters()} == {torch.float32}
    assert model.fc1.weight.dtype == torch.float64
    # one process: computes as the policy says, the optimizer steps on the own dtypes
    optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    world = dist.get_world_size()
    for step in range(4):
        compute = reference if policy_dtype is None else copy.deepcopy(reference).to(policy_dtype)
        batch_losses = [compute(_batch(step, r)).square().mean() for r in range(world)]
        (sum(batch_losses) / world).backward()
        for param, computed in zip(reference.parameters(), compute.parameters()):
            param.grad = computed.grad.to(param.dtype)  # type: ignore[union-attr]
        assert losses[step] == pytest.approx(batch_losses[dist.get_rank()].item(), rel=1e-6)
        optim.step()
        optim.zero_grad()
    for name, param in model.named_parameters():
        ref = reference.get_parameter(name)
        torch.testing.assert_close(param.full_tensor(), ref.detach(), msg=name)


@pytest.mark.parametrize("policy_dtype", [None, torch.float64], ids=["own_dtypes", "param_dtype"])
def test_units_with_mixed_parameter_dtypes_train_as_one_process(
    policy_dtype: torch.dtype | None,
) -> None:
    """A call whose parameters mix float64 and float32 (torch 2.13 refuses it at the first
    forward): each parameter keeps its dtype and the optimizer steps on it; without a policy
    each module computes in its own dtype, with ``param_dtype`` all compute in it; 4 AdamW
    steps on 2 ranks match one process doing the same."""
    run_on_ranks(2, _train_mixed, policy_dtype)


class _ParallelExperts(nn.Module):
    """Experts split over the expert-parallel ranks (each holds ``_EXPERTS_EP / ep`` of
    them as a DTensor's local tensor): the ep group's tokens are all-gathered, each rank
    runs its own experts on all of them, and the outputs are reduce-scattered back (each
    rank's rows summed over every rank's experts)."""

    def __init__(self, ep_mesh: object) -> None:
        super().__init__()
        from torch.distributed.tensor import Shard, distribute_tensor

        torch.manual_seed(2)
        self.ep_group = ep_mesh.get_group()  # type: ignore[attr-defined]
        self.w1 = nn.Parameter(
            distribute_tensor(torch.randn(_EXPERTS_EP, _DIM, _HIDDEN) * 0.3, ep_mesh, [Shard(0)])
        )
        self.w2 = nn.Parameter(
            distribute_tensor(torch.randn(_EXPERTS_EP, _HIDDEN, _DIM) * 0.3, ep_mesh, [Shard(0)])
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from torch.distributed import _functional_collectives as funcol

        w1, w2 = self.w1.to_local(), self.w2.to_local()  # (E/ep, D, H), (E/ep, H, D)
        local = w1.shape[0]
        first = dist.get_rank(self.ep_group) * local
        tokens = funcol.all_gather_single_autograd(x, 0, self.ep_group)  # (ep*N, D)
        gates = funcol.all_gather_single_autograd(weights, 0, self.ep_group)  # (ep*N, E)
        hidden = torch.einsum("nd,edh->enh", tokens, w1).relu()  # (E/ep, ep*N, H)
        out = torch.einsum("enh,ehd->end", hidden, w2)  # (E/ep, ep*N, D)
        mine = torch.einsum("end,ne->nd", out, gates[:, first : first + local])
        return funcol.reduce_scatter_single_autograd(mine, "sum", 0, self.ep_group)  # (N, D)


_EXPERTS_EP = 4


def _moe_with_expert_parallel(api: str) -> tuple[nn.Module, list[float]]:
    """(edp 2, ep 2) on 4 ranks, each with its own batch: experts split over ep and sharded
    over edp (a ``ShardPlacementResult`` on the edp mesh), everything else over all 4."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo

    world = init_device_mesh("cpu", (2, 2), mesh_dim_names=("edp", "ep"))
    dp_mesh = world._flatten("dp")
    experts_info = FSDPMeshInfo(world["edp"], shard_mesh_dim=0)
    model = _MoE()
    for block in model.blocks:
        block.router = nn.Linear(_DIM, _EXPERTS_EP)
        block.experts = _ParallelExperts(world["ep"])
    # experts' gradients are summed over the ep group's batches: divide by all 4 (with sums
    # on the wire: gloo has no PREMUL_SUM, which torch would use for the factor)
    _shard_moe(api, model, dp_mesh, experts_info, divide_by=4)
    return model, _train(model, 5, dist.get_rank())


def _expert_parallel() -> None:
    ours, our_losses = _moe_with_expert_parallel("fullshard")
    theirs, their_losses = _moe_with_expert_parallel("torch")
    assert our_losses == pytest.approx(their_losses, rel=1e-5), (our_losses, their_losses)
    for (name, mine), (_, their) in zip(ours.named_parameters(), theirs.named_parameters()):
        assert mine.placements == their.placements, name
        assert mine.device_mesh == their.device_mesh, name
        torch.testing.assert_close(mine.to_local(), their.to_local(), msg=name)
        torch.testing.assert_close(mine.full_tensor(), their.full_tensor(), msg=name)


def test_experts_split_by_expert_parallel_train_as_torch() -> None:
    """Expert parallel over per-parameter meshes (torchtitan's ``ep_degree > 1`` layout):
    on (edp 2, ep 2), experts are DTensors split over ep, sharded over edp by a
    ``ShardPlacementResult``, the rest over all 4 ranks; 5 AdamW steps give torch's FSDP2
    losses, placements, meshes and parameters."""
    run_on_ranks(4, _expert_parallel)
