"""``clip_grad_norm_`` over sharded gradients.

The total norm is assembled from per-rank pieces: each sharded unit's gradient is split over
its shard group, so the p-th powers of the local shard norms are summed over that group
(max for the inf-norm). A NO_SHARD unit's gradient is already whole and identical on every
rank, so it is added once, locally, after the reduction. Every rank ends with the same total
and so scales by the same coefficient.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.distributed as dist

from .._comm import collectives as comm
from .._engine.unit import Unit, handles_in

__all__: list[str] = []


def _norm_power(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """sum(|g|^p) over ``grads`` (max(|g|) for the inf-norm), in float32 on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch.stack(
        [
            torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
            for g in grads
        ]
    )
    if math.isinf(norm_type):
        return norms.max()
    return norms.pow(norm_type).sum()


def clip_grad_norm_(root: Unit, max_norm: float, norm_type: float) -> torch.Tensor:
    max_norm = float(max_norm)
    norm_type = float(norm_type)
    if norm_type <= 0:
        raise ValueError(f"clip_grad_norm_ needs norm_type > 0, got {norm_type}")
    device = root.compute_device
    is_inf = math.isinf(norm_type)
    sharded: dict[dist.ProcessGroup, list[torch.Tensor]] = {}
    replicated: list[torch.Tensor] = []
    managed: set[int] = set()
    for handle in handles_in(root.fsdp_module):
        params = handle.orig_params if handle._use_orig_params else [handle.flat_param]
        managed.update(id(p) for p in params)
        managed.update(id(flat_param) for flat_param in handle.flat_params)
        grads = [p.grad for p in params if p.grad is not None]
        if handle.uses_sharded_strategy:
            # Keyed by group, in traversal order: the same order of all-reduces on every rank.
            sharded.setdefault(handle.groups.shard, []).extend(grads)
        else:
            replicated.extend(grads)
    # Parameters no unit manages (none today; ignored modules later) are replicated.
    replicated.extend(
        p.grad for p in root.fsdp_module.parameters() if id(p) not in managed and p.grad is not None
    )
    all_grads = [g for grads in sharded.values() for g in grads] + replicated

    total = torch.zeros((), dtype=torch.float32, device=device)
    for group, grads in sharded.items():
        local = _norm_power(grads, norm_type, device)
        op = dist.ReduceOp.MAX if is_inf else dist.ReduceOp.SUM
        comm.all_reduce(local, group, "clip_grad_norm_", op).wait()
        total = torch.maximum(total, local) if is_inf else total + local
    if replicated:
        local = _norm_power(replicated, norm_type, device)
        total = torch.maximum(total, local) if is_inf else total + local
    if not is_inf:
        total = total.pow(1.0 / norm_type)
    if root.settings.offload_params:
        total = total.cpu()

    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in all_grads:
        grad.detach().mul_(clip_coef.to(device=grad.device, dtype=grad.dtype))
    if not all_grads:
        warnings.warn(
            f"Called FSDP.clip_grad_norm_() on rank {root.settings.sharding.groups.shard_rank} with no gradients -- returning "
            f"the total norm in the default dtype {total.dtype}",
            stacklevel=3,
        )
        return total
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in all_grads))
    return total.to(dtype)
