"""Compressed communication for ``fully_shard``, built on FSDP2's own extension points.

- Weights: ``int8_all_gather(module)`` makes each weight matrix of ``module`` an
  ``Int8AllGatherWeight``, a tensor subclass with FSDP2's all-gather extension: its
  all-gather carries int8 values, and ``fsdp_post_all_gather`` dequantizes them into the
  compute dtype with one float32 scale per column (block quantization by columns, as ZeRO++'s
  qwZ quantizes by blocks; the columns are not split by FSDP's dim-0 sharding, so the
  scales come from one small all-reduce of the columns' largest magnitudes, and every rank
  holds them: torch requires every all-gather input of an unevenly split parameter to have
  the parameter's padded shape, which leaves no room to gather per-row scales). The sharded parameter stays in full precision: the optimizer steps on it, and only
  the copy used for forward and backward is rounded. Gradients flow to the full-precision
  shard as if the weight were not rounded (straight through). fullshard gives such weights a
  unit of their own whose flat shard is not all-gathered, so the wire carries the int8 bytes
  and scales only (see [Note: all-gather extensions]); torch's ``fully_shard`` runs the same
  subclass.
- Gradients: ``bf16_gradients(policy)``: the ``MixedPrecisionPolicy`` with
  ``reduce_dtype=torch.bfloat16`` (half the bytes of a float32 reduce-scatter).
- Keeping parameters over ``k`` ranks between forward and backward, ZeRO++'s secondary
  shard (hpZ), is ``fully_shard``'s own ``reshard_after_forward=k`` for the other units; an
  int8 weight's unit does not keep a ``k``-rank slice yet (it reshards fully and gathers
  again over the whole shard group in backward).

Apply ``int8_all_gather`` before ``fully_shard``. Each rounding error is at most half a
scale step, ``max(|column|) / 254``.
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
    """A weight whose FSDP2 all-gather sends int8 values (a float32 scale per column); the
    values it holds (``_tensor``) are full precision."""

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
    ) -> tuple[tuple[torch.Tensor], torch.Tensor]:
        """This rank's rows as int8, padded to the rows every rank sends (torch's rule for
        uneven shards), and the per-column scales, the same on every rank (the columns'
        largest magnitudes, all-reduced over the shard group: one float32 per column).

        Example, one column [0.5, -1.0] on rank 0 and [0.25] on rank 1: scale 1.0 / 127,
        values [64, -127] and [32, 0] (the padding row)."""
        if tuple(self._tensor.shape[1:]) != tuple(outer_size[1:]):
            raise NotImplementedError(
                "Int8AllGatherWeight is all-gathered by rows: shard it on dim 0 (a "
                f"shard_placement_fn returned another dim for a weight of shape {outer_size})"
            )
        rows = self._tensor.flatten(1).float()  # (r, C), r may be 0
        amax = rows.abs().amax(dim=0) if rows.shape[0] else rows.new_zeros(rows.shape[1])
        group = mesh.get_group()
        dist.all_reduce(amax, dist.ReduceOp.MAX, group=group)  # (C,)
        COUNTERS.record("all_reduce", "int8 scales", amax.numel() * amax.element_size())
        scales = amax.clamp_min(1e-30) / 127  # (C,)
        padded_rows = -(-outer_size[0] // group.size())
        values = torch.zeros(padded_rows, rows.shape[1], dtype=torch.int8, device=rows.device)
        values[: rows.shape[0]] = torch.round(rows / scales).clamp_(-127, 127).to(torch.int8)
        return (values.view(padded_rows, *outer_size[1:]),), scales

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """Every rank's rows dequantized into ``param_dtype`` (``(ranks * rows, ...)``)."""
        (values,) = outputs  # (N * R, ...)
        scales: torch.Tensor = metadata  # (C,)
        full = (values.reshape(values.shape[0], -1).float() * scales).to(param_dtype)
        full = full.view(values.shape)
        if out is not None:
            # torch hands back the (unpadded) tensor of the forward's gather, which autograd
            # may have saved: the values are the same, so the version stays
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(full[: out.shape[0]])
            return None
        return full, (values, full)  # both freed at reshard


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
