"""Optimizer state dicts: per original parameter (FULL), as dim-0 DTensors (SHARDED), and
back to what the optimizer loads.

[Note: optimizer state keys]
An optimizer over an FSDP model holds flat parameters (``use_orig_params=False``: one per
unit, its state shaped like this rank's flat shard) or original parameters (``True``: each a
1-D piece of its shard, empty where the rank holds none of it, and then with no state, since
it never gets a gradient). ``optim_state_dict`` rewrites that into what an optimizer over the
unwrapped model would hold, keyed by each original parameter's fully qualified name:

- A state of the parameter's shape (``exp_avg``, ``momentum_buffer``) is rebuilt unit by unit:
  each rank lays its pieces out in its shard's layout (zeros where it has none), one
  all-gather over the unit's shard group gives the full flat state, and each parameter's
  slice is viewed in its shape. FULL keeps copies (on rank 0 only with ``rank0_only``);
  SHARDED keeps this rank's dim-0 rows as a DTensor, as the model's SHARDED state dict does,
  so DCP can load it at another world size.
- Scalars (``step``) and other values are exchanged with the per-parameter metadata in one
  ``all_gather_object``, so ranks holding no piece of a parameter still report its state.
- ``param_groups`` list FQNs instead of parameter ids; parameters with no state yet appear
  there and not under ``state``.
- ``state`` is ordered as rank 0's optimizer holds the parameters, on every rank (as torch's),
  so code iterating the dicts of all ranks together (gathering DTensors) pairs the same
  parameters. Every rank's optimizer must hold the same FSDP-managed parameters (checked on
  the exchanged metadata): a rank without one would contribute zeros for its shard.
Loading is ``optim_state_dict_load``.
"""

from __future__ import annotations

import copy
import enum
import inspect
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .._engine.flat_param import FlatParameter, FlatParamHandle
from .._engine.unit import Unit, units_in
from ..api import StateDictType
from .state_dict import _check_idle, _copied, _plan, _sharded_value
from .state_dict_type import get_state_dict_type

__all__ = ["OptimStateKeyType"]


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict names parameters (``rekey_optim_state_dict``)."""

    PARAM_NAME = enum.auto()
    """By fully qualified name, as FSDP's full and sharded optimizer state dicts do."""
    PARAM_ID = enum.auto()
    """By position in the optimizer's param groups, as ``torch.optim.Optimizer`` does."""


@dataclass
class _OptimParam:
    """One parameter an optimizer may hold, and the original parameters it stands for."""

    param: nn.Parameter
    fqns: list[str]
    """Clean FQNs of the original parameters (a flat parameter's in layout order)."""
    handle: FlatParamHandle | None = None
    indices: list[int] = field(default_factory=list)
    """The original parameters' indices in ``handle``."""

    @property
    def is_flat(self) -> bool:
        return isinstance(self.param, FlatParameter)


def _model_params(
    model: nn.Module, units: list[Unit]
) -> tuple[dict[int, _OptimParam], dict[int, list[str]]]:
    """Every parameter an optimizer over ``model`` may hold, by ``id``, in ``nn.Module`` order
    of their first FQN (the same on every rank); and each handle's original parameters' FQNs
    (by ``id(handle)``)."""
    entries, _, _ = _plan(model, units, "")
    fqn_of: dict[tuple[int, int], str] = {}
    for entry in entries:
        if entry.handle is not None:
            fqn_of.setdefault((id(entry.handle), entry.index), entry.key)
    unit_fqns: dict[int, list[str]] = {}
    orig_params: dict[int, bool] = {}
    for unit in units:
        handle = unit.handle
        if handle is not None:
            unit_fqns[id(handle)] = [
                fqn_of[(id(handle), index)] for index in range(len(handle.orig_params))
            ]
            orig_params[id(handle)] = unit.settings.use_orig_params
    params: dict[int, _OptimParam] = {}
    for entry in entries:
        handle = entry.handle
        if handle is None:
            if isinstance(entry.value, nn.Parameter) and id(entry.value) not in params:
                params[id(entry.value)] = _OptimParam(entry.value, [entry.key])
            continue
        fqns = unit_fqns[id(handle)]
        if orig_params[id(handle)]:
            param = handle.orig_params[entry.index]
            if id(param) not in params:
                params[id(param)] = _OptimParam(param, [fqns[entry.index]], handle, [entry.index])
            continue
        segment = handle.segment_of(entry.index)
        if id(segment.flat_param) not in params:
            indices = list(segment.indices)
            params[id(segment.flat_param)] = _OptimParam(
                segment.flat_param, [fqns[index] for index in indices], handle, indices
            )
    return params, unit_fqns


def _param_groups(
    model: nn.Module, optim: torch.optim.Optimizer | None, optim_input: Any
) -> list[list[nn.Parameter]]:
    """The optimizer's parameters by group: from ``optim``, else ``optim_input`` (a list of
    param group dicts or of parameters), else ``model.parameters()``."""
    if optim is not None:
        return [list(group["params"]) for group in optim.param_groups]
    if optim_input is None:
        return [list(model.parameters())]
    optim_input = list(optim_input)
    if optim_input and isinstance(optim_input[0], dict):
        return [list(group["params"]) for group in optim_input]
    return [optim_input]


def _optimizer_params(
    params: dict[int, _OptimParam], groups: list[list[nn.Parameter]], where: str
) -> tuple[list[_OptimParam], ValueError | None]:
    """The optimizer's parameters in id order (torch numbers them across groups), or what is
    wrong with them (returned: the collective callers raise it on every rank)."""
    ordered = []
    for group_index, group in enumerate(groups):
        for param in group:
            if id(param) not in params:
                return [], ValueError(
                    f"{where}: param group {group_index} of the optimizer holds a parameter of "
                    f"shape {tuple(param.shape)} that is not in the model. Build the optimizer "
                    "over the FSDP-wrapped model's parameters, after wrapping"
                )
            ordered.append(params[id(param)])
    return ordered, None


# -- producing ---------------------------------------------------------------------------------


@dataclass
class _StateMeta:
    """What one rank knows of one state value of one original parameter."""

    kind: str
    """"tensor" (shaped like the parameter: gathered), "scalar" (0-dim tensor) or "object"."""
    dtype: torch.dtype | None = None
    value: Any = None
    """The scalar (on the CPU) or the object itself."""
    holds: bool = True
    """Whether the rank that described it holds elements of the parameter: see [Note: scalar
    states of a parameter a rank holds none of]."""


# [Note: scalar states of a parameter a rank holds none of]
# Under use_orig_params a rank whose shard holds none of a parameter's elements has a
# 0-element view of it, which never gets a gradient, so the optimizer never steps it there.
# That rank's scalar states of it (Adam's ``step``) are stale, or were made by torch's
# ``get_optimizer_state_dict``, whose first call on an optimizer without state runs one step
# with zero gradients (``step`` 1). The state dict takes a parameter's scalars from the ranks
# that hold its elements, which step it every time; where those disagree it raises, as torch
# does. (Taking a non-holder's value saved Adam's ``step`` of 1 or of the last load, and a
# resume then corrected its moments with the wrong step.)


def _holds_elements(op: _OptimParam) -> bool:
    return op.is_flat or op.param.numel() > 0


def _describe(value: Any, op: _OptimParam, key: str) -> _StateMeta:
    if not isinstance(value, torch.Tensor):
        return _StateMeta("object", value=value, holds=_holds_elements(op))
    if value.dim() == 0:
        return _StateMeta("scalar", value.dtype, value.detach().cpu(), _holds_elements(op))
    if value.shape != op.param.shape:
        raise ValueError(
            f"optimizer state '{key}' of {op.fqns if op.is_flat else op.fqns[0]!r} has shape "
            f"{tuple(value.shape)}, not its parameter's local shape {tuple(op.param.shape)}; "
            "fullshard can only unshard states shaped like their parameter"
        )
    return _StateMeta("tensor", value.dtype)


@dataclass
class _RankView:
    """What one rank tells the others before an optimizer state dict is built."""

    states: dict[str, dict[str, _StateMeta]]
    """Per FSDP-managed original parameter's FQN, its state keys described."""
    held: list[str]
    """The FQNs of every parameter its optimizer holds, in the optimizer's order."""
    managed: list[str]
    """Those of ``held`` that FSDP shards (their states are gathered across ranks)."""
    problem: str = ""
    """Why this rank cannot build the state dict (every rank raises it after the exchange)."""


def _exchange_metadata(
    ordered: list[_OptimParam],
    states: dict[int, dict[str, Any]],
    group: Any,
    problem: ValueError | None,
) -> tuple[dict[str, dict[str, _StateMeta]], list[str]]:
    """Per managed original parameter's FQN, its state keys as any rank knows them (the first
    rank that has a key describes it), and rank 0's optimizer's FQNs in its order, which
    orders the state dict on every rank (as torch's). One ``all_gather_object``; a
    ``problem`` (or a state this rank cannot describe) raises on every rank after it."""
    mine = _RankView({}, [fqn for op in ordered for fqn in op.fqns], [])
    try:
        for op in ordered:
            if op.handle is None:
                continue
            mine.managed.extend(op.fqns)
            state = states.get(id(op.param))
            if state:
                described = {key: _describe(value, op, key) for key, value in state.items()}
                mine.states.update(dict.fromkeys(op.fqns, described))
    except ValueError as error:
        problem = problem or error
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem is not None:
            raise problem
        return mine.states, mine.held
    mine.problem = "" if problem is None else str(problem)
    every: list[Any] = [None] * dist.get_world_size(group)
    with comm.named("the exchange of optimizer state metadata", group):
        dist.all_gather_object(every, mine, group=group)
    message = comm.ranks_problem([view.problem for view in every])
    if message:
        raise ValueError(message) from problem
    _check_same_managed(every)
    merged: dict[str, dict[str, _StateMeta]] = {}
    for rank, view in enumerate(every):
        for fqn, described in view.states.items():
            keys = merged.setdefault(fqn, {})
            for key, meta in described.items():
                _merge(keys, key, meta, fqn, rank)
    return merged, every[0].held


def _merge(keys: dict[str, _StateMeta], key: str, meta: _StateMeta, fqn: str, rank: int) -> None:
    """Keep the first description of ``key`` by a rank holding elements of the parameter, or
    by any rank where none does (see [Note: scalar states of a parameter a rank holds none
    of]); holders must agree on a scalar or a non-tensor state."""
    known = keys.get(key)
    if known is None or (meta.holds and not known.holds):
        keys[key] = meta
        return
    if meta.holds and known.holds and not _same_value(meta, known):
        raise RuntimeError(
            f"Rank {rank} has different values for {key}: {meta.value}. Other ranks: "
            f"{known.value}. (fullshard: optimizer state '{key}' of {fqn!r} differs "
            "between ranks that hold parts of the parameter, so the optimizer stepped "
            "them differently; every rank must step the same optimizer over the same "
            "parameters)"
        )


def _same_value(meta: _StateMeta, known: _StateMeta) -> bool:
    """Whether two holders' descriptions of a scalar or non-tensor state agree (torch
    compares both; a tensor state is gathered, not compared)."""
    if meta.kind != known.kind or meta.kind == "tensor":
        return True
    if meta.kind == "scalar":
        return torch.equal(meta.value, known.value)
    try:
        return bool(meta.value == known.value)
    except (TypeError, ValueError, RuntimeError):  # == gives no truth value (an array, say)
        return True


def _check_same_managed(every: list[_RankView]) -> None:
    """Every rank's optimizer must hold the same FSDP-managed parameters: their states are
    gathered unit by unit, and a rank missing one would give zeros for its shard. Decided on
    the gathered views, so every rank raises alike."""
    first = set(every[0].managed)
    for rank, view in enumerate(every[1:], start=1):
        held = set(view.managed)
        missing = [fqn for fqn in every[0].managed if fqn not in held]
        if missing:
            raise RuntimeError(
                "FSDP currently requires each rank to have at least the optimizer states "
                "needed by rank 0's optimizer but some ranks are missing some of those states: "
                f"rank {rank}'s optimizer does not hold {missing[:8]}"
                f"{' and more' if len(missing) > 8 else ''}, which rank 0's does. Build every "
                "rank's optimizer over the same parameters of the FSDP-wrapped model"
            )
        extra = [fqn for fqn in view.managed if fqn not in first]
        if extra:
            raise RuntimeError(
                f"rank {rank}'s optimizer holds FSDP-managed parameters {extra[:8]}"
                f"{' and more' if len(extra) > 8 else ''} that rank 0's optimizer does not; "
                "their states are sharded across ranks, so every rank's optimizer must hold "
                "the same parameters of the FSDP-wrapped model"
            )


def _local_shard_of_state(
    handle: FlatParamHandle,
    by_index: dict[int, tuple[_OptimParam, dict[str, Any]]],
    indices: list[int],
    key: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """This rank's shard of flat state ``key`` of the segment holding ``indices`` (zeros where
    it holds none)."""
    layout = handle.segment_of(indices[0]).layout
    shard_numel = layout.shard_numel if handle.uses_sharded_strategy else layout.numel
    first = by_index.get(indices[0])
    if first is not None and first[0].is_flat and key in first[1]:
        return first[1][key].detach().reshape(-1)[:shard_numel].to(handle.device)  # (shard,)
    shard = torch.zeros(shard_numel, dtype=dtype, device=handle.device)
    for index in indices:
        found = by_index.get(index)
        piece = handle.piece(index)
        if found is None or key not in found[1] or piece is None:
            continue
        value = found[1][key].detach().reshape(-1)
        shard[piece.shard_start : piece.shard_start + piece.numel].copy_(value)
    return shard


def _unit_states(
    handle: FlatParamHandle,
    by_index: dict[int, tuple[_OptimParam, dict[str, Any]]],
    fqns: list[str],
    metadata: dict[str, dict[str, _StateMeta]],
    to_rank0: bool,
) -> Iterable[tuple[int, str, torch.Tensor]]:
    """Yields ``(index, key, full state)`` for every parameter-shaped state of the unit, one
    collective per (segment, key, dtype): an all-gather (each full value valid until the next
    yield), or with ``to_rank0`` a gather to rank 0 into fresh memory, yielded on rank 0 only."""
    if to_rank0 and 0 not in dist.get_process_group_ranks(handle.groups.shard):
        return  # another replica of this unit's shards sends them to rank 0
    wanted: dict[tuple[str, int, torch.dtype], list[int]] = {}
    for index, fqn in enumerate(fqns):
        segment_index = handle.layout.locations[index][0]
        for key, meta in metadata.get(fqn, {}).items():
            if meta.kind == "tensor":
                assert meta.dtype is not None
                wanted.setdefault((key, segment_index, meta.dtype), []).append(index)
    for (key, _, dtype), indices in sorted(wanted.items(), key=lambda item: item[0][:2]):
        segment = handle.segment_of(indices[0])
        shard = _local_shard_of_state(handle, by_index, indices, key, dtype)
        label = f"{handle.label}.optim.{key}"
        full_flat: torch.Tensor | None = shard
        if to_rank0:
            full_flat = segment.gather_flat_to_first_rank(shard, label)
        elif handle.uses_sharded_strategy:
            full_flat = shard.new_empty(segment.layout.padded_numel)  # (padded_numel,)
            comm.all_gather_into(full_flat, shard, handle.groups.shard, label).wait()
        if full_flat is None:
            continue
        views = dict(zip(segment.indices, segment.views_of_flat(full_flat)))
        for index in indices:
            yield index, key, views[index]


def _local_states(
    optim: torch.optim.Optimizer, ordered: list[_OptimParam], source: dict[str, Any] | None
) -> dict[int, dict[str, Any]]:
    """Each optimizer parameter's state by ``id(param)``, from ``source`` (an
    ``optim.state_dict()`` keyed by position) when given, else from ``optim.state``."""
    if source is None:
        return {id(op.param): dict(optim.state.get(op.param, {})) for op in ordered}
    return {id(ordered[key].param): dict(value) for key, value in source["state"].items()}


def check_fsdp1_units(units: list[Unit], what: str) -> None:
    """FSDP1's optimizer state dict functions read FSDP1 units: a ``fully_shard`` unit's
    parameters are DTensors, whose states torch's checkpoint API reads (torch fails here
    with an AttributeError; fullshard says what to call instead)."""
    fsdp2 = [unit for unit in units if unit.settings.sharding.mesh is not None]
    if fsdp2:
        name = type(fsdp2[0].module).__name__
        raise RuntimeError(
            f"FullyShardedDataParallel.{what} reads FullyShardedDataParallel (FSDP1) units, "
            f"but the module of type {name} (and {len(fsdp2) - 1} more) was sharded by "
            "fully_shard (FSDP2): use torch.distributed.checkpoint.state_dict's "
            "get_optimizer_state_dict(model, optim) to save its optimizer's state and "
            "set_optimizer_state_dict(model, optim, state_dict) to load it"
        )


def produce(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    source: dict[str, Any] | None,
    *,
    full: bool,
    rank0_only: bool,
    offload_to_cpu: bool,
    group: Any = None,
) -> dict[str, Any]:
    """The FULL or SHARDED optimizer state dict (see [Note: optimizer state keys])."""
    units = units_in(model)
    check_fsdp1_units(units, "optim_state_dict()")
    _check_idle(units, "optim_state_dict()")
    params, unit_fqns = _model_params(model, units)
    groups = [list(group["params"]) for group in optim.param_groups]
    # A problem is raised on every rank once the ranks have exchanged it.
    ordered, problem = _optimizer_params(params, groups, "optim_state_dict()")
    states = _local_states(optim, ordered, source) if problem is None else {}
    metadata, rank0_order = _exchange_metadata(ordered, states, group, problem)
    keep = not (full and rank0_only and dist.is_initialized() and dist.get_rank(group) != 0)
    device_type = units[0].compute_device.type if units else "cpu"
    tensors: dict[tuple[str, str], Any] = {}
    by_handle: dict[int, dict[int, tuple[_OptimParam, dict[str, Any]]]] = {}
    for op in ordered:
        if op.handle is not None:
            for index in op.indices:
                by_handle.setdefault(id(op.handle), {})[index] = (op, states.get(id(op.param), {}))
    for unit in units:
        handle = unit.handle
        if handle is None:
            continue
        fqns = unit_fqns[id(handle)]
        to_rank0 = full and rank0_only
        states_of_unit = by_handle.get(id(handle), {})
        for index, key, value in _unit_states(handle, states_of_unit, fqns, metadata, to_rank0):
            if not full:
                tensors[(fqns[index], key)] = _sharded_value(
                    value, handle, device_type, offload_to_cpu
                )
            elif to_rank0:  # fresh memory already: keep it (a view of the unit's buffer)
                tensors[(fqns[index], key)] = value.cpu() if offload_to_cpu else value
            else:
                tensors[(fqns[index], key)] = _copied(value, offload_to_cpu)
    if not keep:
        return {}
    state = _in_order(_assemble(ordered, states, metadata, tensors, offload_to_cpu), rank0_order)
    if source is not None and "param_groups" not in source:
        return {"state": state}  # as torch: a dict given without groups gets none back
    base_groups = (
        source["param_groups"] if source is not None else optim.state_dict()["param_groups"]
    )
    return {"state": state, "param_groups": _named_param_groups(base_groups, ordered)}


def _assemble(
    ordered: list[_OptimParam],
    states: dict[int, dict[str, Any]],
    metadata: dict[str, dict[str, _StateMeta]],
    tensors: dict[tuple[str, str], Any],
    offload_to_cpu: bool,
) -> dict[str, Any]:
    """The ``state`` part, in this rank's optimizer's parameter order, FQN-keyed."""
    out: dict[str, Any] = {}
    for op in ordered:
        local = states.get(id(op.param), {})
        if op.handle is None:
            if local:
                out[op.fqns[0]] = {
                    key: _copied(value, offload_to_cpu)
                    if isinstance(value, torch.Tensor)
                    else value
                    for key, value in local.items()
                }
            continue
        for fqn in op.fqns:
            if fqn not in metadata:
                continue
            param_state: dict[str, Any] = {}
            for key, meta in metadata[fqn].items():
                if meta.kind == "tensor":
                    param_state[key] = tensors[(fqn, key)]
                elif meta.kind == "scalar" and key in local:
                    mine = local[key] if _holds_elements(op) else meta.value.to(local[key].device)
                    param_state[key] = _copied(mine, offload_to_cpu)
                else:
                    param_state[key] = copy.copy(meta.value)
            out[fqn] = param_state
    return out


def _in_order(state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """``state`` with the keys of ``order`` first, in that order (then the rest as they are):
    with optimizers over the same parameters in different orders, every rank's dict then
    iterates alike, and so do collectives over its DTensor values."""
    return {**{fqn: state[fqn] for fqn in order if fqn in state}, **state}


def _named_param_groups(
    param_groups: list[dict[str, Any]], ordered: list[_OptimParam]
) -> list[dict[str, Any]]:
    named = []
    for group in param_groups:
        copied = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        copied["params"] = [fqn for param_id in group["params"] for fqn in ordered[param_id].fqns]
        named.append(copied)
    return named


# -- loading -----------------------------------------------------------------------------------


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict``: ``optim``'s state in ``model``'s state
    dict type (LOCAL: ``optim.state_dict()`` as is)."""
    settings = get_state_dict_type(model)
    if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        return optim_state_dict if optim_state_dict is not None else optim.state_dict()
    config = settings.optim_state_dict_config
    full = settings.state_dict_type == StateDictType.FULL_STATE_DICT
    if optim_state_dict is None and not full and not optim.state:
        optim_state_dict = _unstepped_template(optim)
    return produce(
        model,
        optim,
        optim_state_dict,
        full=full,
        rank0_only=getattr(config, "rank0_only", False),
        offload_to_cpu=config.offload_to_cpu,
        group=group,
    )


# [Note: the SHARDED state dict of an optimizer that has not stepped]
# DCP loads into the dict it is given: only keys present there are read from the checkpoint.
# Resuming builds that dict from a new optimizer (accelerate's FSDP1 `load_state`:
# `FSDP.optim_state_dict(model, new_optimizer)`, then `dist_cp.load`), whose state is still
# empty: torch's FSDP1 gives `{"state": {}}`, DCP reads no state, and training resumes with
# fresh moments and no error (the resumed run diverges from the uninterrupted one from its
# second step). fullshard's SHARDED dict of an optimizer with no state holds the state its
# first step would create instead: a throwaway optimizer of the same class and
# hyperparameters steps once over zero copies of the parameters with zero gradients, and its
# state, with `step` set back to 0, is the template (for Adam-like optimizers, zero moments at
# step 0 are exactly the fresh state; the user's optimizer is not touched). torch's DSD
# (`get_optimizer_state_dict`) initialises the state for the same reason, by stepping the
# user's optimizer itself with lr 0. FULL dicts are loaded from files whole and keep torch's
# empty state.


def _unstepped_template(optim: torch.optim.Optimizer) -> dict[str, Any] | None:
    """``optim.state_dict()`` as it would be after a first step that changed nothing (see
    the note above); None where the optimizer cannot be rebuilt from its ``defaults``."""
    inner = optim  # wrappers (accelerate's AcceleratedOptimizer) hold the optimizer
    while isinstance(wrapped := getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = wrapped
    shadow_groups = []
    for group in inner.param_groups:
        copies = [
            torch.zeros_like(p.detach()).requires_grad_(p.requires_grad) for p in group["params"]
        ]
        for copy_ in copies:
            if copy_.requires_grad and copy_.numel() > 0:  # no piece on this rank: no grad
                copy_.grad = torch.zeros_like(copy_)
        shadow_groups.append({**group, "params": copies})
    try:
        # the groups carry every hyperparameter; the constructor takes those it names
        accepted = inspect.signature(type(inner)).parameters
        defaults = {key: value for key, value in inner.defaults.items() if key in accepted}
        shadow = type(inner)(shadow_groups, **defaults)
        shadow.step()
    except Exception as e:  # an optimizer whose constructor takes more than its defaults
        warnings.warn(
            f"FSDP.optim_state_dict: {type(inner).__name__} has no state yet and could not be "
            f"rebuilt from its defaults to list the state it will hold ({e!r}); a DCP load into "
            "this state dict will read no optimizer state. Step the optimizer once before "
            "loading, or load a FULL_STATE_DICT optimizer checkpoint",
            stacklevel=3,
        )
        return None
    template = optim.state_dict()
    shadow_params = [p for group in shadow.param_groups for p in group["params"]]
    template["state"] = {
        index: {key: _at_step_zero(key, value) for key, value in shadow.state[p].items()}
        for index, p in enumerate(shadow_params)
        if p in shadow.state
    }
    return template


def _at_step_zero(key: str, value: Any) -> Any:
    if key != "step":
        return value
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else 0
