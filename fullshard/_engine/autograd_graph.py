"""The autograd graph as the runtime reads it: tensors inside nested outputs, the nodes a
unit's gradient comes through, and where each unit's forward lies in autograd's sequence
numbers (see [Note: forward inside backward] and [Note: resharding units with frozen
parameters] in runtime.py)."""

from __future__ import annotations

import bisect
import copy
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

__all__: list[str] = []


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested tuples (namedtuples too), lists, dicts and dataclasses."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from iter_tensors(item)
    elif _is_dataclass_instance(obj):
        for field in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, field.name))


def _is_dataclass_instance(obj: Any) -> bool:
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """Apply ``fn`` to every tensor inside nested tuples, namedtuples, lists, dicts and
    dataclasses."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, item) for item in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, item) for item in obj)
    if isinstance(obj, dict):
        return type(obj)((key, map_tensors(fn, value)) for key, value in obj.items())
    if _is_dataclass_instance(obj):  # a copy with its tensors mapped, as torch's FSDP makes
        result = copy.copy(obj)
        for field in dataclasses.fields(obj):
            object.__setattr__(result, field.name, map_tensors(fn, getattr(obj, field.name)))
        return result
    return obj


class ForwardRecord:
    """What one forward of a unit leaves for its backward. The hooks on that forward's
    outputs hold it, so it lives exactly as long as the forward's graph: a forward that is
    never backpropagated (a loss logged with grad on) leaves nothing behind."""

    __slots__ = ("__weakref__", "input_hook", "input_nodes", "inputs", "sources")

    def __init__(self) -> None:
        self.sources: list[torch.autograd.graph.Node] = []
        """The nodes whose execution delivers gradient to the unit's leaf (see
        ``gradient_sources``)."""
        self.inputs: list[torch.Tensor] = []
        """Units with frozen parameters: the forward's inputs that require grad."""
        self.input_nodes: list[torch.autograd.graph.Node] = []
        """The nodes that compute the gradients of ``inputs``."""
        self.input_hook: RemovableHandle | None = None


def gradient_sources(
    outputs: list[torch.Tensor], leaf: torch.Tensor, since: int, nested: NestedForwards
) -> list[torch.autograd.graph.Node]:
    """The nodes of ``outputs``' graph whose execution delivers gradient to ``leaf``: its
    AccumulateGrad, if the graph reaches it, and each reentrant checkpoint region's node,
    which runs a backward of its own (see [Note: forward inside backward]).

    Walks the nodes this unit's forward made (sequence numbers from ``since``), jumping over
    each nested unit's forward to the nodes of its inputs. Regions that turn out not to use
    ``leaf`` only delay the reshard to the end of backward."""
    # Runs once per unit and forward: kept to plain lookups (about 1 us a node).
    sources: list[torch.autograd.graph.Node] = []
    seen: set[torch.autograd.graph.Node] = set()
    jumped: set[int] = set()
    starts = nested.starts
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        name = type(node).__name__
        if name == "AccumulateGrad":  # a leaf: ours, or a dead end
            if node.variable is leaf:  # type: ignore[attr-defined]
                sources.append(node)
            continue
        number = node._sequence_nr()
        if number < since:  # made before this unit's forward
            continue
        index = nested.index_of(number) if starts and number >= starts[0] else None
        if index is not None:  # a nested unit's node: go on from that unit's inputs
            if index not in jumped:
                jumped.add(index)
                stack.extend(nested.inputs[index])
            continue
        if name == "CheckpointFunctionBackward":
            sources.append(node)
        for next_node, _ in node.next_functions:
            if next_node is not None:
                stack.append(next_node)
    return sources


def input_nodes(inputs: list[torch.Tensor]) -> list[torch.autograd.graph.Node]:
    """The nodes that compute the gradients of ``inputs`` (which require grad)."""
    return [torch.autograd.graph.get_gradient_edge(t).node for t in inputs]


def will_run(node: torch.autograd.graph.Node) -> bool:
    """Whether the backward in progress executes ``node`` (called from a backward hook).
    Where torch lacks the query, every node counts: a reshard may then wait for the end of
    backward, never come too early."""
    query = getattr(torch._C, "_will_engine_execute_node", None)
    return True if query is None else bool(query(node))


def autograd_sequence_nr() -> int:
    """The sequence number autograd gives the next node made on this thread."""
    with torch.enable_grad():
        node = _SEQUENCE_PROBE.view(()).grad_fn
    assert node is not None
    return node._sequence_nr()


_SEQUENCE_PROBE = torch.zeros((), requires_grad=True)


class NestedForwards:
    """The unit forwards completed on one thread in this step's forward: their autograd
    sequence numbers as disjoint ``[start, end)`` ranges (a range inside another is dropped),
    and the nodes of each one's inputs."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.inputs: list[list[torch.autograd.graph.Node]] = []

    def add(self, start: int, end: int, inputs: list[torch.autograd.graph.Node]) -> None:
        first = bisect.bisect_left(self.starts, start)  # the units nested in this one end here
        del self.starts[first:], self.ends[first:], self.inputs[first:]
        self.starts.append(start)
        self.ends.append(end)
        self.inputs.append(inputs)

    def index_of(self, number: int) -> int | None:
        index = bisect.bisect_right(self.starts, number) - 1
        return index if index >= 0 and number < self.ends[index] else None
