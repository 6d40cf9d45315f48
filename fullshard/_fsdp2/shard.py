"""``fully_shard``: torch's FSDP2 API, a second front door on the engine FSDP1's uses.

``fully_shard(module)`` builds one unit for ``module`` (``_engine.build``), its options
translated into the engine's neutral ``Sharding`` (``_engine/sharding.py``) with ``mesh``
set: the unit lays its parameters out split on dim 0 and its original parameters become
``DTensor`` s (``_engine/dtensor_params.py``), so the optimizer,
``model.state_dict()``, ``torch.nn.utils.clip_grad_norm_`` and torch's checkpoint API see
what torch's FSDP2 gives them. The unit is driven by module hooks (``state``) instead of a
wrapper's forward: the same ``before_forward`` / ``after_forward`` the FSDP1 front door
calls, so the schedule (one all-gather and one reduce-scatter per unit, prefetching,
reductions in flight) is the engine's. The module's class becomes ``FSDP<Class>``
(``module.FSDPModule``), as in torch.

Call it bottom-up: blocks first, then the root; each call manages the parameters of its
module that no earlier call manages. A list of modules is one group (one unit): gathered
before the first of them runs forward, resharded after the last, as in torch.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Shard

from .. import _switches
from .._engine import init
from .._engine.build import build_unit
from .._engine.dtensor_params import sharded_by_a_unit
from .._engine.optimizer_check import watch_optimizers
from .._engine.orig_params import RELEASED
from .._engine.settings import Settings, resolve_mixed_precision
from .._engine.sharding import for_mesh
from .._engine.unit import Unit, unit_of, units_in
from ..api import (
    BackwardPrefetch,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    from_torch,
)
from .module import FSDPModule, fsdp_class
from .placement import ParamGroup, param_groups
from .state import (
    STATE_ATTR,
    ShardedModule,
    enter,
    leave,
    post_forward,
    pre_forward,
    register_state_dict_hooks,
    state_of,
)

__all__ = ["fully_shard", "register_fsdp_forward_method"]

_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> Any:
    """Shard ``module``'s parameters (those no earlier ``fully_shard`` call on a submodule
    manages) on dim 0 over ``mesh``; see torch's ``torch.distributed.fsdp.fully_shard``."""
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...) (parameters already DTensors on the whole SPMD "
            "mesh) is not implemented by fullshard yet; pass the data-parallel sub-mesh "
            "instead: fully_shard(module, mesh=world_mesh['dp'])"
        )
    members = _modules(module)
    mp_policy = _policy(mp_policy, MixedPrecisionPolicy, "mp_policy")
    offload_policy = _policy(offload_policy, OffloadPolicy, "offload_policy")
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    for member in members:
        _check_not_applied(member)
        _check_params(member, ignored_params)
    target = members[0] if len(members) == 1 else _Group(members)
    groups = param_groups(target, mesh, shard_placement_fn, ignored_params)
    for member in members:  # after the call's own checks: torch finds a tie at first forward
        _check_ties_kept(member)
    watch_optimizers()
    units = _build_units(
        members, target, groups, reshard_after_forward, mp_policy, offload_policy, ignored_params
    )
    state = ShardedModule(tuple(units), mp_policy.output_dtype, members)
    for member in members:
        member.__dict__[STATE_ATTR] = state
        _mark_in_composable_registry(member)
        member.register_forward_pre_hook(functools.partial(pre_forward, state), with_kwargs=True)
        member.register_forward_hook(functools.partial(post_forward, state), with_kwargs=True)
        member.__class__ = fsdp_class(type(member))
    return module


def _build_units(
    members: tuple[nn.Module, ...],
    target: nn.Module,
    groups: list[ParamGroup],
    reshard_after_forward: bool | int | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
) -> list[Unit]:
    """One unit per group of the call's parameters, the first attached to the call's
    modules and the others its siblings (see [Note: sibling units])."""
    units: list[Unit] = []
    for group in groups:
        _check_mesh(group.mesh)
        resharding, post_forward_group = _reshard_group(reshard_after_forward, group.mesh)
        settings = _settings(
            target, group, resharding, post_forward_group, mp_policy, offload_policy, ignored_params
        )
        excluded = {p for other in groups if other is not group for p in other.params}
        primary = units[0] if units else None
        unit = build_unit(members[0], target, settings, excluded, members[1:], primary)
        unit.tag = group.tag
        register_state_dict_hooks(unit)
        units.append(unit)
    return units


def _settings(
    target: nn.Module,
    group: ParamGroup,
    reshard_after_forward: bool | None,
    post_forward_group: dist.ProcessGroup | None,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
) -> Settings:
    """The engine's settings for the unit of one group of a ``fully_shard`` call: FSDP2's
    options in the engine's neutral terms (see [Note: neutral settings])."""
    mesh = group.mesh
    _, ignored = init.resolve_ignored(None, list(ignored_params or ()))
    return Settings(
        sharding=for_mesh(mesh, reshard_after_forward, post_forward_group, group.shard_dim()),
        use_orig_params=True,
        backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch=False,
        limit_all_gathers=True,
        device_id=init.device_from_device_id(_mesh_device(mesh), dist.get_rank()),
        mixed_precision=resolve_mixed_precision(_mixed_precision(mp_policy)),
        offload_params=isinstance(offload_policy, CPUOffloadPolicy),
        ignored_modules=(),
        ignored_params=ignored,
        param_init_fn=None,
        sync_module_states=False,
        switches=_switches.reload(),
        mp_policy=mp_policy,
    )


def _mark_in_composable_registry(module: nn.Module) -> None:
    """Name ``module`` "fully_shard" in torch's registry of composable APIs (a dict in the
    module's ``__dict__``), which torch's other composables read: ``replicate`` leaves the
    parameters of such modules to them rather than replacing their DTensors by local
    tensors, and applying torch's own ``fully_shard`` on top is refused."""
    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

    registry = module.__dict__.setdefault(REGISTRY_KEY, {})
    registry.setdefault("fully_shard", RegistryItem())


def _policy(policy: Any, cls: type, name: str) -> Any:
    """fullshard's ``cls`` for ``policy`` (torch's own policy objects taken field for field:
    see [Note: torch's configuration objects] in ``api``)."""
    policy = from_torch(policy)
    if not isinstance(policy, cls):
        raise TypeError(
            f"fully_shard's {name} must be a {cls.__name__} (fullshard's or torch's), got "
            f"{policy!r}"
        )
    return policy


class _Group(nn.Module):
    """The modules of one ``fully_shard([...])`` call, as the one module the engine's unit
    manages (outside the model's tree: the modules stay where they are)."""

    def __init__(self, members: tuple[nn.Module, ...]) -> None:
        super().__init__()
        for index, member in enumerate(members):
            self.add_module(str(index), member)


def _state(module: nn.Module) -> Unit:
    """The engine's unit ``fully_shard`` attached to ``module`` (torch's ``FSDPState``)."""
    unit = unit_of(module)
    if unit is None or not isinstance(module, FSDPModule):
        raise ValueError(f"{type(module).__qualname__} is not a module fully_shard was applied to")
    return unit


fully_shard.state = _state  # type: ignore[attr-defined]


# -- checks ------------------------------------------------------------------------------


def _modules(module: nn.Module | list[nn.Module]) -> tuple[nn.Module, ...]:
    members = list(module) if isinstance(module, (list, tuple)) else [module]
    if not members:
        raise ValueError("fully_shard was given an empty list of modules")
    for member in members:
        if not isinstance(member, nn.Module):
            raise TypeError(f"fully_shard takes an nn.Module, got {type(member).__qualname__}")
        if (
            isinstance(member, (nn.ModuleList, nn.ModuleDict))
            and type(member).forward is nn.Module.forward
        ):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"{type(member).__name__}; apply it to the modules it holds, or to its parent"
            )
    if len({id(m) for m in members}) != len(members):
        raise ValueError("fully_shard was given the same module twice in one list")
    for member in members:
        inside = [m for m in members if m is not member and _contains(member, m)]
        if inside:
            raise ValueError(
                f"fully_shard was given a {type(member).__qualname__} and a "
                f"{type(inside[0]).__qualname__} inside it in one list; a group's modules "
                "must be disjoint (apply fully_shard to the inner one first)"
            )
    return tuple(members)


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


class AppliedTwiceError(ValueError, AssertionError):
    """``fully_shard`` applied to a module twice: torch raises an AssertionError (its
    ``contract``), fullshard raised ValueError before, so it is both."""


def _check_not_applied(module: nn.Module) -> None:
    """Twice on one module, or top-down (a parameter already managed by an ancestor's call)."""
    if isinstance(module, FSDPModule) or unit_of(module) is not None:
        original = (
            type(module).__mro__[type(module)._orig_cls_mro_index]
            if isinstance(module, FSDPModule)
            else type(module)
        )
        raise AppliedTwiceError(
            "Each distinct composable distributed API can only be applied to a module once. "
            f"fully_shard was already applied to this {original.__qualname__}; apply it once "
            "per module"
        )
    nested = {id(p) for unit in units_in(module) for p in _managed(unit)}
    for name, param in module.named_parameters():
        if sharded_by_a_unit(param) and id(param) not in nested:
            raise ValueError(
                f"parameter '{name}' of this {type(module).__qualname__} is already sharded by "
                "fully_shard on an ancestor module: fully_shard is applied bottom-up. Apply it "
                "to the submodules first (e.g. each transformer block), then to the root"
            )


def _check_params(module: nn.Module, ignored: set[nn.Parameter] | None) -> None:
    """A 0-d parameter has no dim to shard; a non-contiguous one (channels-last) is not
    supported yet (torch's texts and exception types)."""
    for name, param in module.named_parameters():
        if sharded_by_a_unit(param) or param in (ignored or ()):
            continue  # a nested call's, or left alone
        if param.ndim == 0:
            raise ValueError(
                "fully_shard doesn't support scalar parameters. "
                f"Change {name} to a 1D tensor with numel equal to 1."
            )
        if not param.is_contiguous():
            raise NotImplementedError(
                f"FSDP does not support non-contiguous parameters yet: {param.shape=} "
                f"{param.stride()=}: parameter '{name}'; make it contiguous before fully_shard "
                "(e.g. module.to(memory_format=torch.contiguous_format))"
            )


def _check_ties_kept(module: nn.Module) -> None:
    """A parameter tied between a module sharded on its own and one outside it: that call
    gave its module a DTensor parameter and left the other module the old one (emptied), so
    the tie would be silently broken. Raise instead, naming both."""
    for name, param in module.named_parameters():
        if param in RELEASED:
            raise ValueError(
                f"Parameter '{name}' is shared with a parameter already managed by another "
                "FSDP group. For shared/tied parameters, use fully_shard([module_a, module_b]) "
                f"to place them in the same FSDP group: parameter '{name}' of this "
                f"{type(module).__qualname__} is tied to '{RELEASED[param]}' of a module "
                "fully_shard was applied to on its own, which broke the tie. A tied parameter "
                "must be managed by a module containing every module that uses it: do not "
                "apply fully_shard to that module alone (leave it to this one), or put both "
                "in one group (fully_shard([a, b]))"
            )


def _managed(unit: Unit) -> list[nn.Parameter]:
    return [] if unit.handle is None else list(unit.handle.orig_params)


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard's mesh must be a DeviceMesh, got {type(mesh).__qualname__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: it takes a 1-D mesh "
            f"(FSDP) or a 2-D (replicate, shard) mesh (HSDP), got a {mesh.ndim}-D mesh; pass "
            "the data-parallel dims of a larger mesh (world_mesh['dp'])"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified (e.g. "
            "init_device_mesh(..., mesh_dim_names=('replicate', 'shard')))"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"rank {dist.get_rank()} is not in fully_shard's mesh {mesh}: apply fully_shard "
            "with a mesh only on its ranks (e.g. world_mesh['dp'], which holds each rank's own "
            "data-parallel group)"
        )


_POST_FORWARD_MESHES: weakref.WeakKeyDictionary[
    dist.ProcessGroup, dict[tuple[str, tuple[int, ...], int], DeviceMesh]
] = weakref.WeakKeyDictionary()
"""Default process group (held weakly: a world set up again starts afresh) -> (device type,
the ranks of a mesh in order, k) -> the mesh whose rows are its groups of ``k`` ranks. Made
once per ranks and k and shared by every module sharded over them: each ``mesh=None`` call
makes a new mesh over the same ranks, and each new group costs every rank a gloo group and a
shared-memory file (32 MiB each for 2 ranks)."""


def _reshard_group(
    reshard_after_forward: bool | int | None, mesh: DeviceMesh
) -> tuple[bool | None, dist.ProcessGroup | None]:
    """``reshard_after_forward`` as a bool (None: the default), and for an int ``k``
    strictly between 1 and the shard group's size, the group of ``k`` consecutive ranks this
    rank keeps parameters sharded over between forward and backward, as torch's."""
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        return reshard_after_forward, None
    if not isinstance(reshard_after_forward, int):
        raise ValueError(
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {reshard_after_forward}"
        )
    shard_size = mesh.size(mesh.ndim - 1)
    k = reshard_after_forward
    if k < 1 or k > shard_size or shard_size % k != 0:
        raise ValueError(
            "If passing reshard_after_forward as an int, it should be a factor of "
            f"{shard_size}, not {k}"
        )
    if k == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)",
            stacklevel=3,
        )
        return False, None
    if k == shard_size:
        return True, None
    world = dist.group.WORLD
    assert world is not None, "checked by the mesh's construction"
    meshes = _POST_FORWARD_MESHES.setdefault(world, {})
    key = (mesh.device_type, tuple(mesh.mesh.flatten().tolist()), k)
    if key not in meshes:
        meshes[key] = DeviceMesh(mesh.device_type, mesh.mesh.view(-1, k))
    return True, meshes[key].get_group(1)


def _mixed_precision(policy: MixedPrecisionPolicy) -> MixedPrecision | None:
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None
    return MixedPrecision(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
        cast_root_forward_inputs=policy.cast_forward_inputs,
        _module_classes_to_ignore=(),
    )


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed initialised: call "
            "torch.distributed.init_process_group() first (torchrun sets the environment)"
        )
    device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mesh_device(mesh: DeviceMesh) -> torch.device | None:
    if mesh.device_type == "cpu":
        return None
    return torch.device(mesh.device_type, torch.cuda.current_device())


# -- forward methods -----------------------------------------------------------------------


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) as the module's forward: its
    parameters unsharded around it, as its ``forward`` gets from the hooks. On a module
    ``fully_shard`` was not applied to it does nothing, as torch's, so scripts may call it
    whether or not they shard the module."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    state: ShardedModule = state_of(module)
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = enter(state, module, args, kwargs)
        return leave(state, (args, kwargs), method(*args, **kwargs))

    setattr(module, method_name, as_forward)
