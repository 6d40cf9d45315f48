"""Where ``fully_shard`` shards each parameter of a call: which mesh, which dim, and so which
unit (see [Note: sibling units] in ``_engine/unit.py``).

``shard_placement_fn(param)`` may return None (dim 0 on the call's mesh), a ``Shard(dim)``
(that dim, on the call's mesh) or, as torch 2.13 allows, a ``ShardPlacementResult``: a
placement and a mesh of the parameter's own (``FSDPMeshInfo`` for a 1-D mesh,
``HSDPMeshInfo`` for a 2-D (replicate, shard) one), e.g. experts sharded over the
expert-data-parallel mesh beside the rest of a block over the data-parallel mesh. The call's
parameters are grouped by mesh, as torch groups them by process group; a mesh's group
that mixes dtypes (bf16 weights, fp32 norms) is split by dtype, and parameters whose
all-gather extension builds their unsharded tensors (torchao's float8 weights) go in a group
of their own, so that only the extension's bytes go on the wire (see [Note: all-gather
extensions]): one unit per group.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from .._engine.dtensor_params import sharded_by_a_unit
from .._engine.extensions import is_extension_subclass

__all__: list[str] = []


class InvalidShardDimError(ValueError, AssertionError):
    """``shard_placement_fn`` named a dim the parameter lacks: torch raises an
    AssertionError, fullshard raised ValueError before, so it is both."""


@dataclass
class ParamGroup:
    """The parameters of one ``fully_shard`` call that one unit shards: one mesh, and one
    dtype per flat segment."""

    mesh: DeviceMesh
    params: list[nn.Parameter] = field(default_factory=list)
    dims: dict[int, int] = field(default_factory=dict)
    """id(param) -> the dim it is sharded on (absent: dim 0)."""
    tag: str = ""
    """What sets the group apart from the call's first (its mesh, its dtype, its all-gather
    extensions), e.g. ``"mesh (ep_replicate 2, ep_shard 2)"``; its unit's label shows it."""

    def shard_dim(self) -> Callable[[nn.Parameter], int] | None:
        """Each parameter's dim, for the unit's settings (None: dim 0 for every one)."""
        if not self.dims:
            return None
        dims = dict(self.dims)
        return lambda param: dims.get(id(param), 0)


def param_groups(
    module: nn.Module,
    mesh: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    ignored: set[nn.Parameter] | None,
) -> list[ParamGroup]:
    """The call's parameters (not ignored, not a nested call's) grouped by mesh, then by
    dtype where a mesh's parameters mix them; the call's own mesh first. Always at least one
    group (a call managing no parameter still has a unit)."""
    by_mesh: dict[tuple[Any, ...], ParamGroup] = {_mesh_key(mesh): ParamGroup(mesh)}
    skipped = {id(p) for p in ignored or ()}
    for name, param in module.named_parameters():
        if id(param) in skipped or sharded_by_a_unit(param):
            continue
        placement = shard_placement_fn(param) if shard_placement_fn is not None else None
        param_mesh = mesh
        if hasattr(placement, "mesh_info"):  # torch 2.13's ShardPlacementResult
            placement, param_mesh = _placement_mesh(placement, name)
        tag = "" if param_mesh is mesh else _describe(param_mesh)
        group = by_mesh.setdefault(_mesh_key(param_mesh), ParamGroup(param_mesh, tag=tag))
        group.params.append(param)
        dim = _shard_dim(placement, param, name, param_mesh)
        if dim:
            group.dims[id(param)] = dim
    groups = [g for i, g in enumerate(by_mesh.values()) if i == 0 or g.params]
    groups = [split for group in groups for split in _split_extensions(group)]
    return [split for group in groups for split in _split_by_dtype(group)]


def _describe(mesh: DeviceMesh) -> str:
    """``"mesh (ep_replicate 2, ep_shard 2)"``, or ``"mesh (2, 2)"`` without dim names."""
    names = mesh.mesh_dim_names or ("",) * mesh.ndim
    return "mesh (" + ", ".join(f"{n} {s}".strip() for n, s in zip(names, mesh.shape)) + ")"


def _mesh_key(mesh: DeviceMesh) -> tuple[Any, ...]:
    """Meshes whose shard and replicate process groups are the same shard alike."""
    replicate = mesh.get_group(0) if mesh.ndim == 2 else None
    return (mesh.device_type, mesh.get_group(mesh.ndim - 1), replicate)


def _placement_mesh(result: Any, name: str) -> tuple[Shard | None, DeviceMesh]:
    """The placement and mesh of a ``ShardPlacementResult``: its mesh must be one
    ``fully_shard`` takes, a 1-D one sharded over (``FSDPMeshInfo``) or a 2-D one replicated
    over dim 0 and sharded over dim 1 (``HSDPMeshInfo``)."""
    info = result.mesh_info
    replicate_dim = getattr(info, "replicate_mesh_dim", None)
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"shard_placement_fn returned a ShardPlacementResult for parameter '{name}' with "
            "dp_mesh_dims (an SPMD mesh): fullshard does not implement it yet; give a mesh of "
            "the data-parallel dims only (FSDPMeshInfo(mesh=world_mesh['edp'], "
            "shard_mesh_dim=0))"
        )
    if (info.mesh.ndim, info.shard_mesh_dim, replicate_dim) not in ((1, 0, None), (2, 1, 0)):
        raise ValueError(
            f"shard_placement_fn returned a ShardPlacementResult for parameter '{name}' on "
            f"mesh {info.mesh} with shard_mesh_dim={info.shard_mesh_dim} and "
            f"replicate_mesh_dim={replicate_dim}: fully_shard shards over a 1-D mesh "
            "(FSDPMeshInfo(mesh, shard_mesh_dim=0)) or a 2-D (replicate, shard) mesh "
            "(HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)); slice the mesh "
            "to those dims"
        )
    return result.placement, info.mesh


def _shard_dim(placement: Any, param: nn.Parameter, name: str, mesh: DeviceMesh) -> int:
    """The dim ``placement`` shards ``param`` on, checked: a ``Shard`` of one of its dims,
    which splits evenly over the mesh's shard ranks unless it is dim 0 (torch's rules)."""
    if placement is None:
        return 0
    if type(placement) is not Shard:
        raise ValueError(
            f"shard_placement_fn returned {placement!r} for parameter '{name}': fully_shard "
            "shards a parameter on one dim, Shard(dim) (None: Shard(0))"
        )
    dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
    if not 0 <= dim < param.ndim:
        raise InvalidShardDimError(
            f"Shard dim {dim} is invalid for {param.ndim}D tensor: {param.shape}: "
            f"shard_placement_fn returned Shard({placement.dim}) for parameter '{name}' of "
            f"shape {tuple(param.shape)}, which has no such dim"
        )
    num_shards = mesh.size(mesh.ndim - 1)
    if dim > 0 and param.shape[dim] % num_shards != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: {param.shape} (world "
            f"size: {num_shards}): parameter '{name}' has {param.shape[dim]} on dim {dim}; "
            "shard it on a dim that splits evenly, or on dim 0 (None), which may be uneven"
        )
    return dim


def _split_extensions(group: ParamGroup) -> list[ParamGroup]:
    """``group``, or its parameters without all-gather extensions and those with them."""
    extended = [is_extension_subclass(p) for p in group.params]
    if all(extended) or not any(extended):
        return [group]
    return [
        _subgroup(group, lambda i: not extended[i]),
        _subgroup(group, lambda i: extended[i], "all-gather extensions"),
    ]


def _subgroup(group: ParamGroup, keep: Callable[[int], bool], tag: str = "") -> ParamGroup:
    """The parameters of ``group`` whose index ``keep`` takes, with their dims; ``tag`` is
    added to the group's."""
    part = ParamGroup(group.mesh, tag=", ".join(t for t in (group.tag, tag) if t))
    for index, param in enumerate(group.params):
        if keep(index):
            part.params.append(param)
            if id(param) in group.dims:
                part.dims[id(param)] = group.dims[id(param)]
    return part


def _split_by_dtype(group: ParamGroup) -> list[ParamGroup]:
    """``group`` as it is when one unit can hold it (one dtype among its trainable
    parameters and one among its frozen ones: a flat segment each), else one group per
    dtype, in the order the dtypes first appear."""
    uniform = all(
        len({p.dtype for p in group.params if p.requires_grad is trains}) <= 1
        for trains in (True, False)
    )
    if uniform:
        return [group]
    dtypes = [p.dtype for p in group.params]
    return [
        _subgroup(group, functools.partial(_is, dtypes, dtype), str(dtype).removeprefix("torch."))
        for dtype in dict.fromkeys(dtypes)
    ]


def _is(values: list[Any], value: Any, index: int) -> bool:
    return bool(values[index] == value)
