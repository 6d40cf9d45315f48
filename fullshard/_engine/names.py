"""The names wrapping gives modules and flat parameters, and how keys leave them out."""

from __future__ import annotations

from torch import nn

__all__: list[str] = []

FSDP_WRAPPED_MODULE = "_fsdp_wrapped_module"
FSDP_PREFIX = FSDP_WRAPPED_MODULE + "."
FLAT_PARAM = "_flat_param"
CHECKPOINT_WRAPPED_MODULE = "_checkpoint_wrapped_module"
"""The child an activation-checkpointing wrapper (torch's ``checkpoint_wrapper``) holds its
module under; torch strips it from state-dict keys, so fullshard does too."""
CHECKPOINT_PREFIX = CHECKPOINT_WRAPPED_MODULE + "."
FROZEN_FLAT_PARAM = "_frozen_flat_param"
FLAT_PARAM_NAMES = (FLAT_PARAM, FROZEN_FLAT_PARAM)
"""What a unit's flat parameters are registered as (use_orig_params=False) and keyed by in
LOCAL state dicts, by segment: a unit mixing frozen and trainable parameters has a second,
frozen one (see [Note: frozen parameters] in flat_param.py)."""


# [Note: the marks torch leaves on managed modules and flat parameters]
# torch sets `_is_fsdp_managed_module` and `_fsdp_use_orig_params` on every module FSDP
# manages (both APIs), and `_fsdp_flattened` on its flat parameters. Stacks read them:
# transformers' `generate` turns on `synced_gpus` where a model is FSDP-managed (without it,
# ranks that stop at different lengths hang), Lightning and torch's own init skip flattened
# parameters, and dynamo treats managed modules as unspecialized (their parameters are graph
# inputs, so views re-created each forward are not baked into the graph). fullshard's units
# set them too. `_fsdp_use_orig_params` is True on fullshard's units with either setting:
# its only reader is dynamo, where False refuses to compile a module (torch's FSDP1 cannot
# be traced with flat parameters registered); fullshard's wrapper runs eagerly around the
# compiled module with either setting (see [Note: torch.compile runs the wrapper eagerly]).
MANAGED_MODULE_MARKS = {"_is_fsdp_managed_module": True, "_fsdp_use_orig_params": True}
FSDP_FLATTENED = "_fsdp_flattened"


def mark_managed(modules: list[nn.Module]) -> None:
    """Leave torch's marks on the modules a unit manages (see the note above)."""
    for module in modules:
        for name, value in MANAGED_MODULE_MARKS.items():
            setattr(module, name, value)


def clean_fqn(name: str) -> str:
    """A name without the wrapper prefixes (FSDP's and activation checkpointing's): what the
    unwrapped, un-checkpointed model calls it."""
    return name.replace(FSDP_PREFIX, "").replace(CHECKPOINT_PREFIX, "")


def flat_param_owner(wrapped: nn.Module) -> nn.Module:
    """The module a unit's flat parameter is registered on: the wrapped module, or below
    activation checkpointing's wrappers the module they wrap. Never a wrapper itself: its load
    pre-hook moves every key under it down a level, a placeholder for a parameter of its own
    included (see [Note: state dict keys] in ``_features/state_dict``)."""
    while isinstance(wrapped._modules.get(CHECKPOINT_WRAPPED_MODULE), nn.Module):
        wrapped = wrapped._modules[CHECKPOINT_WRAPPED_MODULE]  # type: ignore[assignment]
    return wrapped
