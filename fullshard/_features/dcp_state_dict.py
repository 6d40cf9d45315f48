"""fullshard models in torch's checkpoint API, ``torch.distributed.checkpoint.state_dict``.

[Note: torch's state-dict functions see fullshard's units]
torch's ``get_state_dict`` / ``set_state_dict`` (and their ``_model_`` / ``_optimizer_``
variants) recognise FSDP by torch's own class, through three names of their module:

- ``FSDP``: ``FSDP.fsdp_modules(model)`` decides whether the model is sharded at all; if so
  ``FSDP.state_dict_type`` switches it to SHARDED (or FULL, ``full_state_dict=True``) state
  dicts and ``FSDP.optim_state_dict`` / ``optim_state_dict_to_load`` convert the optimizer's
  state between its parameters and the plain model's FQNs.
- ``_get_fqns(model, name)``: a parameter's name as the plain model spells it; a flat
  parameter's name stands for its original parameters' FQNs.
- ``_get_module_fsdp_state_if_fully_sharded_module``: asked of every unit, must not be None.

Unseen, a fullshard model took the plain-module path and the checkpoint was silently wrong:
the optimizer's flat shards were saved under one key (``_fsdp_wrapped_module._flat_param``)
by every rank, so a resume diverged. fullshard cannot be torch's class (the package never
imports torch's FSDP), so it replaces those three names in that one module with look-ups
that also see fullshard's units and hand everything else to torch's originals:

- ``FSDP`` -> ``_AnyFSDP``: ``isinstance`` accepts either library's units; a model holding
  fullshard units goes to fullshard's own ``state_dict_type`` (torch's enum and configs
  translated by name and field), ``optim_state_dict`` and ``optim_state_dict_to_load``;
  every other attribute is torch's class's.
- ``_get_fqns`` -> ``_fqns``: walks ``_modules`` only (before its first forward, a module of a
  ``use_orig_params=False`` unit has no parameter attributes, which torch's version reads),
  FSDP's and activation checkpointing's wrappers transparent, a flat parameter expanded to its
  original parameters' FQNs; names that pass through no fullshard unit go to torch's version.
- ``_get_module_fsdp_state_if_fully_sharded_module``: a fullshard unit is its own state.

When: the first ``FullyShardedDataParallel`` built installs them if torch's module is already
imported, else an import hook installs them right after it executes. So fullshard never
imports torch's DCP (and the parts of torch's FSDP it loads) for a user who does not.
Written against torch 2.13's module: the names and ``_get_fqns``'s parameters are checked
first. Where they differ nothing is replaced but ``FSDP``, by a version that raises for
fullshard models naming what to use instead (``fullshard.checkpoint``, or
``FSDP.state_dict_type`` with ``FSDP.optim_state_dict``), and a warning says so.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import sys
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .. import api
from .._comm import collectives as comm
from .._engine.flat_param import FlatParameter
from .._engine.names import CHECKPOINT_WRAPPED_MODULE, FSDP_WRAPPED_MODULE
from .._engine.unit import unit_of, units_in
from . import optim_state_dict as _optim_sd
from . import optim_state_dict_load as _optim_load
from .state_dict_type import state_dict_type as state_dict_type_of_units

__all__ = ["install_when_imported"]

TORCH_STATE_DICT = "torch.distributed.checkpoint.state_dict"
"""The module whose look-ups are replaced."""
_FQNS_PARAMETERS = ["model", "name", "dsd_fqn_modifiers", "skip_ddp_prefix", "skip_compiler_prefix"]
_FSDP_METHODS = ("fsdp_modules", "state_dict_type", "optim_state_dict", "optim_state_dict_to_load")


@dataclass(frozen=True)
class _TorchOriginals:
    """What the replaced names were: the look-ups delegate to them for torch's own units."""

    fsdp: type
    get_fqns: Callable[..., set[str]] | None
    fsdp_state: Callable[[nn.Module], Any] | None
    refusal: str | None
    """Why fullshard models cannot use this torch's functions (None: they can)."""


_ORIGINALS: list[_TorchOriginals] = []
"""The one set of originals, filled by ``_install`` (a list: the module rebinds no global)."""


def _originals() -> _TorchOriginals:
    assert _ORIGINALS, "fullshard's look-ups run before they were installed"
    return _ORIGINALS[0]


def _fullshard_units(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
    return [u.fsdp_module for u in units_in(module, root_only) if u.settings.sharding.mesh is None]


def _is_fullshard_unit(module: object) -> TypeGuard[nn.Module]:
    """An FSDP1 unit. ``fully_shard`` 's are not: torch's functions handle DTensor parameters
    natively, as they handle torch's own FSDP2 modules (which are no ``FSDP`` either)."""
    if not isinstance(module, nn.Module):
        return False
    unit = unit_of(module)
    return unit is not None and unit.settings.sharding.mesh is None


# -- FSDP ------------------------------------------------------------------------------------


class _AnyFSDPMeta(type):
    """``isinstance(x, FSDP)`` and ``FSDP.<attribute>`` in torch's module."""

    def __instancecheck__(cls, instance: Any) -> bool:
        return isinstance(instance, _originals().fsdp) or _is_fullshard_unit(instance)

    def __getattr__(cls, name: str) -> Any:
        return getattr(_originals().fsdp, name)


class _AnyFSDP(metaclass=_AnyFSDPMeta):
    """Stands for torch's ``FullyShardedDataParallel`` in torch's state-dict module (see
    [Note: torch's state-dict functions see fullshard's units])."""

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[nn.Module]:
        ours = _fullshard_units(module, root_only)
        torch_fsdp: Any = _originals().fsdp
        theirs = list(torch_fsdp.fsdp_modules(module, root_only))
        if ours and _originals().refusal:
            raise NotImplementedError(_originals().refusal)
        if ours and theirs:
            raise ValueError(
                f"{type(module).__name__} holds both fullshard and torch FSDP units; torch's "
                "checkpoint functions handle one kind per model. Wrap it with one library"
            )
        return ours or theirs

    @staticmethod
    def state_dict_type(
        module: nn.Module,
        state_dict_type: Any,
        state_dict_config: Any = None,
        optim_state_dict_config: Any = None,
    ) -> AbstractContextManager[None]:
        if not _fullshard_units(module):
            torch_fsdp: Any = _originals().fsdp
            return torch_fsdp.state_dict_type(
                module, state_dict_type, state_dict_config, optim_state_dict_config
            )
        return state_dict_type_of_units(
            module,
            api.StateDictType[state_dict_type.name],
            _fullshard_config(state_dict_config),
            _fullshard_config(optim_state_dict_config),
        )

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: Any = None,
    ) -> dict[str, Any]:
        if not _fullshard_units(model):
            torch_fsdp: Any = _originals().fsdp
            return dict(torch_fsdp.optim_state_dict(model, optim, optim_state_dict, group=group))
        return _optim_sd.optim_state_dict(
            model, optim, optim_state_dict, group=_fullshard_group(model, group)
        )

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: Any = None,
    ) -> dict[str, Any]:
        if not _fullshard_units(model):
            torch_fsdp: Any = _originals().fsdp
            return dict(
                torch_fsdp.optim_state_dict_to_load(
                    model, optim, optim_state_dict, is_named_optimizer, load_directly, group
                )
            )
        group = _fullshard_group(model, group)
        _check_same_sharded_states(optim_state_dict, group)
        return _optim_load.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group=group
        )


def _fullshard_config(config: Any) -> Any:
    """torch's state dict config as fullshard's class of the same name and fields."""
    if config is None:
        return None
    cls = getattr(api, type(config).__name__, None)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(
            f"torch's checkpoint functions passed a {type(config).__name__}, which fullshard "
            "has no counterpart of; use fullshard.checkpoint.save/load instead"
        )
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(cls) if f.init}
    return cls(**fields)


def _check_same_sharded_states(optim_state_dict: dict[str, Any], group: Any) -> None:
    """Every rank must be given the same DTensor states: fullshard gathers them one at a time,
    collectively. torch's ``flatten_optimizer_state_dict=True`` keeps, on each rank, only the
    states its optimizer already holds: none, once it has stepped, for a ``use_orig_params``
    parameter the rank holds no piece of, while the other ranks keep theirs."""
    mine = sorted(
        f"{fqn}.{key}"
        for fqn, states in optim_state_dict.get("state", {}).items()
        for key, value in states.items()
        if isinstance(value, DTensor)
    )
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size(group)
    with comm.named("the exchange of the optimizer state dict's sharded entries", group):
        dist.all_gather_object(everyone, mine, group=group)
    seen = [set(entries) for entries in everyone]
    differing = sorted(set.union(*seen) - set.intersection(*seen))
    if differing:
        raise ValueError(
            "set_optimizer_state_dict/set_state_dict: the ranks were given different sharded "
            f"optimizer states ({', '.join(differing[:4])}{' ...' if len(differing) > 4 else ''} "
            "on some ranks only), so fullshard cannot gather them. torch's "
            "StateDictOptions(flatten_optimizer_state_dict=True) drops the states an optimizer "
            "that has already stepped holds none of; load with flatten_optimizer_state_dict="
            "False (the default), or with fullshard.checkpoint.load"
        )


def _fullshard_group(model: nn.Module, group: Any) -> Any:
    """torch passes the first unit's ``process_group``: the shard group, which for hybrid
    strategies is not every rank; fullshard's default (None, the whole world) is right there."""
    for unit in units_in(model):
        if unit.settings.sharding.hybrid:
            return None
    return group


# -- _get_fqns -------------------------------------------------------------------------------


def _transparent_child(module: nn.Module) -> nn.Module | None:
    """The child a wrapper's keys leave out: a unit's wrapped module, a checkpoint wrapper's."""
    name = FSDP_WRAPPED_MODULE if _is_fullshard_unit(module) else CHECKPOINT_WRAPPED_MODULE
    return module._modules.get(name)


def _is_compiled(module: nn.Module) -> bool:
    """``torch.compile``'s wrapper (no compiled module exists before dynamo is imported)."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(module, eval_frame.OptimizedModule)


def _flat_param_fqns(module: nn.Module, flat_param: FlatParameter) -> list[str]:
    """The FQNs (relative to ``module``, a unit's) of the original parameters in
    ``flat_param``."""
    unit = unit_of(module)
    assert unit is not None
    params, _ = _optim_sd._model_params(module, [unit])
    return list(params[id(flat_param)].fqns)


def _fqns(
    model: nn.Module,
    name: str,
    dsd_fqn_modifiers: str = "_fqn_modifiers",
    skip_ddp_prefix: bool = True,
    skip_compiler_prefix: bool = True,
) -> set[str]:
    """torch's ``_get_fqns`` for names that pass through a fullshard unit (see [Note: torch's
    state-dict functions see fullshard's units]). Below a unit, modules' ``_fqn_modifiers``
    (``dsd_fqn_modifiers``), which torch's version honours, are not consulted."""
    from torch.nn.parallel import DistributedDataParallel

    parts: list[str] = []
    module: nn.Module | None = model
    unit: nn.Module | None = None  # the innermost fullshard unit on the way
    tokens = name.split(".")
    for token in tokens:
        if module is None:  # past a parameter, buffer or extra state
            parts.append(token)
            continue
        while token not in module._modules and (child := _transparent_child(module)) is not None:
            unit = module if _is_fullshard_unit(module) else unit
            module = child
        if token in (FSDP_WRAPPED_MODULE, CHECKPOINT_WRAPPED_MODULE):
            unit = module if _is_fullshard_unit(module) else unit
            module = module._modules.get(token)
            continue
        compiled = token == "_orig_mod" and _is_compiled(module)
        if (token == "module" and isinstance(module, DistributedDataParallel)) or compiled:
            if not (skip_compiler_prefix if compiled else skip_ddp_prefix):
                parts.append(token)
            module = module._modules.get(token)
            continue
        param = module._parameters.get(token)
        if isinstance(param, FlatParameter) and unit is not None:
            prefix = "".join(part + "." for part in parts)
            return {prefix + fqn for fqn in _flat_param_fqns(unit, param)}
        parts.append(token)
        module = module._modules.get(token)
    if unit is None:
        get_fqns = _originals().get_fqns
        assert get_fqns is not None
        return set(get_fqns(model, name, dsd_fqn_modifiers, skip_ddp_prefix, skip_compiler_prefix))
    return {".".join(parts)}


def _fsdp_state(module: nn.Module) -> Any:
    """torch's ``_get_module_fsdp_state_if_fully_sharded_module``: a unit is its own state."""
    if _is_fullshard_unit(module):
        return module
    fsdp_state = _originals().fsdp_state
    assert fsdp_state is not None
    return fsdp_state(module)


# -- installing ------------------------------------------------------------------------------


def _incompatibility(module: ModuleType) -> str | None:
    """What in ``module`` differs from the torch 2.13 layout the look-ups replace, if any."""
    fsdp = getattr(module, "FSDP", None)
    if not isinstance(fsdp, type) or not all(hasattr(fsdp, m) for m in _FSDP_METHODS):
        return "it has no FSDP class with " + ", ".join(_FSDP_METHODS)
    get_fqns = getattr(module, "_get_fqns", None)
    if not callable(get_fqns):
        return "it has no _get_fqns"
    parameters = list(inspect.signature(get_fqns).parameters)
    if parameters != _FQNS_PARAMETERS:
        return f"its _get_fqns takes {parameters}, not {_FQNS_PARAMETERS}"
    if not callable(getattr(module, "_get_module_fsdp_state_if_fully_sharded_module", None)):
        return "it has no _get_module_fsdp_state_if_fully_sharded_module"
    return None


def _install(module: ModuleType) -> None:
    """Replace the three look-ups of torch's state-dict ``module`` (again after a reload)."""
    if vars(module).get("FSDP") is _AnyFSDP:
        return
    _ORIGINALS.clear()
    problem = _incompatibility(module)
    if problem is None:
        _ORIGINALS.append(
            _TorchOriginals(
                module.FSDP,
                module._get_fqns,
                module._get_module_fsdp_state_if_fully_sharded_module,
                None,
            )
        )
        vars(module).update(
            FSDP=_AnyFSDP,
            _get_fqns=_fqns,
            _get_module_fsdp_state_if_fully_sharded_module=_fsdp_state,
        )
        return
    refusal = (
        f"torch {torch.__version__}'s {TORCH_STATE_DICT} differs from what fullshard knows "
        f"({problem}), so its get_state_dict/set_state_dict and related functions cannot "
        "handle fullshard models. Use fullshard.checkpoint.save/load, or "
        "FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT) "
        "with model.state_dict() and FullyShardedDataParallel.optim_state_dict(model, optim)"
    )
    warnings.warn(refusal, stacklevel=2)
    fsdp = getattr(module, "FSDP", None)
    if isinstance(fsdp, type) and hasattr(fsdp, "fsdp_modules"):
        _ORIGINALS.append(_TorchOriginals(fsdp, None, None, refusal))
        vars(module)["FSDP"] = _AnyFSDP


class _InstallAfterExec(importlib.abc.Loader):
    """torch's own loader of its state-dict module, with ``_install`` run after it."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _install(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package...
        return getattr(self._loader, name)


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Finds torch's state-dict module with the other finders, once, and wraps its loader."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != TORCH_STATE_DICT:
            return None
        sys.meta_path.remove(self)  # the other finders find it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _InstallAfterExec(spec.loader)
        return spec


def install_when_imported() -> None:
    """Make torch's checkpoint state-dict functions handle fullshard models, now if torch's
    module is imported, else right after it is (see [Note: torch's state-dict functions see
    fullshard's units])."""
    module = sys.modules.get(TORCH_STATE_DICT)
    if module is not None:
        _install(module)
    elif not any(isinstance(finder, _InstallOnImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _InstallOnImport())
