"""A unit: what the engine keeps for one module it shards, and the registry that finds it.

A front door attaches a unit to a module: FSDP1's ``FullyShardedDataParallel`` attaches one
to itself (the module it wraps is the unit's ``module``); FSDP2's ``fully_shard`` attaches
one to the module it is applied to. Everything below the front doors (the forward path,
state dicts, summon, clipping) finds units through ``unit_of`` / ``units_in``, never through
a front door's class. The registry holds units weakly, as FSDP2's ``_composable_state``
does: the module keeps its unit alive (FSDP1's wrapper holds it; hooks would for FSDP2).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    StateDictConfig,
    StateDictType,
)
from .flat_param import FlatParamHandle
from .runtime import UnitRuntime
from .settings import Settings

__all__: list[str] = []


class Unit:
    """One FSDP unit: its settings, its handle (None when it manages no parameter), its step
    state (``runtime``) and what the features read of it (state-dict type, buffers)."""

    def __init__(
        self,
        fsdp_module: nn.Module,
        module: nn.Module,
        settings: Settings,
        ignored_modules: set[nn.Module],
        ignored_params: set[nn.Parameter],
    ) -> None:
        self.fsdp_module = fsdp_module
        """The module the unit is attached to (the registry's key): FSDP1's wrapper, or the
        module ``fully_shard`` was applied to."""
        self.module = module
        """The module whose subtree's parameters the unit manages (FSDP1: the wrapped one)."""
        self.settings = settings
        self.upcasts_for_class = settings.mixed_precision is not None and isinstance(
            module, tuple(settings.mixed_precision._module_classes_to_ignore)
        )
        """The module's class is in ``MixedPrecision._module_classes_to_ignore``: it runs in
        full precision, with its floating-point inputs cast to float32 and outputs cast back."""
        self.mixed_precision: MixedPrecision | None = (
            None if self.upcasts_for_class else settings.mixed_precision
        )
        """The precision this unit computes in (None: the parameters' own dtype)."""
        self.ignored_modules = ignored_modules
        """Modules (whole subtrees) this unit leaves alone: unmanaged, unmoved, uncast."""
        self.ignored_params = ignored_params
        """Parameters this unit leaves alone (its own ignored states and nested units')."""
        self.compute_device = torch.device("cpu")
        """Where the unit computes (see [Note: devices] in ``init``); set at construction:
        moving the module later must match it."""
        self.handle: FlatParamHandle | None = None
        self.runtime = UnitRuntime(None, settings.sharding)
        self.managed_buffers: list[tuple[nn.Module, str, torch.dtype]] = []
        """Floating-point buffers of this unit (not of nested units) and their own dtypes;
        filled at lazy initialisation."""
        self.state_dict_type = StateDictType.FULL_STATE_DICT
        self.state_dict_config: StateDictConfig = FullStateDictConfig()
        self.optim_state_dict_config: OptimStateDictConfig = FullOptimStateDictConfig()
        self.superseded = False
        """Set when the module was wrapped again (FSDP1: the new wrapper drives the nested
        units now, so this one refuses to run)."""
        self.tag = ""
        """``fully_shard``: what sets the unit apart from the others of its call (a mesh, a
        dtype, all-gather extensions; see [Note: sibling units]), shown in its label."""
        self.siblings: list[Unit] = []
        """Units one ``fully_shard`` call built beside this one for the same modules, over
        other meshes or dtypes (see [Note: sibling units]); driven with it, never alone."""
        self.sibling_of: Unit | None = None
        """The unit attached to the modules, for a sibling (None for every other unit)."""

    def set_handle(self, handle: FlatParamHandle | None) -> None:
        """Give the unit its handle (once, at construction) and the runtime that drives it."""
        assert self.handle is None, "a unit's handle is set once"
        self.handle = handle
        self.runtime = UnitRuntime(handle, self.settings.sharding)

    @property
    def label(self) -> str:
        """The unit's name in messages: its path under the root, once known."""
        return self.handle.label if self.handle is not None else "(no params)"

    def managed_modules(self) -> list[nn.Module]:
        """The modules this unit manages: its module's subtree minus nested units' subtrees
        and ignored modules."""
        result: list[nn.Module] = []

        def visit(module: nn.Module) -> None:
            result.append(module)
            for child in module.children():
                if unit_of(child) in (None, self) and child not in self.ignored_modules:
                    visit(child)

        visit(self.module)
        return result

    def forces_full_precision(self) -> bool:
        """Eval in full precision despite mixed precision (FSDP_USE_FULL_PREC_IN_EVAL=1)."""
        return (
            self.mixed_precision is not None
            and self.settings.use_full_prec_in_eval
            and not self.module.training
        )


_UNITS: weakref.WeakKeyDictionary[nn.Module, weakref.ReferenceType[Unit]] = (
    weakref.WeakKeyDictionary()
)
"""Module -> its unit. Weak both ways: the entry dies with the module or the unit."""


# [Note: sibling units]
# torch's ``fully_shard`` lets ``shard_placement_fn`` put parameters of one call on other
# meshes (``ShardPlacementResult``: experts sharded over the expert-data-parallel mesh, the
# rest over the data-parallel mesh) and then keeps one parameter group per process group. A
# unit here shards over one mesh, in one dtype per flat segment, so such a call builds one
# unit per (mesh, dtype) group: the first is attached to the call's modules and the others
# are its ``siblings``. The front door drives them together (each forward unshards all of
# them, the backward reduces each over its own groups); ``units_in`` lists each sibling
# right after its unit, so lazy initialisation, state dicts, summon and clipping see them as
# units of their own. The same split lets one call mix parameter dtypes (bf16 weights with
# fp32 norms), which torch 2.13 refuses at the first forward.


def attach(unit: Unit, members: tuple[nn.Module, ...] = ()) -> None:
    """Register ``unit`` as the unit of ``unit.fsdp_module`` (which must keep it alive), and
    of ``members``: the other modules of a group ``fully_shard`` shards as one."""
    for module in (unit.fsdp_module, *members):
        if unit_of(module) is not None:
            raise ValueError(f"{type(module).__qualname__} already has an FSDP unit attached")
        _UNITS[module] = weakref.ref(unit)


def attach_sibling(unit: Unit, primary: Unit) -> None:
    """Register ``unit`` as a sibling of ``primary`` (see [Note: sibling units])."""
    assert primary.sibling_of is None and unit is not primary, "siblings hang off one unit"
    unit.sibling_of = primary
    primary.siblings.append(unit)


def unit_of(module: nn.Module) -> Unit | None:
    """The unit attached to ``module``, or None."""
    ref = _UNITS.get(module)
    return ref() if ref is not None else None


def units_in(module: nn.Module, root_only: bool = False) -> list[Unit]:
    """Every unit attached in ``module``'s subtree (itself included), in module order; or
    only those no other unit of the subtree contains."""
    units: list[Unit] = []
    for m in module.modules():  # a group's unit once, at its first module
        unit = unit_of(m)
        if unit is not None and all(unit is not seen for seen in units):
            units.append(unit)
            units.extend(unit.siblings)
    if not root_only:
        return units
    nested = {id(m) for unit in units for m in unit.module.modules() if m is not unit.fsdp_module}
    return [
        unit for unit in units if id(unit.fsdp_module) not in nested and unit.sibling_of is None
    ]


def handles_in(module: nn.Module) -> list[FlatParamHandle]:
    """The flat-parameter handles of every unit in ``module``, in module order."""
    return [unit.handle for unit in units_in(module) if unit.handle is not None]
