"""User-supplied collectives and hooks: FSDP2's ``set_custom_all_gather``,
``set_custom_reduce_scatter`` and ``set_all_reduce_hook``.

A custom collective is an object with torch's ``Comm`` interface
(``torch.distributed.fsdp._fully_shard._fsdp_api.AllGather`` / ``ReduceScatter``; matched by
shape, never imported): ``allocate(size, *, dtype, device)`` makes the buffers it reads and
writes, and calling it issues the collective. fullshard calls it in place of its own
transport for the unit it was set on, with ``async_op=True``, and records it in
``COUNTERS`` like its own (the bytes are the buffers', whatever the comm does with them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .collectives import COUNTERS, Pending, completed, issued

__all__: list[str] = []


class CustomComm(Protocol):
    """torch's ``Comm``: where the collective's buffers come from."""

    def allocate(
        self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor: ...


def check_comm(comm: Any, what: str) -> None:
    """``comm`` has torch's ``Comm`` interface (``allocate`` and ``__call__``)."""
    if not (callable(getattr(comm, "allocate", None)) and callable(comm)):
        raise TypeError(
            f"{what} takes an object with allocate(size, *, dtype, device) and "
            f"__call__(output_tensor, input_tensor, group, ...) (torch's {what[4:]} "
            f"interface), got {type(comm).__qualname__}"
        )


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def all_gather(
    comm: Any, output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup, label: str
) -> Pending:
    """``comm(output_tensor=output, input_tensor=shard, group=group, async_op=True)``."""
    num_ranks = dist.get_world_size(group)
    COUNTERS.record("all_gather", label, _bytes(output) * (num_ranks - 1) / num_ranks)
    work = comm(output_tensor=output, input_tensor=shard, group=group, async_op=True)
    return (
        completed("all_gather", label, group)
        if work is None
        else issued("all_gather", label, group, work)
    )


def reduce_scatter(
    comm: Any,
    output: torch.Tensor,
    full: torch.Tensor,
    group: dist.ProcessGroup,
    label: str,
    predivide: float,
) -> Pending:
    """``comm(output_tensor=output, input_tensor=full / predivide, group=group,
    op=SUM, async_op=True)``. fullshard divides around the sum itself (``predivide`` here,
    the rest after), so the op is always a sum: the result is torch's, whose op would be an
    average or a pre-multiplied sum on backends that have them."""
    num_ranks = dist.get_world_size(group)
    COUNTERS.record("reduce_scatter", label, _bytes(full) * (num_ranks - 1) / num_ranks)
    if predivide != 1:
        full.div_(predivide)
    work = comm(
        output_tensor=output,
        input_tensor=full,
        group=group,
        op=dist.ReduceOp.SUM,
        async_op=True,
    )
    return (
        completed("reduce_scatter", label, group)
        if work is None
        else issued("reduce_scatter", label, group, work)
    )


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """Run the block with ``stream`` current, ordered after the current stream's work and
    before anything the current stream does next (no stream: run it as it is). A CPU
    stream has no ``device``; its module is ``torch.cpu``."""
    if stream is None:
        yield
        return
    device = getattr(stream, "device", None)
    module = torch.get_device_module(device.type if device is not None else "cpu")
    current = module.current_stream()
    stream.wait_stream(current)
    with module.stream(stream):
        yield
    current.wait_stream(stream)


def run_all_reduce_hook(
    hook: Callable[[torch.Tensor], None], reduced: torch.Tensor, stream: Any
) -> None:
    """``set_all_reduce_hook``'s hook on the reduced gradient shard (after the replicas'
    all-reduce under HSDP, before the gradient's last division), on ``stream`` if given."""
    with _on_stream(stream):
        hook(reduced)
