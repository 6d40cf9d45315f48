"""A unit's sharded parameters as ``DTensor`` s (FSDP2's ``fully_shard``).

With ``Settings.dtensor_mesh`` set, a unit lays its parameters out split on dim 0
(``layout.Dim0Layout``), and each original parameter outside forward and backward is an
``nn.Parameter`` holding a ``DTensor``: ``Shard(0)`` over the mesh's shard dimension
(``(Replicate(), Shard(0))`` on a 2-D HSDP mesh), whose local tensor is this rank's chunk of
the parameter as a view of the unit's flat shard. The optimizer updates that view in place,
so the next all-gather sees the update; the sharded gradient is a ``DTensor`` over a view of
the flat sharded gradient in the same way. These objects keep their identity for the
unit's life (the optimizer holds them); a new storage (``module.to(...)``) is re-pointed into
them, as torch's FSDP2 does.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__: list[str] = []

_MADE_BY: weakref.WeakValueDictionary[int, DTensorParams] = weakref.WeakValueDictionary()
"""id of a DTensor parameter a unit made (or adopted) -> that unit's ``DTensorParams``, which
holds the parameter (held weakly: the entry dies with the unit). Not a weak reference to the
parameter itself: ``torch.utils.swap_tensors`` (``to_empty`` of a meta model) refuses tensors
that have one."""


def sharded_by_a_unit(param: torch.Tensor) -> bool:
    """Whether ``param`` is a DTensor parameter some unit made. One that is not, found by
    ``fully_shard``, belongs to another parallelism (tensor parallel): the unit shards its
    local tensor further (see [Note: tensor-parallel parameters])."""
    owner = _MADE_BY.get(id(param))
    return owner is not None and owner.made.get(id(param)) is param


def placements_for(mesh: DeviceMesh, dim: int = 0) -> tuple[Placement, ...]:
    """``Shard(dim)`` on a 1-D mesh; ``(Replicate(), Shard(dim))`` on a 2-D (replicate,
    shard) one."""
    return (Shard(dim),) if mesh.ndim == 1 else (Replicate(), Shard(dim))


# [Note: tensor-parallel parameters]
# A parameter that is a DTensor already when `fully_shard` meets it (tensor parallel:
# `parallelize_module` with ColwiseParallel, RowwiseParallel, ... on a "tp" mesh) is sharded
# as torch's FSDP2 shards it: the unit lays out its *local* tensor (this rank's TP piece) and
# splits that on dim 0 over the data-parallel mesh. The sharded parameter is a DTensor on the
# data-parallel and TP meshes concatenated, with the data-parallel placement first: Shard(0),
# or `_StridedShard(0, split_factor=t)` where TP already splits dim 0 into t pieces (the
# local rows then interleave with TP's), preceded by Replicate() under HSDP; the TP
# placements follow. Modules compute with the gathered TP piece as a DTensor on the TP mesh
# with its TP placements (`DTensor.from_local`, which autograd traverses: the gradient
# reaches the unit as the TP piece's gradient, redistributed to the TP placements first),
# and the gradient is reduced over the data-parallel mesh only.


class _TensorParallel:
    """What a tensor-parallel parameter keeps of its DTensor: its TP spec, and the spec of
    its sharded form on the concatenated mesh (without dtype: made per dtype)."""

    def __init__(self, spec: DTensorSpec, dp_mesh: DeviceMesh, dim: int) -> None:
        self.spec = spec
        if len(spec.placements) > 2:
            raise NotImplementedError(
                f"FSDP only supports 1D TP/EP or 2D EP+TP, not {spec.placements}"
            )
        self.mesh = DeviceMesh._concatenate([dp_mesh, spec.mesh])
        split_factor = spec.num_shards_map[dim]
        shard: Placement = (
            _StridedShard(dim, split_factor=split_factor) if split_factor > 1 else Shard(dim)
        )
        self.placements: tuple[Placement, ...] = (
            (Replicate(),) * (dp_mesh.ndim - 1) + (shard,) + tuple(spec.placements)
        )


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no autograd link); any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


# [Note: sharding on another dim]
# ``shard_placement_fn`` may shard a parameter on a dim d other than 0 (e.g. MoE experts on
# dim 1), which must split evenly over the n shard ranks (as torch requires). The layout
# only splits dim 0, so such a parameter enters it as an (n, piece) matrix (``to_layout``):
# row r is rank r's ``torch.chunk`` piece on dim d, contiguous. Its local tensor is its
# piece of the shard viewed in the piece's shape (contiguous, as torch's); unsharded, the
# parameter is a contiguous tensor of its own shape, and each rank's piece is copied
# between its narrow on dim d and its block (``Dim0Unsharded.pairs``): one copy each way,
# as torch's copy-out for such dims.


class DTensorParams:
    """Builds and re-points a unit's DTensor parameters and gradients."""

    def __init__(
        self,
        mesh: DeviceMesh,
        params: Sequence[torch.Tensor],
        dims: list[int] | None = None,
        post_forward_group: dist.ProcessGroup | None = None,
        mp_policy: Any = None,
    ) -> None:
        self.mesh = mesh
        self.mp_policy = mp_policy
        """FSDP2's ``MixedPrecisionPolicy`` (what all-gather extensions are given)."""
        self.post_forward_group = post_forward_group
        """``reshard_after_forward=k``: the ``k`` ranks this rank keeps parameters over
        after forward (see ``dim0_unsharded.PostForwardShard``)."""
        self.dims = dims if dims is not None else [0] * len(params)
        """Per parameter, the dim it is sharded on (see [Note: sharding on another dim])."""
        self._tp: list[_TensorParallel | None] = [
            _TensorParallel(p._spec, mesh, dim)
            if isinstance(p, DTensor) and not sharded_by_a_unit(p)
            else None
            for p, dim in zip(params, self.dims)
        ]
        """Per parameter, its tensor parallelism (see [Note: tensor-parallel parameters])."""
        if post_forward_group is not None and any(self._tp):
            raise NotImplementedError(
                "Resharding to smaller mesh is not supported for DTensor parameters yet: "
                "fully_shard(reshard_after_forward=<int>) on tensor-parallel parameters; "
                "use reshard_after_forward=True or False"
            )
        self._placements = [
            placements_for(mesh, dim) if tp is None else tp.placements
            for tp, dim in zip(self._tp, self.dims)
        ]
        self._meshes = [mesh if tp is None else tp.mesh for tp in self._tp]
        self._shapes = [p.shape for p in params]
        """Each parameter's (global) shape; its strides are contiguous ones."""
        self._strides = [torch.empty(shape, device="meta").stride() for shape in self._shapes]
        self.num_shards = mesh.size(mesh.ndim - 1)
        """The ranks parameters are sharded over (the mesh's last dim)."""
        self._own_shapes = [local_tensor(p).shape for p in params]
        self._piece_shapes = [
            torch.Size((*shape[:dim], shape[dim] // self.num_shards, *shape[dim + 1 :]))
            for shape, dim in zip(self._own_shapes, self.dims)
        ]
        """Per parameter, each rank's piece on its shard dim (used for dims other than 0)."""
        self._layout_shapes = [
            self.to_layout(index, torch.empty(shape, device="meta")).shape
            for index, shape in enumerate(self._own_shapes)
        ]
        self._specs: dict[tuple[int, torch.dtype], DTensorSpec] = {}
        """(parameter, dtype) -> the spec its DTensors share (see ``wrap``)."""
        self.made: dict[int, nn.Parameter] = {}
        """id -> the DTensor parameters this unit made or adopted (see ``sharded_by_a_unit``)."""

    def adopt(self, param: nn.Parameter) -> None:
        """``param`` (a DTensor parameter) is the unit's from now on."""
        self.made[id(param)] = param
        _MADE_BY[id(param)] = self

    def unsharded(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Parameter ``index``'s unsharded ``tensor`` as modules compute with it: a TP piece
        becomes its DTensor on the TP mesh (differentiably), anything else stays itself."""
        tp = self._tp[index]
        if tp is None:
            return tensor
        spec = tp.spec
        return DTensor.from_local(
            tensor,
            spec.mesh,
            spec.placements,
            run_check=False,
            shape=spec.shape,
            stride=spec.stride,
        )

    def to_layout(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """Parameter ``index`` (its full value, unsharded) as the layout splits it on dim 0:
        itself, or on another dim an (n, piece) matrix of its ranks' pieces (see [Note:
        sharding on another dim]); of a tensor-parallel DTensor, its local TP piece."""
        tensor = local_tensor(tensor)
        dim = self.dims[index]
        if not dim:
            return tensor
        num_shards = self.num_shards
        pieces = tensor.unflatten(dim, (num_shards, tensor.shape[dim] // num_shards))
        return pieces.movedim(dim, 0).reshape(num_shards, -1)

    def from_layout(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        """``to_layout`` undone (a copy, on another dim than 0)."""
        dim = self.dims[index]
        if not dim:
            return tensor
        shape = self._piece_shapes[index]
        return tensor.view(self.num_shards, *shape).movedim(0, dim).flatten(dim, dim + 1)

    def own_shape(self, index: int) -> torch.Size:
        """Parameter ``index``'s unsharded shape (its TP piece's, under tensor parallel)."""
        return self._own_shapes[index]

    def _local(self, index: int, piece: torch.Tensor) -> torch.Tensor:
        """``piece`` (flat, in layout order) as parameter ``index``'s local tensor."""
        if self.dims[index]:
            return piece.view(self._piece_shapes[index] if piece.numel() else (0,))
        rest = self._layout_shapes[index][1:]
        row_numel = max(1, rest.numel())
        return piece.view(piece.numel() // row_numel, *rest)

    def wrap(self, index: int, piece: torch.Tensor) -> DTensor:
        """Parameter ``index``'s DTensor (a sharded parameter or gradient) over ``piece``, its
        chunk of a shard (flat), which stays where it is.

        Built directly on a spec made once per parameter and dtype, as torch's FSDP2 does,
        not with ``DTensor.from_local``: that copies a local tensor on another device than
        the mesh's to the mesh's device (a CPU-offloaded shard on a CUDA mesh would become a
        GPU copy, no longer a view of the flat shard), and it runs an autograd function and
        makes a new spec per call, while every backward makes a gradient per parameter."""
        return DTensor(
            self._local(index, piece), self._spec(index, piece.dtype), requires_grad=False
        )

    def _spec(self, index: int, dtype: torch.dtype) -> DTensorSpec:
        key = (index, dtype)
        spec = self._specs.get(key)
        if spec is None:
            meta = TensorMeta(self._shapes[index], self._strides[index], dtype)
            spec = DTensorSpec(self._meshes[index], self._placements[index], tensor_meta=meta)
            self._specs[key] = spec
        return spec

    def make_param(self, index: int, piece: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        return self.make_param_on(index, self._local(index, piece.detach()), requires_grad)

    def make_param_on(self, index: int, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """Parameter ``index``'s DTensor parameter over ``local``, its local tensor as it is
        (a tensor subclass's own piece: see [Note: all-gather extensions])."""
        param = nn.Parameter(
            DTensor(local, self._spec(index, local.dtype), requires_grad=False),
            requires_grad=requires_grad,
        )
        # nn.Parameter's detach gave the parameter a spec of its own: gradients (``wrap``)
        # take that very object, as torch's FSDP2 does, so DTensor's dispatch of the
        # optimizer's ops on both finds them identical rather than comparing them
        self._specs[(index, local.dtype)] = param._spec  # type: ignore[attr-defined]
        self.adopt(param)
        return param

    def repoint(self, param: nn.Parameter, index: int, piece: torch.Tensor) -> None:
        """Make ``param``'s local tensor ``piece`` (reshaped) if it is not already."""
        local = local_tensor(param)
        if local.data_ptr() != piece.data_ptr() or local.numel() != piece.numel():
            param._local_tensor = self._local(index, piece.detach())  # type: ignore[attr-defined]
