"""Walking a model's FSDP units and their handles, and the names wrapping gives them."""

from __future__ import annotations

from torch import nn

from .flat_param import FlatParamHandle

__all__: list[str] = []

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
FROZEN_FLAT_PARAM = "_frozen_flat_param"
FLAT_PARAM_NAMES = (FLAT_PARAM, FROZEN_FLAT_PARAM)
"""What a unit's flat parameters are registered as (use_orig_params=False) and keyed by in
LOCAL state dicts, by segment: a unit mixing frozen and trainable parameters has a second,
frozen one (see [Note: frozen parameters] in flat_param.py)."""


def clean_fqn(name: str) -> str:
    """A name without the wrapper prefixes: what the unwrapped model calls it."""
    return name.replace(FSDP_PREFIX, "")


def _get_fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
    """The flat-parameter handles of every FSDP unit in ``module``, in module order."""
    from .fully_sharded_data_parallel import FullyShardedDataParallel

    return [
        unit._handle
        for unit in FullyShardedDataParallel.fsdp_modules(module)
        if unit._handle is not None
    ]
