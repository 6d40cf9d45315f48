"""Which state dict a model's units produce and load: FULL, SHARDED or LOCAL, with configs.

Every unit holds its own settings (``Unit.state_dict_type`` and its configs); these set and
read them for all units under a module at once, as ``FullyShardedDataParallel``'s static
methods (and torch's checkpoint API, through them) do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator

from torch import nn

from .._engine.unit import units_in
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
    from_torch,
)

__all__ = ["StateDictConfigError"]

_DEFAULT_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}


class StateDictConfigError(ValueError, RuntimeError):
    """A state-dict config of the wrong type for the state-dict type. torch raises
    RuntimeError; fullshard raised ValueError before, so it is both."""


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Set the state dict type of every unit in ``module``; returns the previous settings
    (torch's own types and configs are taken field for field: see ``api.from_torch``)."""
    state_dict_type = from_torch(state_dict_type)
    state_dict_config = from_torch(state_dict_config)
    optim_state_dict_config = from_torch(optim_state_dict_config)
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type must be a StateDictType, got {state_dict_type!r}")
    config_cls, optim_config_cls = _DEFAULT_CONFIGS[state_dict_type]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim_config = (
        optim_state_dict_config if optim_state_dict_config is not None else optim_config_cls()
    )
    if type(config) is not config_cls:
        raise StateDictConfigError(
            f"Expected state_dict_config of type {config_cls} but got {type(config)} for "
            f"{state_dict_type}"
        )
    if type(optim_config) is not optim_config_cls:
        raise StateDictConfigError(
            f"Expected optim_state_dict_config of type {optim_config_cls} but got "
            f"{type(optim_config)} for {state_dict_type}"
        )
    units = units_in(module)
    if not units:
        raise ValueError(
            f"set_state_dict_type: {type(module).__name__} contains no FSDP unit; pass the "
            "wrapped model"
        )
    previous = get_state_dict_type(module)
    for unit in units:
        unit.state_dict_type = state_dict_type
        unit.state_dict_config = config
        unit.optim_state_dict_config = optim_config
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The state dict settings shared by every unit in ``module``."""
    settings: StateDictSettings | None = None
    for unit in units_in(module):
        current = StateDictSettings(
            unit.state_dict_type, unit.state_dict_config, unit.optim_state_dict_config
        )
        if settings is None:
            settings = current
        elif settings != current:
            raise AssertionError(
                "All FSDP modules must have the same state_dict settings. Got "
                f"{settings} and {current}; set them with "
                "FullyShardedDataParallel.set_state_dict_type(model, ...)"
            )
    if settings is None:
        raise ValueError(f"{type(module).__name__} contains no FSDP unit")
    return settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Generator[None, None, None]:
    """Within the block, every unit in ``module`` uses ``state_dict_type``."""
    previous = set_state_dict_type(
        module, state_dict_type, state_dict_config, optim_state_dict_config
    )
    try:
        yield
    finally:
        set_state_dict_type(
            module,
            previous.state_dict_type,
            previous.state_dict_config,
            previous.optim_state_dict_config,
        )
