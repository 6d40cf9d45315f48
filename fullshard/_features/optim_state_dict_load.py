"""Loading optimizer state dicts: from FULL or SHARDED dicts back to what the optimizer loads.

``optim_state_dict_to_load`` walks the given dict in the model's parameter order (the same on
every rank, whatever the dict's or the optimizer's: DTensor values are gathered with
``full_tensor()`` and ``rank0_only`` values broadcast from rank 0, one tensor at a time) and
cuts each full state to this rank's piece: a flat parameter's state is its shard of the
concatenated states, an original parameter's its piece.
The result is keyed by the ids of ``optim.param_groups`` and loads with
``optim.load_state_dict``. Its groups list the ids of the parameters the saved groups name:
a parameter the dict does not know (added to the model since, or managed outside FSDP) is
left out, as torch leaves it, for the caller to add before loading.

See [Note: optimizer state keys] in ``optim_state_dict`` for the format.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor

from .._comm import collectives as comm
from .._engine.unit import units_in
from ..api import StateDictType, from_torch
from .optim_state_dict import (
    OptimStateKeyType,
    _model_params,
    _optimizer_params,
    _OptimParam,
    check_fsdp1_units,
)
from .state_dict import _check_idle
from .state_dict_type import get_state_dict_type

__all__: list[str] = []


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
    if dist.get_rank(group) == 0 and (osd is None or "state" not in osd):
        # broadcast, so that every rank raises (the others would wait in the broadcast)
        skeleton[0] = {"error": f"rank 0 passed {type(osd).__name__}"}
    elif dist.get_rank(group) == 0:
        assert osd is not None
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
        }
        if "param_groups" in osd:
            skeleton[0]["param_groups"] = osd["param_groups"]
    with comm.named("the broadcast of the optimizer state dict's layout", group):
        dist.broadcast_object_list(skeleton, src=_global_rank0(group), group=group)
    if "error" in skeleton[0]:
        raise ValueError(
            "rank 0 must pass the full optimizer state dict (with 'state' and "
            f"'param_groups'); the other ranks may pass None ({skeleton[0]['error']})"
        )
    return skeleton[0]


def _raise_on_every_rank(problem: ValueError | None, group: Any) -> None:
    """Raise ``problem``, found on some ranks only, on every rank (the others would wait
    in the load's collectives, or load and go on alone)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if problem is not None:
            raise problem
        return
    found: list[Any] = [None] * dist.get_world_size(group)
    with comm.named("the exchange of what each rank's optimizer holds", group):
        dist.all_gather_object(found, "" if problem is None else str(problem), group=group)
    message = comm.ranks_problem(found)
    if message:
        raise ValueError(message) from problem


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
    units = units_in(model)
    check_fsdp1_units(units, where)
    _check_idle(units, where)
    params, _ = _model_params(model, units)
    ordered, problem = _optimizer_params(params, groups, where)
    _raise_on_every_rank(problem, group)  # this rank's optimizer: raised on every rank
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
    if "param_groups" not in skeleton:  # as torch: none given, none returned (the caller
        return {"state": loaded}  # adds the optimizer's own before loading)
    return {
        "state": loaded,
        "param_groups": _id_param_groups(skeleton["param_groups"], groups, ordered),
    }


def _full_value(
    source: Any, value: Any, rank0_only: bool, group: Any, device: torch.device
) -> torch.Tensor:
    """The full tensor of one state: gathered (DTensor, ShardedTensor), broadcast
    (``rank0_only``) or as is."""
    if isinstance(source, DTensor):
        return source.full_tensor()
    if isinstance(source, ShardedTensor):
        return _sharded_tensor_full(source, device)
    if not rank0_only:
        return source
    if dist.get_rank(group) == 0:
        tensor = source.detach().to(device)
    else:
        tensor = torch.empty(value.shape, dtype=value.dtype, device=device)
    with comm.named("the broadcast of an optimizer state from rank 0", group):
        dist.broadcast(tensor, src=_global_rank0(group), group=group)
    return tensor


def _sharded_tensor_full(source: ShardedTensor, device: torch.device) -> torch.Tensor:
    """A ShardedTensor's full tensor. torch's ``load_sharded_optimizer_state_dict`` builds
    them (Lightning's FSDP1 sharded load passes its result here): each rank places its local
    shards, and one all-reduce over the tensor's group sums the disjoint pieces."""
    full = torch.zeros(source.size(), dtype=source.dtype, device=device)
    for shard in source.local_shards():
        metadata = shard.metadata
        where = tuple(
            slice(offset, offset + size)
            for offset, size in zip(metadata.shard_offsets, metadata.shard_sizes)
        )
        full[where].copy_(shard.tensor)
    group = source._process_group
    with comm.named("the gather of a ShardedTensor optimizer state", group):
        dist.all_reduce(full, group=group)
    return full


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
    key_type = from_torch(key_type, OptimStateKeyType)
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
    params, _ = _model_params(model, units_in(model))
    ordered, problem = _optimizer_params(params, groups, "rekey_optim_state_dict()")
    if problem is not None:
        raise problem
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


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``FullyShardedDataParallel.optim_state_dict_to_load``: what ``optim.load_state_dict``
    takes, in ``model``'s state dict type; ``load_directly`` also loads it."""
    if is_named_optimizer:
        raise NotImplementedError(
            "optim_state_dict_to_load(is_named_optimizer=True): fullshard supports "
            "torch.optim optimizers only"
        )
    settings = get_state_dict_type(model)
    if settings.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        result = optim_state_dict
    else:
        result = load(
            model,
            [list(g["params"]) for g in optim.param_groups],
            optim_state_dict,
            rank0_only=getattr(settings.optim_state_dict_config, "rank0_only", False)
            and settings.state_dict_type == StateDictType.FULL_STATE_DICT,
            group=group,
        )
    if load_directly:
        optim.load_state_dict(result)
    return result
