"""``fullshard train --api fsdp2 --compress-comm``: int8 weight all-gathers and bf16
gradient reductions (``fullshard.compress``), run as a user would (``python -m fullshard``,
2 gloo CPU ranks, the tiny preset)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from train_cli import STEPS, TINY, run_cli, run_cli_each, stop_after_checkpoint

FSDP2 = ["--api", "fsdp2", "--ranks", "2"]
COMPRESS = ["--compress-comm", "int8-weights,bf16-grads"]


_run = run_cli


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """report.json and stdout of one uninterrupted ``STEPS`` run with and one without
    compression."""
    runs = {}
    for name, options in (("compressed", COMPRESS), ("plain", [])):
        out = tmp_path_factory.mktemp(name)
        result = _run(["train", *TINY, *STEPS, *FSDP2, *options, "--out", str(out)])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = json.loads((out / "report.json").read_text())
        runs[name]["stdout"] = result.stdout
    return runs


def test_compressed_run_trains_as_the_uncompressed_one(
    uninterrupted: dict[str, dict[str, object]],
) -> None:
    """With int8 weights and bf16 gradients on the wire the 24 losses stay within 2% of the
    uncompressed run's (and differ from them: the compression runs), the held-out loss
    within 1%; the log and the report say what was compressed."""
    compressed, plain = uninterrupted["compressed"], uninterrupted["plain"]
    losses, plain_losses = compressed["losses"], plain["losses"]
    assert isinstance(losses, list) and isinstance(plain_losses, list) and len(losses) == 24
    assert losses == pytest.approx(plain_losses, rel=2e-2) and losses != plain_losses
    assert compressed["heldout_loss"] == pytest.approx(plain["heldout_loss"], rel=1e-2)
    assert compressed["config"]["compress_comm"] == ["int8-weights", "bf16-grads"]  # type: ignore[index]
    assert "compressed: int8-weights+bf16-grads" in str(compressed["sharding"])
    assert "compressed: int8-weights+bf16-grads" in str(compressed["stdout"])


def test_compressed_run_stopped_resumes_to_the_uninterrupted_curve(
    tmp_path: Path, uninterrupted: dict[str, dict[str, object]]
) -> None:
    """A compressed run stopped by SIGTERM after a checkpoint (the int8 weights saved as
    their full-precision values, plain tensors) resumes with --resume to the uninterrupted
    compressed run's 24 losses."""
    args = ["train", *TINY, *STEPS, *FSDP2, *COMPRESS, "--out", str(tmp_path)]
    saved_step = stop_after_checkpoint(args[1:], tmp_path)
    result = _run([*args, "--resume"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resumed_at"] == [saved_step]
    want = uninterrupted["compressed"]["losses"]
    assert report["losses"] == pytest.approx(want, rel=1e-5)


def test_compress_comm_misuse_is_refused_before_the_ranks_start() -> None:
    """--compress-comm without fsdp2, an unknown compression, or int8 weights with --tp:
    exit status 2, naming the fix."""
    cases = [
        (["--compress-comm", "bf16-grads"], "--compress-comm needs --api fsdp2"),
        (["--api", "fsdp2", "--compress-comm", "int4-weights"],
         "argument --compress-comm: unknown compression ['int4-weights']: choose a "
         "comma-separated subset of int8-weights, bf16-grads"),
        (["--api", "fsdp2", "--ranks", "4", "--tp", "2", "--compress-comm", "int8-weights"],
         "--compress-comm int8-weights with --tp or --cpu-offload is not supported"),
    ]  # fmt: skip
    results = run_cli_each([["train", *TINY, *args] for args, _ in cases])
    for (args, message), result in zip(cases, results):
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert f"fullshard train: error: {message}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr
