"""``fullshard train``'s model: the GPT, sharded through one of fullshard's two front doors.

``--api fsdp1`` wraps it in `FullyShardedDataParallel` with one unit per `Block`; ``--api
fsdp2`` applies `fully_shard` to each `Block`, then to the root (bottom-up), as torchtitan
does. Either way every `Block` is one unit and the embeddings, the final norm and the tied
head stay in the root unit; both run on the same engine, so a FULL_SHARD fp32 run gives the
same losses through either door (tests/cli/test_cli.py).

The FSDP options map onto FSDP2's (`fsdp2_options`):

- ``--sharding-strategy FULL_SHARD``: ``reshard_after_forward=True`` on a 1-D mesh;
  ``SHARD_GRAD_OP``: ``reshard_after_forward=False``; ``HYBRID_SHARD``: a 2-D (replicate,
  shard) mesh (`hybrid_mesh`, as for FSDP1) with ``reshard_after_forward=True``.
  ``--reshard-after-forward false`` or ``K`` replaces FULL_SHARD's and HYBRID_SHARD's True.
  NO_SHARD and ``--use-orig-params`` have no FSDP2 counterpart here: the options refuse them.
- ``--mixed-precision bf16``: ``MixedPrecisionPolicy(param_dtype=bfloat16)``, whose
  reduction dtype (None) defaults to the parameter dtype, as FSDP1's
  ``MixedPrecision(param_dtype=bfloat16)`` does: both reduce gradients in bf16.
- ``--cpu-offload``: ``CPUOffloadPolicy()``.
- ``--grad-clip``: ``torch.nn.utils.clip_grad_norm_`` over the DTensor parameters (their
  gradients are DTensors, so the norm is the whole model's), instead of FSDP1's
  ``clip_grad_norm_`` method; with ``--tp``, whose parameters live on two meshes, one norm
  over both (`clip_grad_norm`).
- ``--tp T``: a 2-D ("dp", "tp") mesh of (ranks / T, T) (`dp_tp_mesh`). Each block's
  linears are split over ``mesh["tp"]`` with torch's ``parallelize_module`` (`TP_PLAN`,
  Megatron's: q, k, v and the MLP's fc by output feature, the two output projections by
  input feature, so each rank holds whole heads and one all-reduce ends each half-block),
  then every block and the root are sharded with ``fully_shard`` over ``mesh["dp"]``. The
  embeddings, the final norm and the tied head are not split: they stay whole on each tp
  rank (sharded over dp only), and their gradients, computed from the same batch and the
  same all-reduced activations, are the same on every tp rank. The T ranks of one dp row
  read the same batches (`data_parallel_rank`), so a run on ``T * N`` ranks gives the
  losses of ``--tp 1`` on N ranks (tests/cli/test_tp.py).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from .._fsdp2 import fully_shard
from ..api import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from ..compress import bf16_gradients, int8_all_gather
from ..examples.gpt import GPT, Block, num_params
from ..fully_sharded_data_parallel import FullyShardedDataParallel as FSDP
from ..wrap import ModuleWrapPolicy
from .train_options import TrainConfig

__all__ = [
    "FSDP1_PRECISIONS",
    "POLICIES",
    "TP_PLAN",
    "build_model",
    "clip_grad_norm",
    "data_parallel_rank",
    "describe_sharding",
    "dp_tp_mesh",
    "fsdp2_options",
    "hybrid_mesh",
    "model_params",
]

FSDP1_PRECISIONS: dict[str, MixedPrecision | None] = {
    "none": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16),
}
"""``--mixed-precision`` (`fullshard.cli.train_options.PRECISIONS`) for
``FullyShardedDataParallel``."""

POLICIES: dict[str, MixedPrecisionPolicy] = {
    "none": MixedPrecisionPolicy(),
    "bf16": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
}
"""``--mixed-precision`` for ``fully_shard``: the same dtypes as `FSDP1_PRECISIONS` gives
FSDP1 (compute and reduce in bf16; the fp32 shard is the master copy)."""

TP_PLAN: dict[str, ParallelStyle] = {
    "attn.q": ColwiseParallel(),
    "attn.k": ColwiseParallel(),
    "attn.v": ColwiseParallel(),
    "attn.proj": RowwiseParallel(),
    "mlp.fc": ColwiseParallel(),
    "mlp.proj": RowwiseParallel(),
}
"""``--tp``'s plan for one `Block`: each rank computes its heads of attention and its
columns of the MLP's hidden layer from the whole input; the output projections take those
pieces (``Shard(-1)``) and all-reduce their partial sums, so a block's input and output are
plain tensors, the same on every tp rank."""


def dp_tp_mesh(device: torch.device, tp: int) -> DeviceMesh:
    """The ("dp", "tp") mesh of (ranks / ``tp``, ``tp``): tp is the inner dim, so the ranks
    of one dp row are consecutive (on one machine, where their all-reduces are cheapest)."""
    world_size = dist.get_world_size()
    if world_size % tp:
        raise ValueError(
            f"--tp {tp} must divide the {world_size} ranks: each data-parallel rank is --tp "
            "ranks; pick --ranks (and --nnodes) so that it does, or another --tp"
        )
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def data_parallel_rank(config: TrainConfig) -> int:
    """Which batches this rank reads: its row of the (dp, tp) mesh (`dp_tp_mesh`: rank r is
    at (r // tp, r % tp)), so the tp ranks of a row read the same ones; without --tp, the
    rank."""
    return dist.get_rank() // config.tp


def hybrid_mesh(device: torch.device) -> DeviceMesh:
    """A (replicate, shard) mesh that shards inside a node and replicates across nodes."""
    world_size = dist.get_world_size()
    shard_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    if world_size % shard_size != 0:
        raise ValueError(
            f"HYBRID_SHARD needs world size ({world_size}) divisible by the ranks per node "
            f"({shard_size})"
        )
    return init_device_mesh(
        device.type, (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard")
    )


def model_params(config: TrainConfig) -> int:
    """Parameters of the plain model, counted on the meta device (nothing allocated).

    Not `num_params` of the sharded model, which counts this rank's shards: half the model
    on two FULL_SHARD ranks, or on two HYBRID_SHARD ranks of one machine."""
    with torch.device("meta"):
        return num_params(GPT(config.gpt()))


def build_model(config: TrainConfig, device: torch.device) -> nn.Module:
    """The GPT sharded with one unit per `Block` through ``config.api``; every rank builds
    the same initial weights."""
    torch.manual_seed(config.seed)
    model = GPT(config.gpt())
    if config.api == "fsdp2":
        return _shard_fsdp2(model, config, device)
    strategy = ShardingStrategy[config.sharding_strategy]
    is_hybrid = strategy == ShardingStrategy.HYBRID_SHARD
    return FSDP(
        model,
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=strategy,
        use_orig_params=config.use_orig_params,
        mixed_precision=FSDP1_PRECISIONS[config.mixed_precision],
        cpu_offload=CPUOffload(offload_params=config.cpu_offload),
        device_id=device,
        device_mesh=hybrid_mesh(device) if is_hybrid else None,
    )


def fsdp2_options(config: TrainConfig) -> dict[str, Any]:
    """``fully_shard``'s keyword options for ``config``, but the mesh (see the module
    docstring). Pure: no process group needed."""
    offload: OffloadPolicy = CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()
    policy = POLICIES[config.mixed_precision]
    if "bf16-grads" in config.compress_comm:
        policy = bf16_gradients(policy)
    return {
        "reshard_after_forward": config.fsdp2_reshard,
        "mp_policy": policy,
        "offload_policy": offload,
    }


def _shard_fsdp2(model: GPT, config: TrainConfig, device: torch.device) -> nn.Module:
    tp_mesh = None
    if config.tp > 1:
        world = dp_tp_mesh(device, config.tp)
        mesh, tp_mesh = world["dp"], world["tp"]
    elif config.sharding_strategy == "HYBRID_SHARD":
        mesh = hybrid_mesh(device)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    options = fsdp2_options(config)
    if "int8-weights" in config.compress_comm:
        int8_all_gather(model)  # before fully_shard: see fullshard.compress
    for block in model.blocks:  # bottom-up: each block its own unit, then the root
        if tp_mesh is not None:
            parallelize_module(block, tp_mesh, TP_PLAN)
        fully_shard(block, mesh=mesh, **options)
    fully_shard(model, mesh=mesh, **options)
    return model


def describe_sharding(config: TrainConfig) -> str:
    """How the model is sharded, for the log and the report."""
    if config.api == "fsdp1":
        return f"{config.sharding_strategy}, use_orig_params={config.use_orig_params}"
    options = fsdp2_options(config)
    mesh = (
        "a 2-D (replicate, shard) mesh"
        if config.sharding_strategy == "HYBRID_SHARD"
        else "a 1-D mesh"
    )
    if config.tp > 1:
        mesh = f"the dp dim of a 2-D (dp, tp) mesh, after parallelize_module over tp {config.tp}"
    compressed = f", compressed: {'+'.join(config.compress_comm)}" if config.compress_comm else ""
    return (
        f"{config.sharding_strategy} as fully_shard(reshard_after_forward="
        f"{options['reshard_after_forward']}) on {mesh}{compressed}"
    )


def clip_grad_norm(model: nn.Module, max_norm: float) -> None:
    """Scale the gradients so that the whole model's norm is at most ``max_norm``."""
    if isinstance(model, FSDP):
        model.clip_grad_norm_(max_norm)
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if len({g.device_mesh for g in grads if isinstance(g, DTensor)}) > 1:
        _clip_across_meshes(grads, max_norm)
    else:  # fully_shard: DTensor gradients, whose norm torch reduces over the mesh
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def _clip_across_meshes(grads: list[torch.Tensor], max_norm: float) -> None:
    """``clip_grad_norm_`` for DTensor gradients on several meshes (``--tp``: the blocks' on
    (dp, tp), the root's on dp), which torch's cannot stack into one norm.

    Each rank sums the squares of its local pieces, each weighted by 1 / (the ranks holding
    a copy of it): the replicated dims of its mesh, and the ranks outside its mesh (the root's
    parameters are whole on every tp rank). One all-reduce over the world then gives the
    squared norm of the whole model's gradient, e.g. 4 ranks (dp 2, tp 2): a block's
    ``proj.bias`` (Replicate on tp) counts 1/2 on each rank of a row, a root parameter 1/2
    on each tp rank of its dp shard."""
    world_size = dist.get_world_size()
    # NCCL reduces CUDA tensors only; CPU-offloaded gradients are summed where they live.
    on_cuda = dist.get_backend() == "nccl"
    comm_device = torch.device("cuda", torch.cuda.current_device()) if on_cuda else None
    pieces = []
    for grad in grads:
        assert isinstance(grad, DTensor), "fully_shard made every gradient a DTensor"
        copies = world_size // grad.device_mesh.size()
        for axis, placement in enumerate(grad.placements):
            if placement.is_replicate():
                copies *= grad.device_mesh.size(axis)
        pieces.append((grad.to_local().double().pow(2).sum() / copies).to(comm_device or "cpu"))
    squares = torch.stack(pieces).sum()
    dist.all_reduce(squares)
    scale = min(1.0, max_norm / (squares.sqrt().item() + 1e-6))
    for grad in grads:
        grad.mul_(scale)
