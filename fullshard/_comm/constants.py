"""Sizes the shared-memory transport uses and the memory model counts (``fullshard.memory``
imports them from here, so the transport depends on nothing above it)."""

from __future__ import annotations

from .._switches import DEFAULT_SHM_CELL_BYTES

SHARED_MEMORY_SLOTS = 4
"""The shared-memory transport's slots per rank (each holds one piece in flight)."""
SHARED_MEMORY_CELL_BYTES = DEFAULT_SHM_CELL_BYTES
"""The transport's default cell (``FULLSHARD_SHM_CELL_MIB`` unset)."""
