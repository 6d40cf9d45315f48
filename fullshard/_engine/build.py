"""Building a unit: which parameters it manages, where it computes, its flat parameters.

A front door resolves the settings and calls ``build_unit`` bottom-up (nested units first):
what nested units manage or ignore is left to them. The unit comes back attached to
``fsdp_module``; the front door keeps it alive.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from . import init
from .dtensor_params import DTensorParams
from .flat_param import FlatParameter, FlatParamHandle
from .names import FLAT_PARAM_NAMES, clean_fqn, flat_param_owner, mark_managed
from .settings import Settings
from .unit import Unit, attach, attach_sibling, unit_of, units_in

__all__: list[str] = []


def build_unit(
    fsdp_module: nn.Module,
    module: nn.Module,
    settings: Settings,
    excluded_params: set[nn.Parameter],
    members: tuple[nn.Module, ...] = (),
    sibling_of: Unit | None = None,
) -> Unit:
    """A unit managing ``module``'s parameters, attached to ``fsdp_module`` (and to
    ``members``, see ``attach``), leaving ``excluded_params`` to an ancestor (auto-wrapping
    keeps shared parameters there) or to sibling units; or, with ``sibling_of``, a sibling of
    that unit (see [Note: sibling units])."""
    for ignored in settings.ignored_modules:
        if unit_of(ignored) is not None:
            raise ValueError(
                "`ignored_modules` should not include FSDP modules: pass the module it wraps"
            )
    ignored_modules = init.expand_ignored(module, settings.ignored_modules)
    ignored_params = {p for m in ignored_modules for p in m.parameters(recurse=False)} | set(
        settings.ignored_params
    )
    for nested in units_in(module):  # what nested units ignore, their ancestors do too
        ignored_params |= nested.ignored_params
    unit = Unit(fsdp_module, module, settings, ignored_modules, ignored_params)
    managed_modules = unit.managed_modules()
    default_device = init.default_compute_device(settings.sharding.groups.shard)
    if settings.sharding.mesh is None:  # fully_shard leaves a meta model to its to_empty
        init.materialize(
            managed_modules,
            ignored_params,
            settings.param_init_fn,
            settings.device_id or default_device,
        )
    params, owners, fqns = _collect_unit_params(module, excluded_params | ignored_params)
    where = f"the module of type {type(module).__name__} wrapped by FSDP"
    init.check_single_device(list(zip(fqns, params)), settings.device_id, where)
    if settings.device_id is not None:
        init.move_cpu_states(managed_modules, ignored_params, settings.device_id)
    elif params and params[0].device.type == "cpu" and default_device.type != "cpu":
        init.warn_cpu_init()
    unit.compute_device = init.compute_device(
        params[0].device if params else None,
        settings.device_id,
        default_device,
        dist.get_rank() if dist.is_initialized() else 0,
    )
    buffers = [b for m in managed_modules for b in m.buffers(recurse=False)]
    if settings.sync_module_states:
        init.sync_module_states([p.detach() for p in params] + buffers, settings.sharding.groups)
    if params:
        unit.set_handle(_make_handle(unit, params, owners, fqns))
    mark_managed(managed_modules)
    if sibling_of is None:
        attach(unit, members)
    else:
        attach_sibling(unit, sibling_of)
    return unit


def _make_handle(
    unit: Unit,
    params: list[nn.Parameter],
    owners: list[list[tuple[nn.Module, str]]],
    fqns: list[str],
) -> FlatParamHandle:
    settings = unit.settings
    sharding = settings.sharding
    handle = FlatParamHandle(
        params,
        owners,
        fqns,
        sharding,
        settings.use_orig_params,
        unit.compute_device,
        label=type(unit.module).__name__,
        mixed_precision=unit.mixed_precision,
        offload_params=settings.offload_params,
        unsafe_setattr=settings.switches.use_unsafe_setattr,
        dtensor_params=(
            None
            if sharding.mesh is None
            else DTensorParams(
                sharding.mesh,
                params,
                [sharding.shard_dim(p) for p in params] if sharding.shard_dim is not None else None,
                sharding.post_forward_group,
                settings.mp_policy,
            )
        ),
    )
    if not settings.use_orig_params:
        owner = flat_param_owner(unit.module)
        for name, flat_param in zip(FLAT_PARAM_NAMES, handle.flat_params):
            owner.register_parameter(name, flat_param)
    return handle


def _collect_unit_params(
    module: nn.Module, excluded: set[nn.Parameter]
) -> tuple[list[nn.Parameter], list[list[tuple[nn.Module, str]]], list[str]]:
    """The parameters this unit manages, every (module, attr) that refers to each, and names.

    A parameter belongs to the unit unless a nested unit manages it or an auto-wrapping
    ancestor keeps it (``excluded``: shared with modules outside this subtree). Parameters
    shared inside the subtree are managed once, with one owner per referring module.
    """
    nested_owners = _nested_unit_owners(module)
    params: list[nn.Parameter] = []
    owners: list[list[tuple[nn.Module, str]]] = []
    fqns: list[str] = []
    index_of: dict[int, int] = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for name, param in list(submodule._parameters.items()):
            if param is None or isinstance(param, FlatParameter) or param in excluded:
                continue
            fqn = clean_fqn(f"{prefix}.{name}" if prefix else name)
            if id(param) in nested_owners:
                if (id(submodule), name) not in nested_owners[id(param)]:
                    raise ValueError(
                        f"parameter '{fqn}' is shared with a nested FSDP unit that already "
                        "manages it, so the two would diverge. Wrap the common ancestor of the "
                        "modules sharing it instead of one of them, or pass an auto_wrap_policy "
                        "to the outer unit: auto-wrapping keeps shared parameters in the ancestor"
                    )
                continue
            if id(param) in index_of:
                slot_owners = owners[index_of[id(param)]]
                if (submodule, name) not in slot_owners:
                    slot_owners.append((submodule, name))
                continue
            index_of[id(param)] = len(params)
            params.append(param)
            owners.append([(submodule, name)])
            fqns.append(fqn)
    return params, owners, fqns


def _nested_unit_owners(module: nn.Module) -> dict[int, set[tuple[int, str]]]:
    """For each parameter a nested unit manages, the (module id, attr) pairs it maintains."""
    result: dict[int, set[tuple[int, str]]] = {}
    for unit in units_in(module):
        handle = unit.handle
        if handle is None:
            continue
        for param, slot_owners in zip(handle.orig_params, handle.owners):
            result[id(param)] = {(id(m), name) for m, name in slot_owners}
    return result
