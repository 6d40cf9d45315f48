"""The FSDP1 front door's static methods over state dict types and optimizer state dicts:
each delegates to ``_features`` (torch's signatures on one side, the unit-taking functions on
the other). A mixin of ``FullyShardedDataParallel``, which users call them on."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._features import optim_state_dict as _optim_state_dict
from ._features import optim_state_dict_load as _optim_load
from ._features import state_dict_type as _state_dict_type
from ._features.optim_state_dict import OptimStateKeyType
from .api import OptimStateDictConfig, StateDictConfig, StateDictSettings, StateDictType

__all__: list[str] = []


def _warn_optim_input(optim_input: Any) -> None:
    """torch's deprecation warning for ``optim_input`` (its text); fullshard reads it only
    where no ``optim`` is given, to know which parameter each state belongs to."""
    if optim_input is not None:
        warnings.warn(
            "The `optim_input` argument is deprecated and will be removed after PyTorch 1.13. "
            "You may remove it from your code without changing its functionality.",
            FutureWarning,
            stacklevel=3,
        )


class StateDictMethods:
    """``FullyShardedDataParallel``'s state-dict-type and optimizer-state-dict methods."""

    @staticmethod
    def set_state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> StateDictSettings:
        """Set the state dict type of every FSDP unit in ``module``; returns the previous
        settings (those of the first unit)."""
        return _state_dict_type.set_state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        )

    @staticmethod
    def get_state_dict_type(module: nn.Module) -> StateDictSettings:
        """The state dict settings shared by every FSDP unit in ``module``."""
        return _state_dict_type.get_state_dict_type(module)

    @staticmethod
    @contextlib.contextmanager
    def state_dict_type(
        module: nn.Module,
        state_dict_type: StateDictType,
        state_dict_config: StateDictConfig | None = None,
        optim_state_dict_config: OptimStateDictConfig | None = None,
    ) -> Generator[None, None, None]:
        """Within the block, ``state_dict()`` / ``load_state_dict()`` (and the optimizer state
        dict functions) of every unit in ``module`` use ``state_dict_type``."""
        with _state_dict_type.state_dict_type(
            module, state_dict_type, state_dict_config, optim_state_dict_config
        ):
            yield

    # -- optimizer state dicts (see [Note: optimizer state keys]) --------------------------------

    @staticmethod
    def optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """``optim``'s state in ``model``'s state dict type: FULL (per original parameter,
        keyed by FQN, full tensors; ``rank0_only`` and ``offload_to_cpu`` from the optimizer
        config), SHARDED (the same keys, parameter-shaped states as dim-0 DTensors, for DCP)
        or LOCAL (``optim.state_dict()`` as is). ``optim_state_dict`` stands in for
        ``optim.state_dict()`` when given. Collective: call it on every rank."""
        return _optim_state_dict.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_state_dict: dict[str, Any],
        is_named_optimizer: bool = False,
        load_directly: bool = False,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """What ``optim.load_state_dict`` takes, from a dict ``optim_state_dict`` gave (in
        ``model``'s state dict type; with FULL ``rank0_only`` only rank 0 needs to pass it).
        ``load_directly`` also loads it. Collective: call it on every rank."""
        return _optim_load.optim_state_dict_to_load(
            model, optim, optim_state_dict, is_named_optimizer, load_directly, group
        )

    @staticmethod
    def full_optim_state_dict(
        model: nn.Module,
        optim: torch.optim.Optimizer,
        optim_input: Any = None,
        rank0_only: bool = True,
        group: dist.ProcessGroup | None = None,
    ) -> dict[str, Any]:
        """The full optimizer state dict (FQN-keyed, on the CPU), on rank 0 only unless
        ``rank0_only=False`` (the other ranks get ``{}``). Collective."""
        _warn_optim_input(optim_input)
        del optim_input  # the optimizer's own param groups say which parameter is which
        return _optim_state_dict.produce(
            model, optim, None, full=True, rank0_only=rank0_only, offload_to_cpu=True, group=group
        )

    @staticmethod
    def sharded_optim_state_dict(
        model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
    ) -> dict[str, Any]:
        """The FQN-keyed optimizer state dict with parameter-shaped states as dim-0 DTensors
        (for DCP; load with ``flatten_sharded_optim_state_dict``). Collective."""
        return _optim_state_dict.produce(
            model, optim, None, full=False, rank0_only=False, offload_to_cpu=True, group=group
        )

    @staticmethod
    def shard_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any],
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """This rank's loadable part of a full optimizer state dict every rank holds. The
        optimizer's parameters come from ``optim``, else ``optim_input``, else
        ``model.parameters()``."""
        _warn_optim_input(optim_input)
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_load.load(model, groups, full_optim_state_dict, rank0_only=False)

    @staticmethod
    def flatten_sharded_optim_state_dict(
        sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
    ) -> dict[str, Any]:
        """This rank's loadable part of a ``sharded_optim_state_dict`` (collective)."""
        groups = _optim_state_dict._param_groups(model, optim, None)
        return _optim_load.load(model, groups, sharded_optim_state_dict, rank0_only=False)

    @staticmethod
    def scatter_full_optim_state_dict(
        full_optim_state_dict: dict[str, Any] | None,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
        group: Any | None = None,
    ) -> dict[str, Any]:
        """Like ``shard_full_optim_state_dict``, with the full dict on rank 0 only (the others
        pass None): rank 0 broadcasts it one tensor at a time. Collective."""
        _warn_optim_input(optim_input)
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_load.load(model, groups, full_optim_state_dict, rank0_only=True, group=group)

    @staticmethod
    def rekey_optim_state_dict(
        optim_state_dict: dict[str, Any],
        optim_state_key_type: OptimStateKeyType,
        model: nn.Module,
        optim_input: Any = None,
        optim: torch.optim.Optimizer | None = None,
    ) -> dict[str, Any]:
        """``optim_state_dict`` keyed by parameter name (what FSDP's full dicts use) or by id
        (what an optimizer over an unwrapped model loads). Ids follow ``optim``'s param
        groups, else ``optim_input``, else ``model.parameters()``."""
        _warn_optim_input(optim_input)
        groups = _optim_state_dict._param_groups(model, optim, optim_input)
        return _optim_load.rekey(optim_state_dict, optim_state_key_type, model, groups)
