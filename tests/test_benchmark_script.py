"""benchmarks/step.py runs end to end on a tiny model (a smoke test: numbers are the
benchmark's business, not the test suite's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_step_benchmark_prints_table_and_writes_json(tmp_path: Path) -> None:
    """Two engines, one round: the table lists both, the losses match, the JSON has them."""
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        str(ROOT / "benchmarks" / "step.py"),
        "--config",
        "tiny",
        "--engines",
        "ddp,fullshard",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--json",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["ddp", "fullshard"]
    assert "WARNING" not in result.stdout  # fullshard's loss equals DDP's
    data = json.loads(out.read_text())
    engines = {entry["engine"]: entry for entry in data["results"]}
    assert set(engines) == {"ddp", "fullshard"}
    assert engines["fullshard"]["loss"] == engines["ddp"]["loss"]
    assert data["predicted_fullshard_peak_mib"] > 0
