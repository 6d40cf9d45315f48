"""The states of a unit's flat parameters (``FlatParamHandle.state``)."""

from __future__ import annotations

import enum

__all__ = ["HandleState"]


class HandleState(enum.Enum):
    """Where a unit's parameters are materialised."""

    SHARDED = enum.auto()
    """Only the local shard exists; `_full_param_padded` has no storage. It is the only
    contributor to this unit's parameter memory."""
    UNSHARDING = enum.auto()
    """An all-gather into `_full_param_padded` is in flight; wait before reading it."""
    UNSHARDED = enum.auto()
    """`_full_param_padded` holds every rank's shard; modules may use views of it."""
