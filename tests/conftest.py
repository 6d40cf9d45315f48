"""Pytest hooks the test suite shares; keep this file small."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Test modules and helpers import each other by plain name (``from harness import ...``),
# whatever pytest's import mode; the harness workers add the same folder to sys.path.
_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import harness  # noqa: E402 (needs the path above)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Stop the multi-rank worker pool when the session ends, not at interpreter exit."""
    harness.shutdown_pool()
