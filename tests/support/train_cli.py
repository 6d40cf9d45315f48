"""``fullshard train`` as the CLI tests run it: ``python -m fullshard`` in the repository, the
tiny preset, 24 steps checkpointed every 4, and a run stopped by SIGTERM once a checkpoint is
complete."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["--preset", "tiny", "--batch-size", "4", "--seq-len", "32", "--sample-bytes", "16"]
STEPS = ["--steps", "24", "--checkpoint-every", "4", "--warmup-steps", "4"]


def run_cli(
    args: list[str], timeout: float = 300, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """``python -m fullshard ARGS``, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "fullshard", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, **kwargs,
    )  # type: ignore[call-overload]  # fmt: skip


def run_cli_each(
    argvs: list[list[str]], timeout: float = 120
) -> list[subprocess.CompletedProcess[str]]:
    """``run_cli`` of each of ``argvs``, as many at once as there are CPUs: the misuse tests'
    refusals each spend their seconds importing torch, one core each."""
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return list(pool.map(lambda args: run_cli(args, timeout=timeout), argvs))


def assert_same_curve(got: object, want: object) -> None:
    """Two runs' 24 losses, equal within 1e-5 relative."""
    assert isinstance(got, list) and isinstance(want, list) and len(got) == len(want) == 24
    for a, b in zip(got, want):
        assert abs(a - b) <= 1e-5 * abs(b), (got, want)


def stop_after_checkpoint(args: list[str], out: Path, min_step: int = 8) -> int:
    """Start ``fullshard train ARGS`` (a 24-step run into ``out``), SIGTERM it once a
    checkpoint of step ``min_step`` or later is complete; returns that checkpoint's step."""
    metadata = out / "checkpoint" / "fullshard.json"
    run = subprocess.Popen(
        [sys.executable, "-m", "fullshard", "train", *args],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and run.poll() is None:
        try:
            if json.loads(metadata.read_text())["extra"]["step"] >= min_step:
                break
        except (OSError, json.JSONDecodeError, KeyError):
            pass
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=60)
    assert run.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    step: int = json.loads(metadata.read_text())["extra"]["step"]
    assert min_step <= step < 24
    return step
