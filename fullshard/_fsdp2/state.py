"""What ``fully_shard`` keeps on a module, and the module hooks that drive its unit.

``fully_shard`` registers a forward pre-hook and a forward hook on each module of a call;
they hand the unit to the engine's ``before_forward`` / ``after_forward`` (the same the FSDP1
front door calls from its ``forward``). A group (``fully_shard([a, b])``) is one unit: gathered
before the first of its modules runs forward, resharded after the last.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from torch import nn

from .._engine import forward as _forward
from .._engine.flat_param import HandleState
from .._engine.runtime import TrainingState
from .._engine.unit import Unit

__all__ = [
    "ShardedModule",
    "TorchFSDPModule",
    "enter",
    "leave",
    "post_forward",
    "pre_forward",
    "state_of",
]


class TorchFSDPModule:
    """torch's ``FSDPModule`` class while the install switch is on (``_install`` sets it):
    the classes ``fully_shard`` gives modules then derive from it too."""

    cls: type | None = None


STATE_ATTR = "_fullshard_state"
"""Where a module ``fully_shard`` was applied to keeps its ``ShardedModule`` (its
``__dict__``; the engine's registry holds units weakly, so the module must keep it alive)."""


@dataclasses.dataclass(eq=False)
class ShardedModule:
    """What ``fully_shard`` keeps on the module it was applied to (whose class is now ours):
    its unit (the engine's registry holds units weakly) and the FSDP2 options the engine's
    settings do not carry."""

    units: tuple[Unit, ...]
    """The call's units: the one attached to its modules, then its siblings (parameters on
    other meshes or in other dtypes, see [Note: sibling units])."""
    output_dtype: torch.dtype | None
    members: tuple[nn.Module, ...]
    """The modules of the call (one, or a group given as a list)."""
    input_dtypes: list[torch.dtype | None] = dataclasses.field(default_factory=list)
    """Per forward in progress (a module may run inside itself), the dtype to cast outputs
    back to for classes that compute in full precision (the engine's ``before_forward``)."""
    yet_to_run: list[nn.Module] = dataclasses.field(default_factory=list)
    """A group in forward: its modules whose forward has not finished yet."""
    started: list[nn.Module] = dataclasses.field(default_factory=list)
    """A group in forward: its modules whose forward has begun (one beginning again starts
    the group's next forward: the last one raised before the group's end)."""
    opened_in: int | None = None
    """A group in forward: the root's forward it began in (`RootState.forwards`)."""
    group_inputs: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    """A group in forward: each of its modules' inputs (as cast). They are the group's
    forward's inputs: a unit with frozen parameters reshards in backward once all their
    gradients are computed ([Note: resharding units with frozen parameters] in
    runtime.py). The last module's alone let a frozen group reshard before its earlier
    modules' backward had read their parameters."""

    @property
    def unit(self) -> Unit:
        """The unit attached to the call's modules (torch's ``fully_shard.state``)."""
        return self.units[0]

    def forget_forward(self) -> None:
        """After a forward raised (``reset_iter_state``): no forward is in progress."""
        self.input_dtypes.clear()
        self.yet_to_run.clear()
        self.started.clear()
        self.group_inputs.clear()
        OPEN_GROUPS.discard(self)


def state_of(module: nn.Module) -> ShardedModule:
    state: ShardedModule = module.__dict__[STATE_ATTR]
    return state


# -- hooks ---------------------------------------------------------------------------------


OPEN_GROUPS: weakref.WeakSet[ShardedModule] = weakref.WeakSet()
"""Groups whose forward began and has not reached its last module (see `post_forward`)."""


def pre_forward(state: ShardedModule, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    if _tracks_group_forward(state):
        if state.yet_to_run and state.opened_in != _root_forwards(state):
            state.forget_forward()  # left open by modules run outside the root's last forward
        if state.yet_to_run and module not in state.started:
            state.started.append(module)  # the group's forward began at an earlier module
            args, kwargs = _forward.cast_inputs(state.unit, args, kwargs)
            state.group_inputs.append((args, kwargs))
            return args, kwargs
        if state.yet_to_run:  # this module again before the group's end: a forward raised
            state.input_dtypes.clear()
        state.yet_to_run, state.started = list(state.members), [module]
        OPEN_GROUPS.add(state)
        args, kwargs = enter(state, module, args, kwargs)
        state.group_inputs = [(args, kwargs)]
        state.opened_in = _root_forwards(state)  # after enter: a root group begins a forward
        return args, kwargs
    return enter(state, module, args, kwargs)


def post_forward(
    state: ShardedModule, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> Any:
    if _tracks_group_forward(state):
        state.yet_to_run = [m for m in state.yet_to_run if m is not module]
        if state.yet_to_run:  # resharded after the group's last module
            if state.output_dtype is not None:  # each module's output, as torch 2.13's
                output = _forward.cast_floating(state.output_dtype, output)
            return output
        OPEN_GROUPS.discard(state)
        inputs: Any = _take_group_inputs(state)
    else:
        inputs = (args, kwargs)
    if state.unit.runtime.is_root:
        output = _close_open_groups(state, output)
    return leave(state, inputs, output)


def _take_group_inputs(state: ShardedModule) -> tuple[tuple[Any, Any], ...]:
    inputs = tuple(state.group_inputs)
    state.group_inputs.clear()
    return inputs


def _tracks_group_forward(state: ShardedModule) -> bool:
    """A group outside backward. A recomputation in backward (activation checkpointing)
    gathers for each of its modules and may stop before the last one's post-forward, so it
    leaves the group's forward alone, as torch's hooks do in backward: tracking it would
    leave the group open, and the next step would take its first module for a later one of
    that recomputation (and run it on the sharded parameters)."""
    return len(state.members) > 1 and not state.unit.runtime.in_backward()


def _root_forwards(state: ShardedModule) -> int | None:
    root_state = state.unit.runtime.root_state
    return None if root_state is None else root_state.forwards


def _close_open_groups(root: ShardedModule, output: Any) -> Any:
    """At the end of the root's forward, the post-forward of each group whose forward began
    but did not reach every module (one of them ran again after the group's end, or one
    never ran), as torch's ``_force_complete_incomplete_states``: its pre-backward then
    hangs on the root's output, and the next forward starts the group afresh instead of
    taking its first module for a later one of the unfinished forward, which would run on
    the sharded parameters. A group's modules run after the root's forward (a tied output
    layer applied to each chunk of the loss) open it again; the next root forward then
    starts it afresh (`pre_forward`), as torch clears it at the end of backward."""
    root_state = root.unit.runtime.root_state
    for group in [g for g in OPEN_GROUPS if g.unit.runtime.root_state is root_state]:
        OPEN_GROUPS.discard(group)
        group.yet_to_run.clear()
        group.started.clear()
        output = leave(group, _take_group_inputs(group), output)
    return output


def enter(state: ShardedModule, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    """Each unit's pre-forward, the attached one first (it may be the root, which starts
    the step); the inputs cast as the call's policy says."""
    runtime = state.unit.runtime
    if runtime.in_backward():
        RECOMPUTED.add(state)
    elif runtime.is_root and RECOMPUTED:
        _forget_recomputations()
    training = module.training
    args, kwargs, input_dtype = _forward.before_forward(state.unit, args, kwargs, training)
    for sibling in state.units[1:]:
        args, kwargs, _ = _forward.before_forward(sibling, args, kwargs, training)
    state.input_dtypes.append(input_dtype)
    return args, kwargs


RECOMPUTED: weakref.WeakSet[ShardedModule] = weakref.WeakSet()
"""Modules whose forward ran in backward (activation checkpointing's recomputation, which
stops once backward has what it needs, often before the post-forward that pops the entry
`enter` pushed)."""


def _forget_recomputations() -> None:
    """At the root's next forward, drop what recomputations left in ``input_dtypes``: one
    entry per checkpointed module and step otherwise, for as long as training runs."""
    for state in RECOMPUTED:
        state.input_dtypes.clear()
    RECOMPUTED.clear()


def leave(state: ShardedModule, inputs: Any, output: Any) -> Any:
    """Each unit's post-forward, the attached one last (the root's ends the forward);
    ``inputs``: the forward's (``(args, kwargs)``, or a group's modules' all)."""
    input_dtype = state.input_dtypes.pop()
    for sibling in state.units[:0:-1]:
        output = _forward.after_forward(sibling, output, None, inputs)
    output = _forward.after_forward(state.unit, output, input_dtype, inputs)
    if state.output_dtype is not None:
        output = _forward.cast_floating(state.output_dtype, output)
    return output


def register_state_dict_hooks(unit: Unit) -> None:
    """Reshard before ``state_dict()`` / ``load_state_dict()`` reach the unit's modules, as
    torch's: a unit kept unsharded (the root after forward, ``reshard_after_forward=False``)
    registers its unsharded parameters, and state dicts are of the sharded DTensors."""

    def to_sharded(*args: Any, **kwargs: Any) -> None:
        handle = unit.handle
        if (
            handle is not None
            and handle.state != HandleState.SHARDED
            and unit.runtime.training_state == TrainingState.IDLE
        ):
            handle.reshard()

    handle = unit.handle
    if handle is None:
        return
    modules = {id(m): m for owners in handle.owners for m, _ in owners}
    for module in modules.values():
        module.register_state_dict_pre_hook(to_sharded)
        module._register_load_state_dict_pre_hook(to_sharded)
