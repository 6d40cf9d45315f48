"""``fully_shard``: torch's FSDP2 API, a second front door on the engine FSDP1's uses.

``fully_shard(module)`` builds one unit for ``module`` (``_engine.build``) with
``Settings.dtensor_mesh`` set: the unit lays its parameters out split on dim 0 and its
original parameters become ``DTensor`` s (``_engine/dtensor_params.py``), so the optimizer,
``model.state_dict()``, ``torch.nn.utils.clip_grad_norm_`` and torch's checkpoint API see
what torch's FSDP2 gives them. The unit is driven by module hooks instead of a wrapper's
forward: the same ``before_forward`` / ``after_forward`` the FSDP1 front door calls, so the
schedule (one all-gather and one reduce-scatter per unit, prefetching, the root kept
unsharded after forward, reductions in flight) is the engine's. The module's class becomes
``FSDP<Class>``, a subclass of ``FSDPModule`` and of its own class, as in torch.

Call it bottom-up: blocks first, then the root; each call manages the parameters of its
module that no earlier call manages. A list of modules is one group (one unit): gathered
before the first of them runs forward, resharded after the last, as in torch.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from ._engine import convert
from ._engine import forward as _forward
from ._engine.build import build_unit
from ._engine.flat_param import HandleState
from ._engine.optimizer_check import watch_optimizers
from ._engine.orig_params import RELEASED
from ._engine.runtime import TrainingState, UnitRuntime
from ._engine.settings import resolve_settings
from ._engine.unit import Unit, unit_of, units_in
from .api import (
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

_FSDP_CLASSES: dict[type[nn.Module], type[nn.Module]] = {}
"""Original class -> its ``FSDP<Class>`` subclass (made once per class)."""


_NO_MIXED_PRECISION = MixedPrecisionPolicy()
_NO_OFFLOAD = OffloadPolicy()


@dataclasses.dataclass
class _ShardedModule:
    """What ``fully_shard`` keeps on the module it was applied to (whose class is now ours):
    its unit (the engine's registry holds units weakly) and the FSDP2 options the engine's
    settings do not carry."""

    unit: Unit
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


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
    offload_policy: OffloadPolicy = _NO_OFFLOAD,
    ignored_params: set[nn.Parameter] | None = None,
) -> Any:
    """Shard ``module``'s parameters (those no earlier ``fully_shard`` call on a submodule
    manages) on dim 0 over ``mesh``; see torch's ``torch.distributed.fsdp.fully_shard``."""
    members = _modules(module)
    mesh = mesh if mesh is not None else _default_mesh()
    _check_mesh(mesh)
    for member in members:
        _check_not_applied(member)
        _check_ties_kept(member)
    target = members[0] if len(members) == 1 else _Group(members)
    reshard_after_forward, post_forward_group = _reshard_group(reshard_after_forward, mesh)
    strategy = _strategy(reshard_after_forward, mesh)
    groups: dict[str, Any] = (
        {"device_mesh": mesh} if mesh.ndim == 2 else {"process_group": mesh.get_group(0)}
    )
    with warnings.catch_warnings():  # FSDP1's warning on one rank; torch's fully_shard has none
        warnings.filterwarnings("ignore", message="FSDP is switching to use `NO_SHARD`")
        settings = _resolve(groups, strategy, mp_policy, offload_policy, ignored_params, mesh)
    shard_dim = _shard_dims(target, shard_placement_fn, settings.ignored_params)
    settings = dataclasses.replace(
        settings,
        dtensor_mesh=mesh,
        dtensor_shard_dim=shard_dim,
        post_forward_group=post_forward_group,
    )
    watch_optimizers()
    unit = build_unit(members[0], target, settings, set(), members[1:])
    state = _ShardedModule(unit, mp_policy.output_dtype, members)
    for member in members:
        member.__dict__["_fullshard_state"] = state
        member.register_forward_pre_hook(functools.partial(_pre_forward, state), with_kwargs=True)
        member.register_forward_hook(functools.partial(_post_forward, state), with_kwargs=True)
        member.__class__ = _fsdp_class(type(member))
    return module


def _resolve(
    groups: dict[str, Any],
    strategy: ShardingStrategy,
    mp_policy: MixedPrecisionPolicy,
    offload_policy: OffloadPolicy,
    ignored_params: set[nn.Parameter] | None,
    mesh: DeviceMesh,
) -> Any:
    """The engine's settings for a ``fully_shard`` call (FSDP1's options it maps onto)."""
    return resolve_settings(
        {
            **groups,
            "sharding_strategy": strategy,
            "mixed_precision": _mixed_precision(mp_policy),
            "cpu_offload": CPUOffload(offload_params=isinstance(offload_policy, CPUOffloadPolicy)),
            "ignored_states": list(ignored_params or ()),
            "use_orig_params": True,
            "device_id": _mesh_device(mesh),
        }
    )


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
        if isinstance(member, (nn.ModuleList, nn.ModuleDict)):
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


def _check_not_applied(module: nn.Module) -> None:
    """Twice on one module, or top-down (a parameter already managed by an ancestor's call)."""
    if isinstance(module, FSDPModule) or unit_of(module) is not None:
        original = type(module).__mro__[2] if isinstance(module, FSDPModule) else type(module)
        raise ValueError(
            f"fully_shard was already applied to this {original.__qualname__}; apply it once "
            "per module"
        )
    nested = {id(p) for unit in units_in(module) for p in _managed(unit)}
    for name, param in module.named_parameters():
        if isinstance(param, DTensor) and id(param) not in nested:
            raise ValueError(
                f"parameter '{name}' of this {type(module).__qualname__} is already sharded by "
                "fully_shard on an ancestor module: fully_shard is applied bottom-up. Apply it "
                "to the submodules first (e.g. each transformer block), then to the root"
            )


def _check_ties_kept(module: nn.Module) -> None:
    """A parameter tied between a module sharded on its own and one outside it: that call
    gave its module a DTensor parameter and left the other module the old one (emptied), so
    the tie would be silently broken. Raise instead, naming both."""
    for name, param in module.named_parameters():
        if param in RELEASED:
            raise ValueError(
                f"parameter '{name}' of this {type(module).__qualname__} is tied to "
                f"'{RELEASED[param]}' of a module fully_shard was applied to on its own, which "
                "broke the tie. A tied parameter must be managed by a module containing every "
                "module that uses it: do not apply fully_shard to that module alone (leave it to "
                "this one), or put both in one group (fully_shard([a, b]))"
            )


def _managed(unit: Unit) -> list[nn.Parameter]:
    return [] if unit.handle is None else list(unit.handle.orig_params)


def _check_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard's mesh must be a DeviceMesh, got {type(mesh).__qualname__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard takes a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP), "
            f"got a {mesh.ndim}-D mesh"
        )
    if mesh.size() != dist.get_world_size():
        raise ValueError(
            f"fully_shard's mesh spans {mesh.size()} ranks but the default process group has "
            f"{dist.get_world_size()}; build the mesh over every rank (init_device_mesh("
            f"'{mesh.device_type}', ({dist.get_world_size()},)))"
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


def _strategy(reshard_after_forward: bool | None, mesh: DeviceMesh) -> ShardingStrategy:
    if reshard_after_forward is None:
        reshard_after_forward = True  # the root keeps its parameters anyway (the engine's)
    if mesh.ndim == 2:
        return (
            ShardingStrategy.HYBRID_SHARD
            if reshard_after_forward
            else ShardingStrategy._HYBRID_SHARD_ZERO2
        )
    return ShardingStrategy.FULL_SHARD if reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP


def _shard_dims(
    module: nn.Module,
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None,
    ignored: tuple[nn.Parameter, ...],
) -> Callable[[nn.Parameter], int] | None:
    """The dim ``shard_placement_fn`` shards each parameter this call manages on (None for
    every parameter on dim 0), checked: a ``Shard`` of one of the parameter's dims."""
    if shard_placement_fn is None:
        return None
    skipped = {id(p) for p in ignored}
    dims: dict[int, int] = {}
    for name, param in module.named_parameters():
        if id(param) in skipped or isinstance(param, DTensor):  # ignored, or a nested call's
            continue
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if type(placement) is not Shard:
            raise ValueError(
                f"shard_placement_fn returned {placement!r} for parameter '{name}': fully_shard "
                "shards a parameter on one dim, Shard(dim) (None: Shard(0))"
            )
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise ValueError(
                f"shard_placement_fn returned Shard({placement.dim}) for parameter '{name}' of "
                f"shape {tuple(param.shape)}, which has no such dim"
            )
        dims[id(param)] = dim
    return lambda param: dims.get(id(param), 0)


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


# -- hooks ---------------------------------------------------------------------------------


def _pre_forward(
    state: _ShardedModule, module: nn.Module, args: Any, kwargs: Any
) -> tuple[Any, Any]:
    if len(state.members) > 1:
        if state.yet_to_run and module not in state.started:
            state.started.append(module)  # the group's forward began at an earlier module
            return args, kwargs
        if state.yet_to_run:  # this module again before the group's end: a forward raised
            state.input_dtypes.clear()
        state.yet_to_run, state.started = list(state.members), [module]
    return _enter(state, module, args, kwargs)


def _post_forward(
    state: _ShardedModule, module: nn.Module, args: Any, kwargs: Any, output: Any
) -> Any:
    if len(state.members) > 1:
        state.yet_to_run = [m for m in state.yet_to_run if m is not module]
        if state.yet_to_run:  # resharded after the group's last module
            return output
    return _exit(state, args, kwargs, output)


def _enter(state: _ShardedModule, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
    args, kwargs, input_dtype = _forward.before_forward(state.unit, args, kwargs, module.training)
    state.input_dtypes.append(input_dtype)
    return args, kwargs


def _exit(state: _ShardedModule, args: Any, kwargs: Any, output: Any) -> Any:
    input_dtype = state.input_dtypes.pop()
    output = _forward.after_forward(state.unit, output, input_dtype, (args, kwargs))
    if state.output_dtype is not None:
        output = _forward.cast_floating(state.output_dtype, output)
    return output


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` (e.g. ``generate``) as the module's forward: its
    parameters unsharded around it, as its ``forward`` gets from the hooks."""
    _state(module)  # raises unless fully_shard was applied to it
    state: _ShardedModule = module.__dict__["_fullshard_state"]
    method = getattr(module, method_name)

    @functools.wraps(method)
    def as_forward(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = _enter(state, module, args, kwargs)
        return _exit(state, args, kwargs, method(*args, **kwargs))

    setattr(module, method_name, as_forward)


# -- the module's new class ----------------------------------------------------------------


def _fsdp_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    return _FSDP_CLASSES[cls]


class UnshardHandle:
    """What ``FSDPModule.unshard(async_op=True)`` returns: ``wait()`` waits for the
    all-gather (the engine's ``UnshardWork``) and gives the module its unsharded parameters."""

    def __init__(self, unit: Unit, work: _forward.UnshardWork) -> None:
        self._unit: Unit | None = unit
        self._work = work

    def wait(self) -> None:
        unit, self._unit = self._unit, None
        self._work.wait()
        handle = unit.handle if unit is not None else None
        if handle is not None and handle.state == HandleState.UNSHARDED:
            handle.use_unsharded_views()


class FSDPModule:
    """What ``fully_shard`` adds to a module's class (torch's ``FSDPModule`` methods)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Containers build new instances of their own class when indexed (nn.Sequential
        # slices): those are plain modules of the original class.
        original: Any = cls.__mro__[2]
        instance = original.__new__(original)
        original.__init__(instance, *args, **kwargs)
        return instance

    def __deepcopy__(self, memo: Any) -> NoReturn:
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization."
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """``to_empty`` (materialising a model sharded on the meta device), ``.to()``,
        ``.half()``...: convert, then give the unit a shard converted the same way and
        re-point the DTensor parameters into it (``_engine.convert``)."""
        unit = self._unit
        convert.before_apply(unit)
        result = super()._apply(fn, recurse)  # type: ignore[misc]
        convert.after_apply(unit, fn)
        return result

    @property
    def _unit(self) -> Unit:
        state: _ShardedModule = self.__dict__["_fullshard_state"]
        return state.unit

    def _units(self, recurse: bool) -> list[Unit]:
        return units_in(self) if recurse else [self._unit]  # type: ignore[arg-type]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather the parameters now (e.g. to overlap with other work before forward);
        after ``wait()`` the module holds its unsharded parameters until ``reshard()`` or its
        forward's end."""
        unit = self._unit
        if unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(f"unshard() of '{unit.label}' inside its forward or backward")
        work = UnshardHandle(unit, _forward.unshard(unit))
        if async_op:
            return work
        work.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its DTensor parameters again."""
        unit = self._unit
        if unit.runtime.training_state != TrainingState.IDLE:
            raise RuntimeError(f"reshard() of '{unit.label}' inside its forward or backward")
        handle = unit.handle
        if handle is not None and handle.state != HandleState.SHARDED:
            handle.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """False: backward accumulates unsharded gradients locally, with no reduce-scatter
        (gradient accumulation); set True again before the last micro-batch's backward."""
        for unit in self._units(recurse):
            unit.runtime.sync_gradients = requires_gradient_sync

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether non-root units free their unsharded parameters after forward (and gather
        them again in backward)."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for unit in self._units(recurse):
            unit.runtime.reshard_after_forward = reshard_after_forward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's reduced gradients by ``factor`` instead of the number of data
        parallel ranks."""
        handle = self._unit.handle
        if handle is not None:
            handle.gradient_divide_factor = float(factor)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False keeps each reduced gradient local to this replica's shard group
        (summed over micro-batches, not yet in ``.grad``); the next backward with True
        all-reduces the sum across replicas once and accumulates it into ``.grad``."""
        for unit in self._units(recurse):
            if unit.handle is not None:
                unit.handle.all_reduce_replicas = requires_all_reduce

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """False: keep the parameters unsharded after backward, so the next forward (e.g. the
        next micro-batch of gradient accumulation) needs no all-gather. If an optimizer step
        changes the shard meanwhile, the next forward gathers again instead of computing with
        stale parameters."""
        for unit in self._units(recurse):
            unit.runtime.reshard_after_backward = reshard_after_backward

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """False: this module's backward does not read its parameters (an embedding: its
        gradient needs only the indices), so the pre-backward hook gathers nothing. Wrong
        if it does read them: they hold no storage then."""
        self._unit.runtime.unshard_in_backward = unshard_in_backward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """At this module's forward, issue the all-gathers of ``modules`` too (after its own),
        so they overlap its compute; replaces the engine's own choice of the next module."""
        self._unit.runtime.forward_prefetch_targets = _runtimes(modules, "forward")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """At this module's pre-backward, issue the all-gathers of ``modules`` too."""
        self._unit.runtime.backward_prefetch_targets = _runtimes(modules, "backward")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for torch's API. torch uses it to skip, on all but the last micro-batch's
        backward, waiting for the last reduce-scatter on its stream; fullshard's backward
        always ends with its gradients reduced (finalising them into ``.grad`` is part of
        the wait), so every backward is complete and the flag changes nothing."""
        if not isinstance(is_last_backward, bool):
            raise TypeError(f"is_last_backward should be a bool, got {type(is_last_backward)}")


def _runtimes(modules: list[FSDPModule], direction: str) -> list[UnitRuntime]:
    runtimes = []
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"set_modules_to_{direction}_prefetch takes modules fully_shard was applied "
                f"to, got a {type(module).__qualname__}"
            )
        runtimes.append(module._unit.runtime)
    return runtimes
