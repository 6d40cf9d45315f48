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

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

__all__: list[str] = []


def placements_for(mesh: DeviceMesh) -> tuple[Placement, ...]:
    """``Shard(0)`` on a 1-D mesh; ``(Replicate(), Shard(0))`` on a 2-D (replicate, shard) one."""
    return (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0))


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (no autograd link); any other tensor as it is."""
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


class DTensorParams:
    """Builds and re-points a unit's DTensor parameters and gradients."""

    def __init__(self, mesh: DeviceMesh, shapes: list[torch.Size]) -> None:
        self.mesh = mesh
        self.placements = placements_for(mesh)
        self._shapes = shapes
        self._strides = [torch.empty(shape, device="meta").stride() for shape in shapes]
        """Each parameter's contiguous stride (its DTensors' global stride)."""

    def _local_shape(self, index: int, piece: torch.Tensor) -> tuple[int, ...]:
        rest = tuple(self._shapes[index][1:])
        row_numel = max(1, torch.Size(rest).numel())
        return (piece.numel() // row_numel, *rest)

    def wrap(self, index: int, piece: torch.Tensor) -> DTensor:
        """Parameter ``index``'s DTensor over ``piece`` (its chunk of a shard, flat)."""
        local = piece.view(self._local_shape(index, piece))
        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self._shapes[index],
            stride=self._strides[index],
        )

    def make_param(self, index: int, piece: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        return nn.Parameter(self.wrap(index, piece.detach()), requires_grad=requires_grad)

    def repoint(self, param: nn.Parameter, index: int, piece: torch.Tensor) -> None:
        """Make ``param``'s local tensor ``piece`` (reshaped) if it is not already."""
        local = local_tensor(param)
        if local.data_ptr() != piece.data_ptr() or local.numel() != piece.numel():
            param._local_tensor = piece.detach().view(self._local_shape(index, piece))  # type: ignore[attr-defined]
