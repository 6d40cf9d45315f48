"""Pytest hooks the test suite shares; keep this file small.

The folders mirror the package's layers (docs/architecture.md):

- ``unit/``: no process group (layout math, the memory model, wrap targets, the layer rules);
- ``comm/``: the transport (collectives, shared memory, mismatch detection, faults);
- ``engine/``: one training step on gloo ranks (parity with DDP, the schedule, precision,
  frozen parameters, construction, switches, misuse, CUDA);
- ``features/``: state dicts, optimizer state dicts, checkpoints, summon and generation;
- ``interop/``: torch's own tools on fullshard models (activation checkpointing, compile,
  behaviours torch's FSDP1 tests assert);
- ``seeds/``: the ports of ../shared/seeds (torch's FSDP test files);
- ``cli/``: the ``fullshard`` command, run as users run it;
- ``stacks/``: training stacks (accelerate, ...) run unmodified through their own launchers
  on torch's FSDP and on fullshard's (``FULLSHARD_INSTALL=1``), compared step by step;
- ``support/``: the multi-rank harness, shared models (`models.py`: models, strategy lists),
  the DDP parity routine, and the harness's own tests.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_SUPPORT = str(Path(__file__).resolve().parent / "support")
if _SUPPORT not in sys.path:
    sys.path.insert(0, _SUPPORT)

import harness  # noqa: E402 (needs the path above)

for _path in harness.TEST_PATHS:
    if _path not in sys.path:
        sys.path.append(_path)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the multi-rank worker pools when the session ends, not at interpreter exit."""
    harness.shutdown_pool()
