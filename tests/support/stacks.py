"""Running a training stack's own launcher on 2 CPU ranks, once on torch's FSDP and once on
fullshard's (``FULLSHARD_INSTALL=1``), and reading what each rank reported.

The stack scripts live in ``tests/stacks/scripts`` and write ``<out>/rank<r>.json`` through
its ``report.py``; ``tests/stacks/cpu_patches`` (on ``PYTHONPATH`` in both runs) holds the
stacks' CPU device selection, documented there.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

STACKS = Path(__file__).resolve().parent.parent / "stacks"
SCRIPTS = STACKS / "scripts"
CPU_PATCHES = STACKS / "cpu_patches"
BIN = Path(sys.executable).parent
WORLD_SIZE = 2


def launch(
    argv: list[str],
    out: Path,
    *,
    fullshard: bool,
    env: dict[str, str] | None = None,
    timeout: float = 600,
    cwd: Path | None = None,
) -> list[dict[str, Any]]:
    """Run ``argv`` (a launcher's command line) and return each rank's report, rank order.

    Fails with the output's tail if the command fails, times out, or a rank did not report.
    """
    environ = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(CPU_PATCHES), str(SCRIPTS), *filter(None, [os.environ.get("PYTHONPATH")])]
        ),
        "FULLSHARD_INSTALL": "1" if fullshard else "0",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1",
        **(env or {}),
    }
    environ.pop("CUDA_VISIBLE_DEVICES", None)
    try:
        done = subprocess.run(
            argv,
            env=environ,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as e:
        tail = (
            (e.stdout or b"")[-4000:] if isinstance(e.stdout, bytes) else (e.stdout or "")[-4000:]
        )
        raise AssertionError(f"{argv} timed out after {timeout} s:\n{tail}") from e
    text = done.stdout + done.stderr
    errors = "\n".join([line for line in text.splitlines() if "Error" in line][:12])
    output = f"{errors}\n...\n{text[-4000:]}"
    assert done.returncode == 0, f"{' '.join(argv)} failed ({done.returncode}):\n{output}"
    reports = [out / f"rank{rank}.json" for rank in range(WORLD_SIZE)]
    missing = [str(p) for p in reports if not p.exists()]
    assert not missing, f"ranks did not report ({missing}):\n{output}"
    return [json.loads(p.read_text()) for p in reports]


def check_served(reports: list[dict[str, Any]], *, fullshard: bool) -> None:
    """Every rank trained on 2 gloo ranks with FSDP units, all fullshard's or all torch's:
    a fall back to DDP or to single processes (no units, world size 1) fails, and so does a
    run under ``FULLSHARD_INSTALL=1`` whose units are torch's."""
    owner = "fullshard." if fullshard else "torch."
    for report in reports:
        assert report["world_size"] == WORLD_SIZE and report["backend"] == "gloo", report
        assert report["units"], f"rank {report['rank']} has no FSDP unit: {report}"
        foreign = [u for u in report["units"] if not u.startswith(owner)]
        assert not foreign, f"rank {report['rank']}: units not {owner}*: {foreign}"


def assert_losses_close(
    got: list[dict[str, Any]], want: list[dict[str, Any]], rtol: float, steps: slice = slice(None)
) -> None:
    """Per rank, ``got``'s losses equal ``want``'s (``steps`` of them) within ``rtol``."""
    for g, w in zip(got, want):
        expected = w["losses"][steps]
        assert len(g["losses"]) == len(expected), (g["losses"], expected)
        for step, (a, b) in enumerate(zip(g["losses"], expected)):
            assert math.isclose(a, b, rel_tol=rtol), (
                f"rank {g['rank']} step {step}: {a} != {b} (rtol {rtol}); "
                f"got {g['losses']}, want {expected}"
            )
