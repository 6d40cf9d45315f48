"""Model state dicts: FULL, SHARDED (DTensor) and LOCAL, saved and loaded unit by unit.

[Note: state dict keys]
Keys are what the unwrapped model's ``state_dict()`` gives: the module tree is walked with
FSDP wrappers and activation checkpointing's wrappers (``_checkpoint_wrapped_module``, as
torch strips it) made transparent, each module's parameters (managed ones from their unit's
handle, ignored ones as they are), persistent buffers and extra state in ``nn.Module``'s
order, a parameter shared by several modules under each of their names (the same tensor).
Values of managed parameters are produced one unit at a time: the unit is all-gathered in
full precision, its values copied out (to the CPU with ``offload_to_cpu``) and the unit
resharded before the next, so no rank ever holds more than one unsharded unit beyond its
shards. With ``rank0_only`` each unit's shards are instead gathered to rank 0 only, straight
into the buffer its values are views of: rank 0 holds its shards, the copy being built and
the gather's transient buffers; the other ranks allocate nothing.

Loading goes through ``nn.Module.load_state_dict``: a pre-hook on each unit moves the keys
under it into the wrapped module's namespace, consumes its managed parameters' values
(copying this rank's piece of each full value into the shard: SHARDED values are gathered
with ``full_tensor()``, which DCP may have filled at another world size) and leaves
placeholders so ``nn.Module`` finds what it expects (buffers and ignored parameters load
natively). Keys and placeholders under an activation-checkpointing wrapper are spelled
without ``_checkpoint_wrapped_module.``: the wrapper's own load pre-hook adds it back.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from .._comm import collectives as comm
from .._comm.groups import ShardingGroups
from .._engine.flat_param import FlatParameter, FlatParamHandle, HandleState
from .._engine.flat_segment import FlatSegment
from .._engine.names import (
    CHECKPOINT_WRAPPED_MODULE,
    FLAT_PARAM_NAMES,
    FSDP_PREFIX,
    clean_fqn,
)
from .._engine.runtime import TrainingState
from .._engine.unit import Unit, unit_of, units_in
from ..api import FullStateDictConfig, StateDictConfig, StateDictType

__all__: list[str] = []


@dataclass
class _Entry:
    """One key of the state dict and where its value comes from."""

    key: str
    handle: FlatParamHandle | None = None
    index: int = -1
    """The parameter's index in ``handle`` (managed parameters)."""
    value: Any = None
    """The tensor (buffers, unmanaged parameters) or extra state object."""
    orig_dtype: torch.dtype | None = None
    """A buffer's own dtype where mixed precision may have cast it."""


def _check_idle(units: list[Unit], verb: str) -> None:
    for unit in units:
        if unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(
                f"{verb} must be called outside forward/backward and summon_full_params "
                f"(FSDP unit '{unit.handle.label if unit.handle else type(unit.module).__name__}'"
                " is in use)"
            )


def _plan(
    root: nn.Module, units: list[Unit], prefix: str
) -> tuple[list[_Entry], dict[str, Any], dict[str, Unit]]:
    """The state dict's keys in ``nn.Module`` order with their sources, ``_metadata``, and
    each unit under its clean path (the first, where a unit is reachable twice)."""
    managed: dict[tuple[int, str], tuple[FlatParamHandle, int]] = {}
    names_by_module: dict[int, list[str]] = {}
    for unit in units:
        handle = unit.handle
        if handle is None:
            continue
        for index, owners in enumerate(handle.owners):
            for module, name in owners:
                managed[(id(module), name)] = (handle, index)
                names_by_module.setdefault(id(module), []).append(name)
    buffer_dtypes = {
        (id(module), name): dtype for unit in units for module, name, dtype in unit.managed_buffers
    }
    unit_by_module = {id(unit.fsdp_module): unit for unit in units}
    entries: list[_Entry] = []
    metadata: dict[str, Any] = {}
    unit_paths: dict[str, Unit] = {}

    def visit(module: nn.Module, path: str) -> None:
        unit = unit_by_module.get(id(module))
        if unit is not None and unit.module is not module:  # a wrapper: adds no key part
            if all(known is not unit for known in unit_paths.values()):
                unit_paths[path] = unit
            visit(unit.module, path)
            return
        metadata[path[:-1]] = {"version": getattr(module, "_version", None)}
        for name, param in module._parameters.items():
            if param is None or isinstance(param, FlatParameter):
                continue
            if (id(module), name) not in managed:  # ignored, or outside every unit
                entries.append(_Entry(path + name, value=param))
        for name in names_by_module.get(id(module), []):
            handle, index = managed[(id(module), name)]
            entries.append(_Entry(path + name, handle=handle, index=index))
        for name, buffer in module._buffers.items():
            if buffer is not None and name not in module._non_persistent_buffers_set:
                dtype = buffer_dtypes.get((id(module), name))
                entries.append(_Entry(path + name, value=buffer, orig_dtype=dtype))
        if type(module).get_extra_state is not nn.Module.get_extra_state:
            entries.append(_Entry(path + "_extra_state", value=module.get_extra_state()))
        for child_name, child in module._modules.items():
            if child is not None:  # activation checkpointing's wrapper adds no key part
                transparent = child_name == CHECKPOINT_WRAPPED_MODULE
                visit(child, path if transparent else path + child_name + ".")

    visit(root, prefix)
    return entries, metadata, unit_paths


@contextlib.contextmanager
def _gathered(handle: FlatParamHandle) -> Iterator[list[torch.Tensor]]:
    """The unit's full parameters in full precision (collective), resharded afterwards."""
    if handle.state != HandleState.SHARDED and not handle.unsharded_matches(True):
        handle.reshard()
    gathered = handle.state == HandleState.SHARDED
    if gathered:
        handle.unshard(full_precision=True)
    handle.wait_unshard()
    try:
        yield handle.full_param_views()
    finally:
        if gathered:
            handle.reshard()


def _copied(tensor: torch.Tensor, offload_to_cpu: bool) -> torch.Tensor:
    if offload_to_cpu:
        return tensor.detach().to("cpu", copy=True)
    return tensor.detach().clone()


def _plain_value(entry: _Entry, config: StateDictConfig) -> Any:
    value = entry.value
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if entry.orig_dtype is not None and value.dtype != entry.orig_dtype:
        value = value.to(entry.orig_dtype)  # a buffer cast by mixed precision
    if config.offload_to_cpu:
        value = value.to("cpu")
    return value


_MESHES: dict[tuple[dist.ProcessGroup, dist.ProcessGroup | None, str], DeviceMesh] = {}
"""Keyed by the group objects themselves (as ``_comm.groups`` keys its groups), not their
ids: a group created after another was destroyed can reuse its id, and would be given the
destroyed group's mesh. Entries of destroyed groups are dropped when a mesh is made
(``_forget_destroyed``): a mesh holds its groups (torch's ``DeviceMesh.from_group`` keeps
them), so a weak key would never die, and the groups' gloo threads and shared-memory files
stayed for the rest of the process."""


def _destroyed(group: dist.ProcessGroup | None) -> bool:
    if group is None:
        return False
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):  # torch: "... is not initialized in the world ..."
        return True
    return False


def _forget_destroyed() -> None:
    for key in [key for key in _MESHES if _destroyed(key[0]) or _destroyed(key[1])]:
        del _MESHES[key]


def _mesh(groups: ShardingGroups, device_type: str) -> DeviceMesh:
    """The unit's ranks as a device mesh: 1-D over the shard group, or 2-D (replicate,
    shard) for hybrid strategies; cached per group pair."""
    key = (groups.shard, groups.replicate, device_type)
    if key not in _MESHES:
        _forget_destroyed()
        if groups.replicate is None:
            mesh = DeviceMesh.from_group(groups.shard, device_type)
        else:
            rows: list[Any] = [None] * dist.get_world_size(groups.replicate)
            shard_ranks = dist.get_process_group_ranks(groups.shard)
            with comm.named("the exchange of the hybrid mesh's ranks", groups.replicate):
                dist.all_gather_object(rows, shard_ranks, group=groups.replicate)
            mesh = DeviceMesh.from_group(
                [groups.replicate, groups.shard],
                device_type,
                mesh=torch.tensor(rows),
                mesh_dim_names=("replicate", "shard"),
            )
        _MESHES[key] = mesh
    return _MESHES[key]


def _placements(handle: FlatParamHandle, sharded: bool) -> list[Placement]:
    inner: Placement = Shard(0) if sharded and handle.uses_sharded_strategy else Replicate()
    return [Replicate(), inner] if handle.groups.replicate is not None else [inner]


def _dim0_chunk(full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``full`` as DTensor's ``Shard(0)`` cuts them (``torch.chunk``
    sizes: ceil(rows / size) each, the last ones shorter or empty)."""
    rows = full.shape[0]
    chunk = math.ceil(rows / size) if rows else 0
    start = min(rank * chunk, rows)
    return full[start : min(start + chunk, rows)]


def _sharded_value(
    full: torch.Tensor, handle: FlatParamHandle, device_type: str, offload_to_cpu: bool
) -> DTensor:
    sharded = full.dim() > 0 and handle.uses_sharded_strategy
    local = full
    if sharded:
        local = _dim0_chunk(full, handle.groups.shard_rank, handle.groups.shard_size)
    return DTensor.from_local(
        _copied(local, offload_to_cpu),
        _mesh(handle.groups, device_type),
        _placements(handle, sharded),
        run_check=False,
        shape=full.shape,
        stride=full.stride(),
    )


def unit_state_dict(root: Unit, destination: Any, prefix: str, keep_vars: bool) -> Any:
    """``root.state_dict()`` in its state dict type (see [Note: state dict keys])."""
    units = units_in(root.fsdp_module)
    _check_idle(units, "state_dict()")
    state_dict_type = root.state_dict_type
    config = root.state_dict_config
    entries, metadata, unit_paths = _plan(root.fsdp_module, units, prefix)
    if destination is None:
        destination = OrderedDict()
        destination._metadata = OrderedDict()
    if hasattr(destination, "_metadata"):
        destination._metadata.update(metadata)
    keep = not (
        state_dict_type == StateDictType.FULL_STATE_DICT
        and isinstance(config, FullStateDictConfig)
        and config.rank0_only
        and dist.get_rank() != 0
    )
    device_type = root.compute_device.type
    values: dict[str, Any] = {}
    if state_dict_type == StateDictType.LOCAL_STATE_DICT:
        for path, unit in unit_paths.items():
            handle = unit.handle
            if handle is not None:
                for name, segment in zip(FLAT_PARAM_NAMES, handle.segments):
                    values[path + name] = _local_value(handle, segment, device_type, config)
    else:
        values = _managed_values(entries, state_dict_type, config, device_type)
    if not keep:
        return destination
    for entry in entries:
        if entry.handle is None:
            values[entry.key] = _plain_value(entry, config)
        if entry.key in values:
            destination[entry.key] = values.pop(entry.key)
    destination.update(values)  # LOCAL: the flat shards
    return destination


def _managed_values(
    entries: list[_Entry], state_dict_type: StateDictType, config: Any, device_type: str
) -> dict[str, Any]:
    """FULL or SHARDED values of the managed parameters, one unit at a time."""
    rank0_only = (
        state_dict_type == StateDictType.FULL_STATE_DICT
        and isinstance(config, FullStateDictConfig)
        and config.rank0_only
    )
    by_handle: dict[int, list[_Entry]] = {}
    for entry in entries:
        if entry.handle is not None:
            by_handle.setdefault(id(entry.handle), []).append(entry)
    values: dict[str, Any] = {}
    for handle_entries in by_handle.values():
        handle = handle_entries[0].handle
        assert handle is not None
        if rank0_only:
            rank0_views = _full_on_rank0(handle, config.offload_to_cpu)
            if rank0_views is not None:
                for entry in handle_entries:
                    values[entry.key] = rank0_views[entry.index]
            continue
        with _gathered(handle) as views:
            made: dict[int, Any] = {}
            for entry in handle_entries:
                if entry.index not in made:
                    full = views[entry.index]
                    if state_dict_type == StateDictType.SHARDED_STATE_DICT:
                        made[entry.index] = _sharded_value(
                            full, handle, device_type, config.offload_to_cpu
                        )
                    else:
                        made[entry.index] = _copied(full, config.offload_to_cpu)
                values[entry.key] = made[entry.index]
    return values


def _full_on_rank0(handle: FlatParamHandle, offload_to_cpu: bool) -> list[torch.Tensor] | None:
    """``rank0_only``: the unit's full parameters on rank 0, gathered from its shard group
    straight into the buffer the state dict keeps (the values are views of it); the other
    ranks only send their shard (ranks of other replicas of it, nothing)."""
    if 0 not in dist.get_process_group_ranks(handle.groups.shard):
        return None
    return handle.full_params_on_first_rank(torch.device("cpu") if offload_to_cpu else None)


def _local_value(
    handle: FlatParamHandle, segment: FlatSegment, device_type: str, config: StateDictConfig
) -> DTensor:
    shard = segment.flat_param._local_shard.detach()
    if config.offload_to_cpu:
        shard = shard.to("cpu")
    padded = segment.layout.padded_numel
    return DTensor.from_local(
        shard,
        _mesh(handle.groups, device_type),
        _placements(handle, sharded=True),
        run_check=False,
        shape=torch.Size([padded]),
        stride=(1,),
    )


# -- loading ---------------------------------------------------------------------------------


def _as_full(value: Any, key: str) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"state dict value for '{key}' is a {type(value).__name__}, not a tensor")
    return value


def load_pre_hook(
    fsdp_module: nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Registered on every FSDP1 wrapper: see [Note: state dict keys]."""
    unit = unit_of(fsdp_module)
    assert unit is not None, "load_pre_hook is registered on units only"
    wrapped = prefix + FSDP_PREFIX
    for key in list(state_dict):
        if key.startswith(prefix) and not key.startswith(wrapped):
            state_dict[wrapped + key[len(prefix) :]] = state_dict.pop(key)
    handle = unit.handle
    if handle is None:
        return
    _check_idle([unit], "load_state_dict()")  # each unit's hook checks its own
    if handle.state != HandleState.SHARDED:
        handle.reshard()
    paths = _module_paths(unit.module)
    if unit.state_dict_type == StateDictType.LOCAL_STATE_DICT:
        for name, segment in zip(FLAT_PARAM_NAMES, handle.segments):
            value = state_dict.pop(wrapped + name, None)
            if value is None:
                missing_keys.append(prefix + name)
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            shard = segment.flat_param._local_shard
            if local.numel() != shard.numel():
                raise ValueError(
                    f"cannot load '{prefix}{name}' into FSDP unit '{handle.label}': "
                    f"the local shard has {local.numel()} elements but this rank's shard has "
                    f"{shard.numel()}. A LOCAL_STATE_DICT loads only at the world size and "
                    "wrapping it was saved with; use SHARDED_STATE_DICT to change them"
                )
            with torch.no_grad():
                shard.copy_(local.reshape(shard.shape))
    else:
        for index, owners in enumerate(handle.owners):
            keys = [wrapped + path + name for module, name in owners for path in paths[id(module)]]
            found = [key for key in keys if key in state_dict]
            if not found:
                missing_keys.append(prefix + keys[0][len(wrapped) :])
                continue
            value = state_dict[found[0]]
            for key in found:
                del state_dict[key]
            handle.load_full_param(index, _as_full(value, found[0]))
    # What nn.Module's own loading of the wrapped modules will look for: no-op copies.
    if not unit.settings.use_orig_params:
        for name, flat_param in zip(FLAT_PARAM_NAMES, handle.flat_params):
            state_dict[wrapped + name] = flat_param
    else:
        for param, owners in zip(handle.orig_params, handle.owners):
            for module, name in owners:
                if module._parameters.get(name) is param:
                    for path in paths[id(module)]:
                        state_dict[wrapped + path + name] = param


def _module_paths(module: nn.Module) -> dict[int, list[str]]:
    """Every path (with a trailing dot, "" for ``module``) of each module under ``module``, as
    keys spell it: without activation checkpointing's ``_checkpoint_wrapped_module.``, which
    the wrapper's own load pre-hook puts back into the keys under it."""
    paths: dict[int, list[str]] = {}
    for name, submodule in module.named_modules(remove_duplicate=False):
        path = clean_fqn(name + ".") if name else ""
        known = paths.setdefault(id(submodule), [])
        if path not in known:
            known.append(path)
    return paths
