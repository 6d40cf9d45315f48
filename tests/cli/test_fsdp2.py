"""``--api fsdp2`` of ``fullshard train`` and ``fullshard plan``: the model sharded with
``fully_shard`` (each block, then the root) instead of ``FullyShardedDataParallel``, run as
a user would (``python -m fullshard``, 2 CPU ranks, the tiny preset)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from train_cli import (
    STEPS,
    TINY,
    assert_same_curve,
    run_cli,
    run_cli_each,
    stop_after_checkpoint,
)

from fullshard.cli.plan import PRESETS, fsdp2_strategy, make_plan

_run = run_cli


def _train(out: Path, *args: str, **kwargs: object) -> dict[str, object]:
    """Train ``TINY`` with ``args`` into ``out``; returns report.json."""
    result = _run(["train", *TINY, *args, "--out", str(out)], **kwargs)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report: dict[str, object] = json.loads((out / "report.json").read_text())
    return report


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    """The reports of one uninterrupted ``STEPS`` run per API (FULL_SHARD, fp32)."""
    return {
        api: _train(tmp_path_factory.mktemp(api), *STEPS, "--api", api)
        for api in ("fsdp1", "fsdp2")
    }


def test_train_fsdp2_gives_the_fsdp1_losses_full_shard_fp32(
    uninterrupted: dict[str, dict[str, object]],
) -> None:
    """FULL_SHARD in fp32 through ``fully_shard``: the 24 losses equal FullyShardedDataParallel's
    within 1e-5 relative (same seed and batches; only gradient clipping's norm is summed in
    another order), and the report records the API and how it sharded."""
    fsdp1, fsdp2 = uninterrupted["fsdp1"], uninterrupted["fsdp2"]
    assert_same_curve(fsdp2["losses"], fsdp1["losses"])
    assert fsdp2["api"] == "fsdp2" and fsdp1["api"] == "fsdp1"
    assert fsdp2["sharding"] == (
        "FULL_SHARD as fully_shard(reshard_after_forward=True) on a 1-D mesh"
    )
    assert fsdp2["params"] == fsdp1["params"]  # the plain model's, not rank 0's shards


@pytest.mark.parametrize("first_api", ["fsdp2", "fsdp1"])
def test_train_fsdp2_stopped_run_resumes_to_the_uninterrupted_curve(
    first_api: str, tmp_path: Path, uninterrupted: dict[str, dict[str, object]]
) -> None:
    """A run stopped by SIGTERM after a checkpoint, resumed with ``--api fsdp2 --resume``,
    ends with the uninterrupted run's 24 losses. fullshard.checkpoint saves either API's
    model under the same keys (the plain model's FQNs), so an fsdp1 run resumes under fsdp2
    as well."""
    out = tmp_path / "stopped"
    saved_step = stop_after_checkpoint([*TINY, *STEPS, "--api", first_api, "--out", str(out)], out)
    saved_api = json.loads((out / "checkpoint" / "fullshard.json").read_text())["api"]
    assert saved_api == {"fsdp1": "FullyShardedDataParallel", "fsdp2": "fully_shard"}[first_api]
    report = _train(out, *STEPS, "--api", "fsdp2", "--resume")
    assert report["resumed_at"] == [saved_step]
    assert_same_curve(report["losses"], uninterrupted[first_api]["losses"])


@pytest.mark.parametrize(
    ("options", "sharding"),
    [
        (["--strategy", "SHARD_GRAD_OP"], "fully_shard(reshard_after_forward=False) on a 1-D"),
        (
            ["--strategy", "HYBRID_SHARD", "--mixed-precision", "bf16", "--cpu-offload"],
            "fully_shard(reshard_after_forward=True) on a 2-D (replicate, shard) mesh",
        ),
    ],
    ids=["shard_grad_op", "hybrid_bf16_offload"],
)
def test_train_fsdp2_maps_the_fsdp_options(
    options: list[str], sharding: str, tmp_path: Path
) -> None:
    """The other strategies, bf16 (MixedPrecisionPolicy) and CPU offload (CPUOffloadPolicy)
    train under fully_shard, and the log and report say how the options were mapped."""
    args = ["--steps", "3", "--checkpoint-every", "0", "--api", "fsdp2", *options]
    result = _run(["train", *TINY, *args, "--out", str(tmp_path)])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"2 ranks, {options[1]} as {sharding}" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["api"] == "fsdp2" and sharding in report["sharding"]


def test_train_fsdp2_refuses_fsdp1_only_options() -> None:
    """NO_SHARD and --use-orig-params mean nothing to fully_shard: exit status 2 before any
    rank starts, naming the flag and what to use instead."""
    for args, message in [
        (["--strategy", "NO_SHARD"], "--sharding-strategy NO_SHARD has no --api fsdp2 equivalent"),
        (["--use-orig-params"], "--use-orig-params has no --api fsdp2 meaning"),
    ]:  # fmt: skip
        result = _run(["train", *TINY, "--api", "fsdp2", *args], timeout=120)
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert message in result.stderr and "use --api fsdp1" in result.stderr, result.stderr


def test_train_fsdp2_reshard_after_forward_to_k_ranks(tmp_path: Path) -> None:
    """``--reshard-after-forward 2`` on 4 ranks reaches fully_shard (the log and the report
    say so) and trains the losses of ``true``: between forward and backward each block is
    kept over 2 ranks, which changes what is gathered where, not the numbers."""
    runs = {}
    for k in ("2", "true"):
        out = tmp_path / k
        args = ["--ranks", "4", "--steps", "3", "--checkpoint-every", "0", "--api", "fsdp2",
                "--reshard-after-forward", k, "--out", str(out)]  # fmt: skip
        result = _run(["train", *TINY, *args], timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        sharding = f"FULL_SHARD as fully_shard(reshard_after_forward={k.title()}) on a 1-D mesh"
        assert f"4 ranks, {sharding}" in result.stdout, result.stdout[-3000:]
        runs[k] = json.loads((out / "report.json").read_text())
        assert runs[k]["sharding"] == sharding
    losses, want = runs["2"]["losses"], runs["true"]["losses"]
    assert len(losses) == len(want) == 3
    for a, b in zip(losses, want):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, want)


def test_train_reshard_after_forward_misuse_is_refused_before_the_ranks_start() -> None:
    """--reshard-after-forward with --api fsdp1, with SHARD_GRAD_OP (which already means
    false), or as an int that is not a factor of the ranks: exit status 2, naming the fix
    (the last in torch's words)."""
    cases = [
        (["--reshard-after-forward", "2"], "--reshard-after-forward is fully_shard's option: "
         "add --api fsdp2, or with --api fsdp1 use --sharding-strategy FULL_SHARD (true) or "
         "SHARD_GRAD_OP (false)"),
        (["--api", "fsdp2", "--strategy", "SHARD_GRAD_OP", "--reshard-after-forward", "2"],
         "--sharding-strategy SHARD_GRAD_OP already means --reshard-after-forward false: drop "
         "one"),
        (["--api", "fsdp2", "--reshard-after-forward", "3"], "--reshard-after-forward: If "
         "passing reshard_after_forward as an int, it should be a factor of 2, not 3 (the "
         "shard group's ranks)"),
        (["--api", "fsdp2", "--strategy", "HYBRID_SHARD", "--ranks", "4", "--nnodes", "1",
          "--reshard-after-forward", "3"], "it should be a factor of 4, not 3 (the shard "
         "group's ranks per node)"),
    ]  # fmt: skip
    results = run_cli_each([["train", *TINY, *args] for args, _ in cases])
    for (args, message), result in zip(cases, results):
        assert result.returncode == 2, (args, result.stderr[-2000:])
        assert message in result.stderr, result.stderr[-2000:]
        assert "Traceback" not in result.stderr


# -- plan -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reshard", "group", "strategy"),
    [
        ("true", None, "FULL_SHARD"),
        ("false", None, "SHARD_GRAD_OP"),
        ("true", 8, "HYBRID_SHARD"),
        ("false", 8, "_HYBRID_SHARD_ZERO2"),
    ],
)
def test_plan_fsdp2_gives_the_matching_fsdp1_strategys_numbers(
    reshard: str, group: int | None, strategy: str, tmp_path: Path
) -> None:
    """``--api fsdp2 --reshard-after-forward`` (and ``--shard-group-size``: a 2-D mesh) plans
    the memory and traffic of FULL_SHARD, SHARD_GRAD_OP or their hybrid forms, names the
    FSDP2 settings and says how FSDP2's memory was modelled."""
    assert fsdp2_strategy(reshard == "true", two_d_mesh=group is not None) == strategy
    grouping = [] if group is None else ["--shard-group-size", str(group)]
    args = ["plan", "--preset", "llama2-7b", "--world-size", "32", "--mixed-precision", "bf16",
            "--api", "fsdp2", "--reshard-after-forward", reshard, *grouping,
            "--json", str(tmp_path / "plan.json")]  # fmt: skip
    result = _run(args, timeout=60)
    assert result.returncode == 0, result.stderr
    reshard_after_forward = "True" if reshard == "true" else "False"
    mesh = "1-D mesh (32,)" if group is None else "2-D mesh (replicate 4, shard 8)"
    assert (
        f"fully_shard(reshard_after_forward={reshard_after_forward}) on a {mesh} (the "
        f"{strategy} memory model)" in result.stdout
    )
    assert "mp_policy=MixedPrecisionPolicy(param_dtype=bf16)" in result.stdout
    assert "notes:\n- fully_shard runs fullshard's FSDP1 engine" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    fsdp1 = make_plan(
        PRESETS["llama2-7b"], 32, strategy, shard_group_size=group, mixed_precision="bf16"
    )
    assert plan["api"] == "fsdp2" and plan["strategy"] == strategy
    assert plan["reshard_after_forward"] is (reshard == "true")
    for part in ("params", "grads", "optimizer", "unsharded", "activations"):
        assert plan["memory"][part] == getattr(fsdp1.memory, part), part
    assert plan["comm_bytes_per_step"] == fsdp1.comm_bytes_per_step


def test_plan_fsdp2_reshard_after_forward_to_k_ranks(tmp_path: Path) -> None:
    """``--reshard-after-forward K``: FULL_SHARD's memory plus each block kept over K ranks
    between forward and backward (and backward's gathers within them); 1 plans as false and
    the shard group's size as true, as fully_shard reads them; a K that does not divide the
    group is refused with torch's words."""
    base = ["plan", "--preset", "llama2-7b", "--world-size", "8", "--api", "fsdp2"]

    def planned(k: str) -> dict[str, Any]:
        out = tmp_path / f"plan-{k}.json"
        result = _run([*base, "--reshard-after-forward", k, "--json", str(out)], timeout=60)
        assert result.returncode == 0, result.stderr
        if k == "4":
            assert (
                "fully_shard(reshard_after_forward=4) on a 1-D mesh (8,) (the FULL_SHARD "
                "memory model, plus each unit's parameters sharded over 4 ranks from forward "
                "to backward)" in result.stdout
            ), result.stdout
        return dict(json.loads(out.read_text()))

    kept, full, none = planned("4"), planned("true"), planned("false")
    assert kept["reshard_after_forward"] == 4 and kept["strategy"] == "FULL_SHARD"
    shape = PRESETS["llama2-7b"]
    kept_bytes = shape.n_layers * -(-shape.unit_numel // 4) * 4  # fp32, a quarter of each block
    assert kept["memory"]["unsharded"] - full["memory"]["unsharded"] == kept_bytes
    assert kept["comm_bytes_per_step"] < full["comm_bytes_per_step"]
    assert planned("1")["memory"] == none["memory"] and planned("8")["memory"] == full["memory"]
    result = _run([*base, "--reshard-after-forward", "3"], timeout=60)
    assert result.returncode == 2
    assert (
        "If passing reshard_after_forward as an int, it should be a factor of 8, not 3"
        in result.stderr
    ), result.stderr


def test_plan_fsdp2_flags_are_refused_with_the_wrong_api() -> None:
    """--reshard-after-forward is fsdp2's, --strategy fsdp1's: each with the other API is an
    argparse error naming the flag to use."""
    for args, message in [
        (["--reshard-after-forward", "false"], "--reshard-after-forward is fully_shard's "
         "option: add --api fsdp2, or with --api fsdp1 use --strategy FULL_SHARD (true) or "
         "SHARD_GRAD_OP (false)"),
        (["--api", "fsdp2", "--strategy", "SHARD_GRAD_OP"], "--strategy SHARD_GRAD_OP is "
         "FullyShardedDataParallel's option; with --api fsdp2 use --reshard-after-forward"),
    ]:  # fmt: skip
        result = _run(["plan", "--preset", "tiny", *args], timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert f"fullshard plan: error: {message}" in result.stderr, result.stderr


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("tp", [2, 4])
def test_plan_tp_pieces_are_a_real_llamas_tensor_parallel_pieces(
    tp: int, tied: bool, tmp_path: Path
) -> None:
    """``--tp``'s per-rank block and root sizes are what torchtitan's plan leaves on each
    tensor-parallel rank of a real transformers Llama (q, k, v, gate, up split by output
    row, o and down by input column, the embedding by vocabulary row, an untied head by
    vocabulary row, norms whole), with grouped kv heads and a vocabulary ``tp`` does not
    divide."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from fullshard.cli.plan_shapes import shape_from_hf_config

    config = LlamaConfig(
        vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=tied,
    )  # fmt: skip
    config.to_json_file(tmp_path / "config.json")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    by_rows = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")
    by_columns = ("o_proj", "down_proj")

    def piece(name: str, param: torch.nn.Parameter) -> int:
        if any(part in name for part in by_rows):
            return -(-param.shape[0] // tp) * param[0].numel()  # ranks round rows up
        if any(part in name for part in by_columns):
            return param.shape[0] * (param.shape[1] // tp)
        return param.numel()  # norms

    block = sum(piece(n, p) for n, p in model.model.layers[0].named_parameters())
    root = sum(
        piece(n, p) for n, p in model.named_parameters(remove_duplicate=True) if ".layers." not in n
    )
    shape = shape_from_hf_config(tmp_path / "config.json")
    assert shape.unit_numel == sum(p.numel() for p in model.model.layers[0].parameters())
    assert shape.unit_numel_per_tp_rank(tp) == block
    assert shape.root_numel_per_tp_rank(tp) == root


def test_plan_tp_shards_each_piece_over_the_data_parallel_ranks(tmp_path: Path) -> None:
    """``--api fsdp2 --tp T`` on W ranks: the model state per rank is that of the
    tensor-parallel pieces sharded over W / T data-parallel ranks (so about 1 / W of the
    model), activations split T ways shrink, FSDP's traffic runs over W / T ranks and the
    tensor-parallel traffic is its own row; --tp 1 plans exactly as before; the report and
    JSON name the (dp, tp) mesh."""
    shape = PRESETS["llama2-7b"]
    base = ["plan", "--preset", "llama2-7b", "--world-size", "16", "--api", "fsdp2",
            "--mixed-precision", "bf16", "--batch", "2", "--seq-len", "2048"]  # fmt: skip
    result = _run([*base, "--tp", "4", "--json", str(tmp_path / "tp.json")], timeout=60)
    assert result.returncode == 0, result.stderr
    assert "on a sub-mesh of the 2-D mesh (dp 4, tp 4), after parallelize_module" in result.stdout
    assert "| sent per step, tensor parallel (ring estimate) |" in result.stdout
    _run([*base, "--json", str(tmp_path / "dp.json")], timeout=60)
    _run([*base, "--tp", "1", "--json", str(tmp_path / "tp1.json")], timeout=60)
    tp_plan, dp_plan, tp1 = (
        json.loads((tmp_path / f"{name}.json").read_text()) for name in ("tp", "dp", "tp1")
    )
    assert tp1 == dp_plan and dp_plan["tp"] == 1 and dp_plan["tp_comm_bytes_per_step"] == 0
    assert tp_plan["tp"] == 4
    params_per_rank = shape.n_layers * -(-shape.unit_numel_per_tp_rank(4) // 4) + -(
        -shape.root_numel_per_tp_rank(4) // 4
    )
    assert tp_plan["memory"]["params"] == pytest.approx(params_per_rank * 4, rel=1e-3)
    # vs 16-way FSDP: the same state within the replicated norms' share, less activation
    assert tp_plan["memory"]["params"] == pytest.approx(dp_plan["memory"]["params"], rel=1e-3)
    assert tp_plan["memory"]["activations"] < dp_plan["memory"]["activations"] / 2
    want = make_plan(
        shape, 4, "FULL_SHARD", mixed_precision="bf16", batch=2, seq_len=2048, api="fsdp2"
    )  # FSDP over the 4 data-parallel ranks of the pieces: its traffic is 4-way, not 16
    assert tp_plan["comm_bytes_per_step"] < want.comm_bytes_per_step
    # 8 collectives per block and 4 around embedding and head, each (tp-1)/tp of the tokens
    tokens = 2 * 2048
    assert tp_plan["tp_comm_bytes_per_step"] == int(
        (8 * shape.n_layers + 4) * tokens * shape.d_model * 2 * 3 / 4
    )


def test_plan_tp_misuse_is_refused() -> None:
    """--tp without fsdp2, one that does not divide the world or the heads: argparse
    errors naming what to change."""
    for args, message in [
        (["--tp", "2"], "--tp 2 composes tensor parallelism with fully_shard: add --api fsdp2"),
        (["--api", "fsdp2", "--world-size", "8", "--tp", "3"],
         "--world-size 8 must be a multiple of --tp 3"),
        (["--api", "fsdp2", "--world-size", "16", "--tp", "16"],
         "--tp 16 does not divide the model's 8 kv heads (llama2-70b)"),
        (["--api", "fsdp2", "--world-size", "8", "--tp", "0"], "--tp must be positive, got 0"),
    ]:  # fmt: skip
        result = _run(["plan", "--preset", "llama2-70b", *args], timeout=60)
        assert result.returncode == 2, (args, result.stderr)
        assert f"fullshard plan: error: {message}" in result.stderr, result.stderr
