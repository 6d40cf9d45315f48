"""Fault injection: a rank dies (or stops) in forward, in backward's reduce-scatter, or in a
checkpoint save; the survivor must end with a clear `CollectiveError` naming what it was
doing, within the bound, not hang. Each rank is its own process (tests/support/fault_worker.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "fault_worker.py"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_scenario(scenario: str, workdir: Path, env: dict[str, str] | None = None) -> str:
    """The survivor's (rank 0's) last line of output; the faulty rank is then killed."""
    port = _free_port()
    ranks = []
    for rank in range(2):
        rank_env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            PYTHONPATH=str(REPO),
            **(env or {}),
        )
        ranks.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), scenario, str(workdir)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    try:
        out, err = ranks[0].communicate(timeout=180)  # the survivor
    except subprocess.TimeoutExpired:
        out, err = "", "rank 0 hung"
    for process in ranks[1:]:  # the faulty rank: dead already, or stuck on purpose
        process.kill()
        process.communicate()
    return out.strip().splitlines()[-1] if out.strip() else f"(no output) {err[-3000:]}"


TRANSPORTS = {"shared-memory": {}, "gloo": {"FULLSHARD_SHM": "0"}}


@pytest.mark.parametrize("transport", list(TRANSPORTS))
@pytest.mark.parametrize(
    ("scenario", "expected"),
    [
        ("forward", "all-gather of module 1 on rank 0 failed: rank 1 is gone (its process died"),
        ("backward", "reduce-scatter of module 2 on rank 0 failed: rank 1 is gone"),
        ("save", "checkpoint.save("),
        ("optim_state_dict", "the exchange of optimizer state metadata on rank 0 failed: rank 1"),
    ],
)
def test_survivor_fails_fast_naming_the_operation(
    scenario: str, expected: str, transport: str, tmp_path: Path
) -> None:
    """A rank that dies is noticed by the survivor at its next collective with that rank
    (gloo sees the closed connection; the shared-memory transport, the dead rank's released
    lock), and fullshard's error names the operation and unit."""
    survivor = _run_scenario(scenario, tmp_path, TRANSPORTS[transport])
    assert survivor.startswith("FAILED "), survivor
    seconds = float(survivor.split()[1])
    assert "CollectiveError" in survivor and expected in survivor, survivor
    assert seconds < 30, f"the survivor took {seconds} s to notice"
    print(f"{scenario}: survivor failed {seconds:.2f} s after the fault: {survivor}")


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_rank_that_stops_responding_is_reported_within_the_bound(
    transport: str, tmp_path: Path
) -> None:
    """A rank alive but stuck (it never reaches blocks.1's all-gather): with
    FULLSHARD_COLLECTIVE_TIMEOUT=3 the survivor raises after ~3 s, naming unit and rank."""
    start = time.monotonic()
    env = {"FULLSHARD_COLLECTIVE_TIMEOUT": "3", **TRANSPORTS[transport]}
    survivor = _run_scenario("hang", tmp_path, env)
    assert survivor.startswith("FAILED "), survivor
    seconds = float(survivor.split()[1])
    assert (
        "all-gather of module 1 on rank 0 did not complete within 3 s: rank 1 is not responding"
        in survivor
    )
    assert 2.5 <= seconds < 15, seconds
    print(f"hang: survivor failed {seconds:.2f} s after the fault: {survivor}")
    assert time.monotonic() - start < 120
