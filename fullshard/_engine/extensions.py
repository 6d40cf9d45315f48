"""FSDP2's all-gather extensions: a parameter whose local tensor defines
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` chooses what goes on the wire and how the
unsharded parameter is built from it (torchao's float8 and int8 training all-gather 1-byte
weights this way).

[Note: all-gather extensions]
At each unshard, for every parameter whose local tensor has both methods (a tensor subclass
that defines them, or methods set on the local tensor object itself, as torch allows):

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` (or, the old
  signature, ``fsdp_pre_all_gather(mesh)``) returns ``(inputs, metadata)``: each input, in its
  own dtype and of the padded local shape, is all-gathered over the shard group as it is;
- ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the unsharded parameter
  from the gathered ``outputs`` (each ``(ranks * rows, ...)``) and returns it with the tensors
  to free at reshard; modules compute with it, and autograd carries its gradient back to the
  unit's flat gradient like any other parameter's.

A parameter whose class defines the methods when ``fully_shard`` meets it keeps a local
tensor of that class (its ``torch.chunk`` piece, padded as torch pads it): the optimizer
updates that object, which the unit's flat shard does not hold. Its place in the flat
layout carries only its gradient (the shard holds no memory for it where the unit has only
such parameters). ``fully_shard`` gives such parameters a unit of their own
(``_fsdp2/placement.py``) whose flat shard is never all-gathered (``FlatSegment
.from_extensions``), so the wire carries the extension's bytes only. As torch's FSDP2 does,
the output buffers and the post-hook's tensors are kept from one unshard to the next with
their storage freed at reshard (autograd may have saved the unsharded tensor for backward):
the next unshard gathers into the same buffers and calls the post-hook with ``out=`` the
same unsharded tensor, so a saved tensor sees the refilled values.

With ``reshard_after_forward=k`` (ZeRO++'s secondary shard, hpZ), the post-forward reshard
keeps of each all-gather output this rank's ``1/k`` chunk (the outputs of the ranks
``j * n/k ... (j+1) * n/k - 1``, ``j`` this rank's place in its group of ``k`` consecutive
ranks) and the pre-hook's metadata; backward's unshard all-gathers those chunks within the
group of ``k`` into the outputs and calls the post-hook: no second pre-hook (no second
quantization) and no collective over the whole shard group. torch's FSDP2 keeps the one
output of a parameter after forward, then raises NotImplementedError in backward for any
parameter with an extension.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .._comm import collectives as comm
from .storage_pool import POOL

__all__: list[str] = []


def has_extension(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` defines the all-gather extension (both methods, or neither)."""
    pre = hasattr(tensor, "fsdp_pre_all_gather")
    post = hasattr(tensor, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined if using "
            f"all-gather extensions: {type(tensor).__qualname__}"
        )
    return pre


def is_extension_subclass(param: torch.Tensor) -> bool:
    """A parameter of a tensor subclass that defines the all-gather extension (torchao's
    float8 weights): it keeps a local tensor of its class under ``fully_shard``."""
    return type(param) not in (nn.Parameter, torch.Tensor, DTensor) and has_extension(param)


def sharded_local(param: torch.Tensor, rank: int, num_shards: int) -> torch.Tensor:
    """This rank's ``torch.chunk`` piece of ``param`` (a tensor subclass), as a tensor of its
    class over storage padded to the chunk's rows, as torch's FSDP2 makes it."""
    rows = -(-param.shape[0] // num_shards)
    start = min(rank * rows, param.shape[0])
    length = max(0, min(rows, param.shape[0] - start))
    with torch.no_grad():
        padded = param.new_zeros((rows, *param.shape[1:]))
        if length:
            padded.narrow(0, 0, length).copy_(param.narrow(0, start, length))
        return padded.narrow(0, 0, length)


@dataclass
class _Gather:
    """One parameter's extension all-gather in flight."""

    index: int
    local: torch.Tensor
    inputs: list[torch.Tensor]
    sizes: list[torch.Size]
    metadata: Any
    outputs: list[torch.Tensor]
    works: list[comm.Pending] = field(default_factory=list)


@dataclass
class _PostForward:
    """One parameter's all-gather outputs kept over the post-forward group of ``k`` ranks,
    from its forward's reshard to its backward's unshard."""

    chunks: list[torch.Tensor]
    """This rank's ``1/k`` of each output."""
    sizes: list[torch.Size]
    """The all-gather inputs' sizes (how the outputs are viewed)."""
    metadata: Any


@dataclass
class _Kept:
    """One parameter's unsharded tensor and the buffers behind it, kept (their storage freed)
    from one unshard to the next, as torch's FSDP2 keeps them: autograd may have saved the
    tensor for backward, whose unshard refills the same storage (``out=``)."""

    outputs: list[torch.Tensor]
    """The all-gather's output buffers, gathered into again."""
    unsharded: torch.Tensor
    """What modules compute with (the post-hook's tensor, viewed in the parameter's shape)."""
    to_free: list[torch.Tensor]
    """The output buffers and the post-hook's tensors to free at reshard."""
    nbytes: list[int]
    """Their storage's size in bytes, allocated again at the next unshard."""
    dtype: torch.dtype
    sizes: list[torch.Size]
    """The last all-gather's input sizes."""
    metadata: Any
    """The last pre-hook's metadata."""


def _free(tensor: torch.Tensor) -> None:
    if type(tensor) is torch.Tensor:  # a subclass frees through its own inner tensors
        POOL.free(tensor.untyped_storage())  # see [Note: reusing unsharded memory]


def _allocate(tensor: torch.Tensor, nbytes: int) -> None:
    if type(tensor) is torch.Tensor:
        POOL.fill(tensor.untyped_storage(), nbytes)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().nbytes() if type(tensor) is torch.Tensor else 0


class AllGatherExtensions:
    """A unit's extension all-gathers (see [Note: all-gather extensions])."""

    def __init__(
        self,
        mesh: DeviceMesh,
        group: dist.ProcessGroup,
        mp_policy: Any,
        shapes: list[torch.Size],
        modules: list[nn.Module],
        post_forward_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[-1]]  # type: ignore[index]
        """What ``fsdp_pre_all_gather`` is given: the mesh parameters are sharded over."""
        self._group = group
        self._mp_policy = mp_policy
        self._shapes = shapes
        """Per parameter, its (global) shape: the pre-hook's ``outer_size``."""
        self._modules = modules
        """Per parameter, the module that holds it (the pre-hook's ``module``)."""
        self._pending: list[_Gather] = []
        self.unsharded: dict[int, torch.Tensor] = {}
        """Parameter index -> its unsharded tensor built by ``fsdp_post_all_gather``."""
        self._kept: dict[int, _Kept] = {}
        self._post_forward_group = post_forward_group
        """``reshard_after_forward=k``: the group of ``k`` ranks outputs are kept over."""
        self._post_forward: dict[int, _PostForward] = {}

    def issue(self, locals_: dict[int, torch.Tensor], device: torch.device, label: str) -> None:
        """Run the pre-hooks of the parameters in ``locals_`` (index -> local tensor) and issue
        their all-gathers (into the last unshard's buffers, where they fit)."""
        num_ranks = dist.get_world_size(self._group)
        for index, local in locals_.items():
            post_forward = self._post_forward.pop(index, None)
            if post_forward is not None:
                self._pending.append(self._issue_post_forward(index, local, post_forward, label))
                continue
            if local.device != device:
                local = local.to(device)
            inputs, metadata = self._pre_all_gather(index, local)
            inputs = [t.contiguous() for t in inputs]
            wanted = [(t.numel() * num_ranks, t.dtype) for t in inputs]
            outputs = self._outputs(index, wanted, inputs[0].device)
            gather = _Gather(index, local, inputs, [t.size() for t in inputs], metadata, outputs)
            gather.works = [
                comm.all_gather_into(out, t.view(-1), self._group, f"{label} (extension)")
                for out, t in zip(gather.outputs, inputs)
            ]
            self._pending.append(gather)

    def _issue_post_forward(
        self, index: int, local: torch.Tensor, kept: _PostForward, label: str
    ) -> _Gather:
        """The all-gather of the chunks kept after forward, within the group of ``k``."""
        group = self._post_forward_group
        assert group is not None, "kept only with reshard_after_forward=k"
        k = dist.get_world_size(group)
        wanted = [(chunk.numel() * k, chunk.dtype) for chunk in kept.chunks]
        outputs = self._outputs(index, wanted, kept.chunks[0].device)
        gather = _Gather(index, local, kept.chunks, kept.sizes, kept.metadata, outputs)
        gather.works = [
            comm.all_gather_into(out, chunk, group, f"{label} (extension, post-forward)")
            for out, chunk in zip(outputs, kept.chunks)
        ]
        return gather

    def _outputs(
        self, index: int, wanted: list[tuple[int, torch.dtype]], device: torch.device
    ) -> list[torch.Tensor]:
        """The kept buffers, their storage allocated again, if they are ``wanted`` (numel,
        dtype per output); else new."""
        kept = self._kept.get(index)
        if kept is None or [(o.numel(), o.dtype) for o in kept.outputs] != wanted:
            self._kept.pop(index, None)
            return [torch.empty(numel, dtype=dtype, device=device) for numel, dtype in wanted]
        for out in kept.outputs:
            _allocate(out, out.numel() * out.element_size())
        return kept.outputs

    def _pre_all_gather(self, index: int, local: torch.Tensor) -> tuple[list[torch.Tensor], Any]:
        hook = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
        if len(inspect.signature(hook).parameters) == 1:
            inputs, metadata = hook(self.shard_mesh)
        else:
            shape = self._shapes[index]
            stride = torch.empty(shape, device="meta").stride()
            inputs, metadata = hook(
                self.shard_mesh, shape, stride, self._modules[index], self._mp_policy
            )
        return list(inputs), metadata

    def wait(self, param_dtypes: dict[int, torch.dtype]) -> None:
        """Wait for the all-gathers and build the unsharded parameters (``param_dtypes``:
        index -> the dtype to build in): into the last unshard's tensor (``out=``) where it
        was kept in that dtype, else a new one."""
        pending, self._pending = self._pending, []
        for gather in pending:
            for work in gather.works:
                work.wait()
            outputs = tuple(
                out.view(-1, *size[1:]) for out, size in zip(gather.outputs, gather.sizes)
            )
            hook = gather.local.fsdp_post_all_gather  # type: ignore[attr-defined]
            dtype = param_dtypes[gather.index]
            kept = self._kept.get(gather.index)
            if kept is not None and kept.dtype == dtype and kept.outputs is gather.outputs:
                for tensor, nbytes in zip(kept.to_free, kept.nbytes):
                    _allocate(tensor, nbytes)
                hook(outputs, gather.metadata, dtype, out=kept.unsharded)
                kept.sizes, kept.metadata = gather.sizes, gather.metadata
            else:
                unsharded, to_free = hook(outputs, gather.metadata, dtype)
                kept = self._keep(gather, unsharded, to_free, dtype)
            self.unsharded[gather.index] = kept.unsharded

    def _keep(
        self, gather: _Gather, unsharded: torch.Tensor, to_free: Any, dtype: torch.dtype
    ) -> _Kept:
        shape = self._shapes[gather.index]
        stride = torch.empty(shape, device="meta").stride()
        tensors = [
            *gather.outputs,
            *(t for t in to_free if all(t is not o for o in gather.outputs)),
        ]
        kept = _Kept(
            gather.outputs,
            torch.as_strided(unsharded, shape, stride, 0),
            tensors,
            [_nbytes(t) for t in tensors],
            dtype,
            gather.sizes,
            gather.metadata,
        )
        self._kept[gather.index] = kept
        return kept

    def reshard(self, after_forward: bool = False) -> None:
        """Drop the unsharded tensors and free the storage behind them (what autograd saved
        of them holds none until the next unshard refills it, as torch's FSDP2 does);
        ``after_forward`` with ``reshard_after_forward=k``, keep this rank's chunk of each
        output first."""
        for gather in self._pending:
            for work in gather.works:
                work.wait()
        self._pending = []
        if after_forward and self._post_forward_group is not None:
            self._keep_post_forward()
        else:
            self._post_forward.clear()
        self.unsharded = {}
        for kept in self._kept.values():
            for tensor in kept.to_free:
                _free(tensor)

    def _keep_post_forward(self) -> None:
        group = self._post_forward_group
        k, place = dist.get_world_size(group), dist.get_rank(group)
        for index in self.unsharded:
            kept = self._kept[index]
            chunks = []
            for out in kept.outputs:
                size = out.numel() // k  # n ranks' outputs, n a multiple of k
                chunks.append(out.view(-1).narrow(0, place * size, size).clone())
            self._post_forward[index] = _PostForward(chunks, kept.sizes, kept.metadata)

    def drop_post_forward(self) -> None:
        """The parameters changed since their forward: what was kept is stale."""
        self._post_forward.clear()
