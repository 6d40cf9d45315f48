"""Compressed communication for ``fully_shard``, built on FSDP2's own extension points.

- Weights: ``int8_all_gather(module)`` makes each weight matrix of ``module`` an
  ``Int8AllGatherWeight``, a tensor subclass with FSDP2's all-gather extension: its
  all-gather carries int8 values and float32 scales, and ``fsdp_post_all_gather``
  dequantizes them into the compute dtype in one multiplication (see [Note: int8 blocks]).
  The sharded parameter stays in full precision: the optimizer steps on it, and only
  the copy used for forward and backward is rounded. Gradients flow to the full-precision
  shard as if the weight were not rounded (straight through). fullshard gives such weights a
  unit of their own whose flat shard is not all-gathered, so the wire carries the int8 bytes
  and scales only (see [Note: all-gather extensions]); torch's ``fully_shard`` runs the same
  subclass.
- Gradients: ``bf16_gradients(policy)``: the ``MixedPrecisionPolicy`` with
  ``reduce_dtype=torch.bfloat16`` (half the bytes of a float32 reduce-scatter).
- Keeping parameters over ``k`` ranks between forward and backward, ZeRO++'s secondary
  shard (hpZ), is ``fully_shard``'s own ``reshard_after_forward=k``: an int8 weight keeps its
  ``1/k`` of the gathered int8 rows and scales (a quarter of a float32 slice's bytes), and
  backward all-gathers them within the group of ``k`` ranks, with no second quantization
  (see [Note: all-gather extensions]). torch's ``fully_shard`` does not implement this
  for any all-gather extension (its backward raises NotImplementedError).

Apply ``int8_all_gather`` before ``fully_shard``.

[Note: int8 blocks]
A weight is quantized in blocks, as ZeRO++'s qwZ does: a block is one column of one rank's
rows, with a float32 scale ``max(|block|) / 127``; each rounding error is at most half a
scale step, ``max(|block|) / 254``. Each rank quantizes its own rows with no communication
and all-gathers its scales (a ``(1, C)`` input) with its int8 rows: ``4 / rows`` more bytes
per element than int8 alone. torch requires every all-gather input of an unevenly split
parameter to have the parameter's padded shard shape, which leaves no room for the scales;
for such a weight the blocks are whole columns, their scales the same on every rank, from
one all-reduce of the columns' largest magnitudes (a blocking collective per all-gather).
Each all-gather quantizes again (forward and backward, twice a step): about 3 ms per 2M
elements on one core, against the risk of a kept copy going stale (a DTensor's in-place
ops do not move its local tensor's version counter, and plain views of the values escape
the subclass). The dequantization is one multiplication into the unsharded tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from ._comm.collectives import COUNTERS
from .api import MixedPrecisionPolicy

__all__ = ["Int8AllGatherWeight", "bf16_gradients", "int8_all_gather"]

_PRESERVED = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
}
"""Operations whose results stay ``Int8AllGatherWeight`` s: those FSDP and module conversion
use to shard, pad, copy and move a parameter. Any other operation (the optimizer's
arithmetic, a module's forward outside FSDP) sees the full-precision values."""


class Int8AllGatherWeight(torch.Tensor):
    """A weight whose FSDP2 all-gather sends int8 values (float32 scales per block: see [Note:
    int8 blocks]); the values it holds (``_tensor``) are full precision."""

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Int8AllGatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        args, kwargs = pytree.tree_map_only(
            Int8AllGatherWeight, lambda t: t._tensor, (args, kwargs or {})
        )
        out = func(*args, **kwargs)
        if func not in _PRESERVED:
            return out
        return pytree.tree_map_only(torch.Tensor, Int8AllGatherWeight, out)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``, torch's checkpoint API) as its full-precision values, a
        plain tensor: a checkpoint of a compressed run loads anywhere, ``weights_only``
        included, and into an uncompressed model."""
        return self._tensor.__reduce_ex__(protocol)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], meta: Any, outer_size: Any, outer_stride: Any
    ) -> Int8AllGatherWeight:
        return Int8AllGatherWeight(inner["_tensor"])

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"Int8AllGatherWeight({self._tensor})"

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, mp_policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """This rank's rows as int8 and their scales (see [Note: int8 blocks]).

        Example, one column [0.5, -1.0] on rank 0 and [0.25, 0.125] on rank 1: scales
        [1.0 / 127] and [0.25 / 127], values [64, -127] and [127, 64]."""
        if tuple(self._tensor.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(
                "Int8AllGatherWeight is all-gathered by rows: shard it on dim 0 (a "
                f"shard_placement_fn returned another dim for a weight of shape {outer_size})"
            )
        group = mesh.get_group()
        rows = self._tensor.flatten(1)  # (r, C), r may be 0
        ranks = group.size()
        if outer_size[0] % ranks == 0:  # even rows: every rank's scales gathered with its rows
            scales = _column_amax(rows) / 127  # (C,)
            values = _quantize(rows, scales, rows.shape[0])
            return (values.view(rows.shape[0], *outer_size[1:]), scales.view(1, -1)), None
        # padded rows: one set of scales for every rank (torch's rule leaves no room)
        amax = _column_amax(rows)
        dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)  # (C,)
        COUNTERS.record("all_reduce", "int8 scales", amax.numel() * amax.element_size())
        padded_rows = -(-outer_size[0] // ranks)
        values = _quantize(rows, amax / 127, padded_rows)
        return (values.view(padded_rows, *outer_size[1:]),), amax / 127

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: torch.Tensor | None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Every rank's rows dequantized into ``param_dtype`` (``(ranks * rows, ...)``), in
        one multiplication by each rank's scales (into ``out`` when given)."""
        values = outputs[0]  # (N * R, ...)
        # (N, C): each rank's own scales; or (1, C): the same for every rank
        scales = outputs[1] if metadata is None else metadata.view(1, -1)
        rows = values.shape[0] if out is None else out.shape[0]  # torch hands back unpadded
        columns = scales.shape[1]
        blocks = values.reshape(scales.shape[0], -1, columns)
        if out is None:
            full = torch.empty(values.shape, dtype=param_dtype, device=values.device)
            torch.mul(blocks, scales.unsqueeze(1), out=full.view(blocks.shape))
            return full, (values, full)  # both freed at reshard
        # the tensor of the forward's gather, which autograd may have saved: the values are
        # the same, so the version stays
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
            if rows == values.shape[0]:
                torch.mul(blocks, scales.unsqueeze(1), out=out.view(blocks.shape))
            else:  # one block (the padded case): the padding rows are not written
                torch.mul(values[:rows].view(rows, columns), scales, out=out.view(rows, columns))
        return None


def _column_amax(rows: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of each column of ``rows`` (``(r, C)``, ``r`` may be 0), in
    float32, at least 1e-30 (an all-zero or empty column still gets a usable scale)."""
    if rows.shape[0] == 0:
        return rows.new_full((rows.shape[1],), 1e-30, dtype=torch.float32)
    high, low = rows.amax(dim=0), rows.amin(dim=0)  # faster than aminmax or abs() by columns
    return torch.maximum(high, low.neg()).float().clamp_min_(1e-30)


def _quantize(rows: torch.Tensor, scales: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``rows / scales`` rounded to int8, in ``num_rows`` rows (zeros past ``rows``)."""
    values = torch.empty(num_rows, rows.shape[1], dtype=torch.int8, device=rows.device)
    values[rows.shape[0] :].zero_()
    scaled = rows.float() / scales  # the one full-size temporary
    torch.round(scaled, out=scaled).clamp_(-127, 127)
    values[: rows.shape[0]].copy_(scaled)
    return values


def int8_all_gather(module: nn.Module) -> int:
    """Make every floating-point parameter of ``module`` with two or more dims (weight
    matrices, embeddings) an ``Int8AllGatherWeight``, in place; returns how many. Call it
    before ``fully_shard``; a tied parameter is converted once and stays tied."""
    converted: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None or param.ndim < 2 or not param.is_floating_point():
                continue
            if isinstance(param, Int8AllGatherWeight):
                continue
            if id(param) not in converted:
                data = Int8AllGatherWeight(param.detach())
                converted[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            submodule._parameters[name] = converted[id(param)]
    return len(converted)


def bf16_gradients(policy: MixedPrecisionPolicy | None = None) -> MixedPrecisionPolicy:
    """``policy`` (default: none) with gradients reduced in bfloat16."""
    return dataclasses.replace(policy or MixedPrecisionPolicy(), reduce_dtype=torch.bfloat16)
