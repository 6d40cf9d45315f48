"""The environment switches fullshard reads: one typed, frozen object, read from the
environment once per model construction rather than on every call.

When read: ``reload()`` runs as each unit is built (`fullshard._engine.settings.resolve_settings`),
so a script that sets a variable before building its model sees it, as with torch's own
``FSDP_USE_FULL_PREC_IN_EVAL``; the unit keeps the object it read (its ``Settings.switches``),
and the transport reads the latest one (`current`). Code that runs collectives without
building a unit reads the environment at its first collective. `forget` drops what was read,
so that the next use reads again: the test harness calls it where it changes the environment
between tests that share one process.

Every value is checked where it is read: a bad one raises a ValueError naming the variable
and the values it may take.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

__all__: list[str] = []

DEFAULT_SHM_CELL_BYTES = 4 * 2**20
"""The shared-memory transport's cell when ``FULLSHARD_SHM_CELL_MIB`` is unset."""
_PAGE = 4096


@dataclass(frozen=True)
class Switches:
    collective_timeout: timedelta | None = None
    """``FULLSHARD_COLLECTIVE_TIMEOUT`` (seconds): a bound on each wait for a collective; None
    (unset) for the process group's own timeout."""
    debug_checks: bool = False
    """``FULLSHARD_DEBUG`` not 0, or ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: ranks compare each
    collective before issuing it (see [Note: mismatch detection] in _comm/collectives.py)."""
    gloo_rings: bool = True
    """``FULLSHARD_GLOO_RINGS`` not 0: gloo groups use fullshard's ring collectives."""
    shared_memory: bool = True
    """``FULLSHARD_SHM`` not 0: CPU ranks of one host use the shared-memory transport."""
    shm_cell_bytes: int = DEFAULT_SHM_CELL_BYTES
    """``FULLSHARD_SHM_CELL_MIB``: the transport's cell, in (0, 1024] MiB, rounded down to
    whole pages (at least one)."""
    reductions_in_flight: int | None = None
    """``FULLSHARD_REDUCTIONS_IN_FLIGHT``: overrides how many reduce-scatters may stay in
    flight in backward (see `_engine.runtime.reductions_in_flight`); None to derive it."""
    use_full_prec_in_eval: bool = False
    """torch's ``FSDP_USE_FULL_PREC_IN_EVAL=1``: eval computes in full precision."""
    use_unsafe_setattr: bool = False
    """torch's ``FSDP_USE_UNSAFE_SETATTR=1``: original parameters are set on modules without
    calling their ``__setattr__`` overrides."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Switches:
        reductions = environ.get("FULLSHARD_REDUCTIONS_IN_FLIGHT")
        return cls(
            collective_timeout=_timeout(environ.get("FULLSHARD_COLLECTIVE_TIMEOUT")),
            debug_checks=environ.get("FULLSHARD_DEBUG", "0") not in ("", "0")
            or environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL",
            gloo_rings=environ.get("FULLSHARD_GLOO_RINGS", "1") != "0",
            shared_memory=environ.get("FULLSHARD_SHM", "1") != "0",
            shm_cell_bytes=_cell_bytes(environ.get("FULLSHARD_SHM_CELL_MIB")),
            reductions_in_flight=None if reductions is None else _count(reductions),
            use_full_prec_in_eval=environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
            use_unsafe_setattr=environ.get("FSDP_USE_UNSAFE_SETATTR", "") == "1",
        )


_current: Switches | None = None


def current() -> Switches:
    """The switches last read (read now if none were)."""
    return _current if _current is not None else reload()


def reload() -> Switches:
    """Read the environment now; what `current` returns from here on."""
    global _current
    _current = Switches.from_environ()
    return _current


def forget() -> None:
    """Drop what was read: the next `current` reads the environment again."""
    global _current
    _current = None


def _timeout(value: str | None) -> timedelta | None:
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(
            f"FULLSHARD_COLLECTIVE_TIMEOUT={value!r} is not a number of seconds"
        ) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(
            f"FULLSHARD_COLLECTIVE_TIMEOUT must be a positive, finite number of seconds, got "
            f"{value}; unset it to use the process group's timeout"
        )
    return timedelta(seconds=seconds)


def _cell_bytes(value: str | None) -> int:
    if value is None:
        return DEFAULT_SHM_CELL_BYTES
    try:
        mib = float(value)
    except ValueError:
        raise ValueError(f"FULLSHARD_SHM_CELL_MIB={value!r} is not a number of MiB") from None
    if not 0 < mib <= 1024:
        raise ValueError(f"FULLSHARD_SHM_CELL_MIB must be in (0, 1024], got {value}")
    return max(_PAGE, int(mib * 2**20) // _PAGE * _PAGE)


def _count(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = -1
    if count < 0:
        raise ValueError(
            f"FULLSHARD_REDUCTIONS_IN_FLIGHT must be a whole number >= 0, got {value!r}"
        )
    return count
