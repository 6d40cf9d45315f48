"""``fullshard train --api fsdp2 --tp T``: each block split over T tensor-parallel ranks
(``parallelize_module``), then ``fully_shard`` over the data-parallel dim of a 2-D (dp, tp)
mesh, run as a user would (``python -m fullshard``, gloo CPU ranks, the tiny preset)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from train_cli import (
    STEPS,
    TINY,
    assert_same_curve,
    run_cli,
    run_cli_each,
    stop_after_checkpoint,
)

CLIP = ["--grad-clip", "0.05"]
"""Small enough to clip at every step: the two meshes' norm (`_clip_across_meshes`) counts."""
TP2 = ["--api", "fsdp2", "--ranks", "4", "--tp", "2"]
"""4 ranks as (dp 2, tp 2): the same data-parallel rows as `TP1`'s 2 ranks."""
TP1 = ["--api", "fsdp2", "--ranks", "2"]


_run = run_cli


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """report.json and stdout of one uninterrupted ``STEPS`` run with --tp 2 on 4 ranks and
    one with --tp 1 on 2 ranks (FULL_SHARD, fp32)."""
    runs = {}
    for name, options in (("tp2", TP2), ("tp1", TP1)):
        out = tmp_path_factory.mktemp(name)
        result = _run(["train", *TINY, *STEPS, *CLIP, *options, "--out", str(out)], timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        runs[name] = json.loads((out / "report.json").read_text())
        runs[name]["stdout"] = result.stdout
    return runs


def test_train_tp2_gives_the_losses_of_tp1_on_as_many_data_parallel_rows(
    uninterrupted: dict[str, dict[str, object]],
) -> None:
    """World 4 with --tp 2 (dp 2) trains the 24 losses and the held-out loss of world 2 with
    --tp 1 (dp 2) within 1e-5 relative: the tp ranks of a row read that row's batches, and
    the clipping norm over both meshes is the model's; the log and the report state the tp
    degree, and a step's tokens count each row once."""
    tp2, tp1 = uninterrupted["tp2"], uninterrupted["tp1"]
    assert_same_curve(tp2["losses"], tp1["losses"])
    assert tp2["heldout_loss"] == pytest.approx(tp1["heldout_loss"], rel=1e-5)
    assert (tp2["tp"], tp2["dp"], tp2["world_size"]) == (2, 2, 4)
    assert (tp1["tp"], tp1["dp"], tp1["world_size"]) == (1, 2, 2)
    assert tp2["config"]["tp"] == 2  # type: ignore[index]
    sharding = (
        "FULL_SHARD as fully_shard(reshard_after_forward=True) on the dp dim of a 2-D (dp, tp) "
        "mesh, after parallelize_module over tp 2"
    )
    assert tp2["sharding"] == sharding
    assert f"4 ranks (dp 2 x tp 2), {sharding}" in str(tp2["stdout"])
    assert tp2["tokens_per_step"] == tp1["tokens_per_step"] == 4 * 32 * 2
    assert tp2["params"] == tp1["params"]  # the plain model's


def test_train_tp_stopped_run_resumes_to_the_uninterrupted_curve(
    tmp_path: Path, uninterrupted: dict[str, dict[str, object]]
) -> None:
    """A --tp 2 run stopped by SIGTERM after a checkpoint (DCP, parameters and Adam's state
    as DTensors on the (dp, tp) mesh and on its dp dim), resumed with --resume, ends with the
    uninterrupted run's 24 losses; resumed instead with --tp 1 on 2 ranks (resharded by DCP)
    it ends with those of the uninterrupted --tp 1 run, and its report and chart cover both
    world sizes."""
    out = tmp_path / "stopped"
    saved_step = stop_after_checkpoint([*TINY, *STEPS, *CLIP, *TP2, "--out", str(out)], out)
    saved = json.loads((out / "checkpoint" / "fullshard.json").read_text())
    assert saved["api"] == "fully_shard"
    shutil.copytree(out, tmp_path / "as_tp1")
    for folder, options, tp in ((out, TP2, 2), (tmp_path / "as_tp1", TP1, 1)):
        args = [*TINY, *STEPS, *CLIP, *options, "--resume", "--out", str(folder)]
        result = _run(["train", *args])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        report = json.loads((folder / "report.json").read_text())
        assert report["resumed_at"] == [saved_step] and report["tp"] == tp
        assert_same_curve(report["losses"], uninterrupted[f"tp{tp}"]["losses"])


def test_train_tp_misuse_is_refused_before_the_ranks_start() -> None:
    """--tp without fsdp2, one that does not divide the heads or the ranks, with
    HYBRID_SHARD or an int --reshard-after-forward: exit status 2, naming the fix."""
    cases = [
        (["--tp", "2"], "--tp 2 composes tensor parallelism with fully_shard: add --api fsdp2"),
        (["--api", "fsdp2", "--ranks", "3", "--tp", "3"],
         "--tp 3 does not divide the model's 4 attention heads (tiny): pick a --tp that "
         "divides them"),
        (["--api", "fsdp2", "--ranks", "3", "--tp", "2"],
         "--tp 2 must divide the 3 ranks (--ranks 3): each data-parallel rank is --tp ranks"),
        (["--api", "fsdp2", "--tp", "0"], "--tp must be positive, got 0"),
        (["--api", "fsdp2", "--ranks", "4", "--tp", "2", "--strategy", "HYBRID_SHARD"],
         "--tp 2 with --sharding-strategy HYBRID_SHARD would need a 3-D (replicate, shard, tp) "
         "mesh"),
        (["--api", "fsdp2", "--ranks", "4", "--tp", "2", "--reshard-after-forward", "2"],
         "--reshard-after-forward 2 with --tp 2: fully_shard cannot keep tensor-parallel "
         "parameters sharded over fewer ranks"),
    ]  # fmt: skip
    results = run_cli_each([["train", *TINY, *args] for args, _ in cases])
    for (args, message), result in zip(cases, results):
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert f"fullshard train: error: {message}" in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


def test_train_refuses_to_resume_a_checkpoint_of_the_fused_qkv_gpt(tmp_path: Path) -> None:
    """A checkpoint written before the example GPT split ``attn.qkv`` into q, k and v (its
    metadata names ``attn.qkv`` keys: here a fresh checkpoint's metadata renamed so) is
    refused before any rank starts, saying why and what to do, instead of failing in the
    ranks with a key mismatch."""
    out = tmp_path / "fused"
    args = [*TINY, "--steps", "2", "--checkpoint-every", "2", "--out", str(out)]
    first = _run(["train", *args])
    assert first.returncode == 0, first.stderr[-3000:]
    metadata_file = out / "checkpoint" / "fullshard.json"
    metadata = json.loads(metadata_file.read_text())
    model = metadata["model"]
    for key in [k for k in model if ".attn.q." in k]:
        model[key.replace(".attn.q.", ".attn.qkv.")] = model.pop(key)
    metadata_file.write_text(json.dumps(metadata))
    result = _run(["train", *args, "--steps", "4", "--resume"], timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "holds the example GPT's fused attention projection (attn.qkv)" in result.stderr
    assert "start afresh (--overwrite or another --out)" in result.stderr
    assert "Traceback" not in result.stderr
