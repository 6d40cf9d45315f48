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

``optim_state_dict_to_load`` walks the given dict in the model's parameter order (the same on
every rank, whatever the dict's or the optimizer's: DTensor values are gathered with
``full_tensor()`` and ``rank0_only`` values broadcast from rank 0, one tensor at a time) and
cuts each full state to this rank's piece: a flat parameter's state is its shard of the
concatenated states, an original parameter's its piece.
The result is keyed by the ids of ``optim.param_groups`` and loads with
``optim.load_state_dict``. Its groups list the ids of the parameters the saved groups name:
a parameter the dict does not know (added to the model since, or managed outside FSDP) is
left out, as torch leaves it, for the caller to add before loading.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ._comm import collectives as comm
from ._state_dict import _check_idle, _copied, _plan, _sharded_value, _units
from .flat_param import FlatParameter, FlatParamHandle

if TYPE_CHECKING:
    from .fully_sharded_data_parallel import FullyShardedDataParallel

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
    model: nn.Module, units: list[FullyShardedDataParallel]
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
        handle = unit._handle
        if handle is not None:
            unit_fqns[id(handle)] = [
                fqn_of[(id(handle), index)] for index in range(len(handle.orig_params))
            ]
            orig_params[id(handle)] = unit._use_orig_params
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
) -> list[_OptimParam]:
    """The optimizer's parameters in id order (torch numbers them across groups)."""
    ordered = []
    for group_index, group in enumerate(groups):
        for param in group:
            if id(param) not in params:
                raise ValueError(
                    f"{where}: param group {group_index} of the optimizer holds a parameter of "
                    f"shape {tuple(param.shape)} that is not in the model. Build the optimizer "
                    "over the FSDP-wrapped model's parameters, after wrapping"
                )
            ordered.append(params[id(param)])
    return ordered


# -- producing ---------------------------------------------------------------------------------


@dataclass
class _StateMeta:
    """What one rank knows of one state value of one original parameter."""

    kind: str
    """"tensor" (shaped like the parameter: gathered), "scalar" (0-dim tensor) or "object"."""
    dtype: torch.dtype | None = None
    value: Any = None
    """The scalar (on the CPU) or the object itself."""


def _describe(value: Any, op: _OptimParam, key: str) -> _StateMeta:
    if not isinstance(value, torch.Tensor):
        return _StateMeta("object", value=value)
    if value.dim() == 0:
        return _StateMeta("scalar", value.dtype, value.detach().cpu())
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


def _exchange_metadata(
    ordered: list[_OptimParam], states: dict[int, dict[str, Any]], group: Any
) -> tuple[dict[str, dict[str, _StateMeta]], list[str]]:
    """Per managed original parameter's FQN, its state keys as any rank knows them (the first
    rank that has a key describes it), and rank 0's optimizer's FQNs in its order, which
    orders the state dict on every rank (as torch's). One ``all_gather_object``."""
    mine = _RankView({}, [fqn for op in ordered for fqn in op.fqns], [])
    for op in ordered:
        if op.handle is None:
            continue
        mine.managed.extend(op.fqns)
        state = states.get(id(op.param))
        if state:
            described = {key: _describe(value, op, key) for key, value in state.items()}
            mine.states.update(dict.fromkeys(op.fqns, described))
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return mine.states, mine.held
    every: list[Any] = [None] * dist.get_world_size(group)
    with comm.named("the exchange of optimizer state metadata", group):
        dist.all_gather_object(every, mine, group=group)
    _check_same_managed(every)
    merged: dict[str, dict[str, _StateMeta]] = {}
    for view in every:
        for fqn, described in view.states.items():
            keys = merged.setdefault(fqn, {})
            for key, meta in described.items():
                keys.setdefault(key, meta)
    return merged, every[0].held


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
    units = _units(model)
    _check_idle(units, "optim_state_dict()")
    params, unit_fqns = _model_params(model, units)
    groups = [list(group["params"]) for group in optim.param_groups]
    ordered = _optimizer_params(params, groups, "optim_state_dict()")
    states = _local_states(optim, ordered, source)
    metadata, rank0_order = _exchange_metadata(ordered, states, group)
    keep = not (full and rank0_only and dist.is_initialized() and dist.get_rank(group) != 0)
    device_type = units[0].compute_device.type if units else "cpu"
    tensors: dict[tuple[str, str], Any] = {}
    by_handle: dict[int, dict[int, tuple[_OptimParam, dict[str, Any]]]] = {}
    for op in ordered:
        if op.handle is not None:
            for index in op.indices:
                by_handle.setdefault(id(op.handle), {})[index] = (op, states.get(id(op.param), {}))
    for unit in units:
        handle = unit._handle
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
                    param_state[key] = _copied(local[key], offload_to_cpu)
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


@dataclass
class _TensorRef:
    """A parameter-shaped state only rank 0 holds (``rank0_only``), broadcast when reached."""

    shape: torch.Size
    dtype: torch.dtype


def _is_param_shaped(value: Any) -> bool:
    return isinstance(value, _TensorRef) or (isinstance(value, torch.Tensor) and value.dim() > 0)


def _broadcast_skeleton(osd: dict[str, Any] | None, group: Any) -> dict[str, Any]:
    """Rank 0's state dict with each parameter-shaped tensor replaced by a ``_TensorRef``."""
    skeleton: list[Any] = [None]
    if dist.get_rank(group) == 0:
        if osd is None or "state" not in osd:
            raise ValueError(
                "rank 0 must pass the full optimizer state dict (with 'state' and "
                "'param_groups'); the other ranks may pass None"
            )
        skeleton[0] = {
            "state": {
                fqn: {
                    key: _TensorRef(v.shape, v.dtype)
                    if _is_param_shaped(v)
                    else (v.detach().cpu() if isinstance(v, torch.Tensor) else v)
                    for key, v in param_state.items()
                }
                for fqn, param_state in osd["state"].items()
            },
            "param_groups": osd.get("param_groups", []),
        }
    with comm.named("the broadcast of the optimizer state dict's layout", group):
        dist.broadcast_object_list(skeleton, src=_global_rank0(group), group=group)
    return skeleton[0]


def _global_rank0(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _check_names(state: dict[Any, Any], targets: dict[str, Any], where: str) -> None:
    """Every state key must name a parameter the optimizer holds (checked before any
    collective, so every rank raises alike)."""
    if any(isinstance(key, int) for key in state):
        raise ValueError(
            f"{where}: the optimizer state dict is keyed by parameter ids, as "
            "torch.optim.Optimizer.state_dict() gives it; convert it first with "
            "FullyShardedDataParallel.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, "
            "model)"
        )
    unknown = [key for key in state if key not in targets]
    if unknown:
        raise ValueError(
            f"{where}: the optimizer state dict has state for {unknown[:8]}"
            f"{' and more' if len(unknown) > 8 else ''}, which the optimizer does not hold. "
            "It was saved from another model or with another optimizer; the optimizer holds "
            f"{sorted(targets)[:8]}{' ...' if len(targets) > 8 else ''}"
        )


def load(
    model: nn.Module,
    groups: list[list[nn.Parameter]],
    osd: dict[str, Any] | None,
    *,
    rank0_only: bool,
    group: Any = None,
) -> dict[str, Any]:
    """``osd`` (FULL or SHARDED, FQN-keyed) as ``optim.load_state_dict`` takes it for the
    optimizer over ``groups`` (see [Note: optimizer state keys]). Collective."""
    where = "optim_state_dict_to_load()"
    units = _units(model)
    _check_idle(units, where)
    params, _ = _model_params(model, units)
    ordered = _optimizer_params(params, groups, where)
    if rank0_only:
        skeleton = _broadcast_skeleton(osd, group)
    elif osd is None or "state" not in osd:
        raise ValueError(f"{where}: expected an optimizer state dict with 'state', got {osd!r}")
    else:
        skeleton = osd
    targets = {fqn: (position, op) for position, op in enumerate(ordered) for fqn in op.fqns}
    _check_names(skeleton["state"], targets, where)
    _check_flat_scalars(skeleton["state"], ordered)
    device = units[0].compute_device if units else torch.device("cpu")
    # With rank0_only only rank 0 holds the tensors; the others walk the skeleton.
    holder = osd if not rank0_only or dist.get_rank(group) == 0 else None
    states: dict[int, dict[str, Any]] = {}
    # In the model's order, the same on every rank: the dict's own may differ between ranks
    # (torch's set_state_dict builds it from sets of FQNs), so may the optimizer's, and
    # DTensor values gather collectively.
    in_model_order = [fqn for op in params.values() for fqn in op.fqns]
    for fqn in [fqn for fqn in in_model_order if fqn in targets and fqn in skeleton["state"]]:
        param_state = skeleton["state"][fqn]
        position, op = targets[fqn]
        state = states.setdefault(position, {})
        for key, value in param_state.items():
            if _is_param_shaped(value):
                source = holder["state"][fqn][key] if holder is not None else value
                full = _full_value(source, value, rank0_only, group, device)
                _load_tensor(op, fqn, key, full, state)
            else:
                _load_value(op, fqn, key, value, state)
    loaded = {
        position: state
        for position, state in sorted(states.items())
        if state and _holds_piece(ordered[position])
    }
    return {
        "state": loaded,
        "param_groups": _id_param_groups(skeleton.get("param_groups", []), groups, ordered),
    }


def _full_value(
    source: Any, value: Any, rank0_only: bool, group: Any, device: torch.device
) -> torch.Tensor:
    """The full tensor of one state: gathered (DTensor), broadcast (``rank0_only``) or as is."""
    if isinstance(source, DTensor):
        return source.full_tensor()
    if not rank0_only:
        return source
    if dist.get_rank(group) == 0:
        tensor = source.detach().to(device)
    else:
        tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
    with comm.named("the broadcast of an optimizer state from rank 0", group):
        dist.broadcast(tensor, src=_global_rank0(group), group=group)
    return tensor


def _load_tensor(
    op: _OptimParam, fqn: str, key: str, full: torch.Tensor, state: dict[str, Any]
) -> None:
    """Cut this rank's part of parameter ``fqn``'s full state ``key`` into ``state``."""
    device = op.param.device
    if op.handle is None:
        if full.shape != op.param.shape:
            raise ValueError(_shape_error(fqn, key, full.shape, op.param.shape))
        state[key] = full.detach().to(device, copy=True)
        return
    index = op.indices[op.fqns.index(fqn)]
    slot = op.handle.slot(index)
    if full.shape != slot.shape:
        raise ValueError(_shape_error(fqn, key, full.shape, slot.shape))
    piece = op.handle.piece(index)
    flat = full.detach().reshape(-1)
    if op.is_flat:
        if key not in state:  # (shard_numel,): zeros where no original parameter has this state
            state[key] = torch.zeros(op.param.shape, dtype=full.dtype, device=device)
        if piece is not None:
            source = flat[piece.param_start : piece.param_start + piece.numel]
            state[key][piece.shard_start : piece.shard_start + piece.numel].copy_(source)
    elif piece is not None:
        source = flat[piece.param_start : piece.param_start + piece.numel]
        state[key] = source.to(device, copy=True).view(op.param.shape)


def _shape_error(fqn: str, key: str, got: torch.Size, expected: torch.Size) -> str:
    return (
        f"optimizer state '{key}' of '{fqn}' has shape {tuple(got)} but the parameter has shape "
        f"{tuple(expected)}; the state dict was saved from another model"
    )


def _check_flat_scalars(state: dict[str, Any], ordered: list[_OptimParam]) -> None:
    """A flat parameter has one value of each scalar state (Adam's ``step``): every original
    parameter in it that has state must have it (as torch, before any collective). One with no
    state at all beside others that have it is a parameter the state dict does not know (added
    to the model since it was saved)."""
    for op in ordered:
        if not op.is_flat:
            continue
        with_state = [fqn for fqn in op.fqns if fqn in state]
        if not with_state:
            continue
        scalar_keys = {
            key
            for fqn in with_state
            for key, value in state[fqn].items()
            if not _is_param_shaped(value)
        }
        for key in sorted(scalar_keys):
            lacking = [fqn for fqn in op.fqns if key not in state.get(fqn, {})]
            if lacking:
                raise ValueError(
                    "All unflattened parameters comprising a single flat parameter must have "
                    f"scalar state with the same value and dtype, but state '{key}' is missing "
                    f"for {lacking} and present for "
                    f"{[fqn for fqn in op.fqns if fqn not in lacking]} (FSDP unit "
                    f"'{op.handle.label if op.handle else ''}'). The optimizer state dict does "
                    "not cover every parameter of this unit: it was saved from another model, "
                    "or parameters were added since; with use_orig_params=False a unit's "
                    "parameters share one flat parameter and so one optimizer state"
                )


def _load_value(op: _OptimParam, fqn: str, key: str, value: Any, state: dict[str, Any]) -> None:
    """A scalar or other value; a flat parameter's original parameters must agree on it."""
    if isinstance(value, torch.Tensor):
        value = value.detach().clone()
    if op.is_flat and key in state:
        same = (
            torch.equal(state[key], value)
            if isinstance(value, torch.Tensor) and isinstance(state[key], torch.Tensor)
            else state[key] == value
        )
        if not same:
            raise ValueError(
                "All unflattened parameters comprising a single flat parameter must have "
                f"scalar state with the same value and dtype, but optimizer state '{key}' of "
                f"'{fqn}' is {value!r} and {state[key]!r} for other parameters of its FSDP "
                "unit; with use_orig_params=False a unit's parameters share one flat parameter "
                "and so one value of it"
            )
        return
    state[key] = value


def _holds_piece(op: _OptimParam) -> bool:
    """An original parameter with no piece on this rank gets no gradient, so no state."""
    if op.handle is None or op.is_flat:
        return True
    return op.param.numel() > 0 or op.handle.slot(op.indices[0]).numel == 0


def _id_param_groups(
    saved: list[dict[str, Any]], groups: list[list[nn.Parameter]], ordered: list[_OptimParam]
) -> list[dict[str, Any]]:
    """The saved groups' hyperparameters for the optimizer's groups, matched by the FQNs they
    hold (by position where a group is empty), with the optimizer's parameter ids."""
    out = []
    start = 0
    for group_index, group in enumerate(groups):
        ids = list(range(start, start + len(group)))
        start += len(group)
        fqns = {fqn for param_id in ids for fqn in ordered[param_id].fqns}
        match = next((s for s in saved if fqns & set(s.get("params", []))), None)
        if match is None and (fqns or len(saved) != len(groups)):
            raise ValueError(
                f"optim_state_dict_to_load(): param group {group_index} of the optimizer (with "
                f"{sorted(fqns)[:4]}) matches no param group of the optimizer state dict; build "
                "the optimizer with the param groups it was saved with"
            )
        match = match if match is not None else saved[group_index]
        copied = copy.deepcopy({k: v for k, v in match.items() if k != "params"})
        # Only the parameters the saved group names, as torch: a parameter the state dict
        # does not know (added since, or managed outside FSDP) leaves its id out, and
        # optim.load_state_dict then refuses the group's size unless the caller adds it.
        named = set(match.get("params", []))
        copied["params"] = [i for i in ids if named.intersection(ordered[i].fqns)]
        out.append(copied)
    return out


# -- re-keying ---------------------------------------------------------------------------------


def rekey(
    osd: dict[str, Any],
    key_type: OptimStateKeyType,
    model: nn.Module,
    groups: list[list[nn.Parameter]],
) -> dict[str, Any]:
    """``osd`` keyed by parameter name or by id (see ``OptimStateKeyType``)."""
    if not isinstance(key_type, OptimStateKeyType):
        raise TypeError(f"optim_state_key_type must be an OptimStateKeyType, got {key_type!r}")
    keys = list(osd["state"])
    by_name = [isinstance(key, str) for key in keys]
    by_id = [isinstance(key, int) for key in keys]
    if not (all(by_name) or all(by_id)):
        raise ValueError(f"Invalid parameter keys: {osd['state'].keys()}")
    wanted_names = key_type == OptimStateKeyType.PARAM_NAME
    if (wanted_names and all(by_name)) or (not wanted_names and all(by_id)):
        return osd
    params, _ = _model_params(model, _units(model))
    ordered = _optimizer_params(params, groups, "rekey_optim_state_dict()")
    if wanted_names:
        for op in ordered:
            if op.is_flat:
                raise ValueError(
                    "rekey_optim_state_dict(): the optimizer holds the flat parameter of FSDP "
                    f"unit '{op.handle.label if op.handle else ''}', whose state is not per "
                    "parameter; use FullyShardedDataParallel.optim_state_dict(model, optim)"
                )
        names = [op.fqns[0] for op in ordered]
        mapping: dict[Any, Any] = dict(enumerate(names))
    else:
        mapping = {op.fqns[0]: position for position, op in enumerate(ordered) if not op.is_flat}
    missing = [key for key in keys if key not in mapping]
    if missing:
        raise ValueError(
            f"rekey_optim_state_dict(): {missing[:8]} name no parameter the optimizer holds "
            "(pass optim=, or the optimizer's param groups as optim_input=)"
        )
    groups_out = []
    for group in osd["param_groups"]:
        copied = copy.deepcopy({k: v for k, v in group.items() if k != "params"})
        converted = [mapping[key] for key in group["params"] if key in mapping]
        copied["params"] = converted if wanted_names else sorted(converted)
        groups_out.append(copied)
    return {
        "state": {mapping[key]: value for key, value in osd["state"].items()},
        "param_groups": groups_out,
    }
