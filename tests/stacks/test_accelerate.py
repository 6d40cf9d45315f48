"""accelerate, unmodified, on fullshard: ``FULLSHARD_INSTALL=1 accelerate launch`` with the
same config and script as on torch's FSDP (issue 31).

Each case runs the script (``scripts/accelerate_train.py``) three times through
``accelerate launch --config_file``: on torch's FSDP, on fullshard's (saving the state after
step 3), and on fullshard's again resuming from that state in new processes. fullshard's
losses equal torch's, its resumed steps equal its uninterrupted ones, and its units are
fullshard's. The only patch is accelerate's CPU device selection (``cpu_patches``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from stacks import BIN, SCRIPTS, assert_losses_close, check_served, launch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")

_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_machines: 1
num_processes: 2
machine_rank: 0
mixed_precision: '{mixed_precision}'
use_cpu: false
fsdp_config:
{fsdp}
"""

_CASES = {
    # FSDP2, sharded checkpoints through DCP
    "fsdp2": (
        "no",
        {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_reshard_after_forward": "true",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        },
    ),
    # FSDP2 on a meta model filled from rank 0 (load_state_dict(assign=True) into sharded
    # modules), activation checkpointing, full state dict checkpoints
    "fsdp2_ram_efficient_ac": (
        "no",
        {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_reshard_after_forward": "true",
            "fsdp_cpu_ram_efficient_loading": "true",
            "fsdp_sync_module_states": "true",
            "fsdp_activation_checkpointing": "true",
            "fsdp_state_dict_type": "FULL_STATE_DICT",
        },
    ),
    # FSDP1 with bf16 mixed precision (flat parameters), sharded checkpoints
    "fsdp1_bf16": (
        "bf16",
        {
            "fsdp_version": 1,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
            "fsdp_sharding_strategy": "FULL_SHARD",
            "fsdp_use_orig_params": "false",
            # torch's FSDP1 refuses sync_module_states for a module on the CPU (so also
            # cpu_ram_efficient_loading, which needs it)
            "fsdp_sync_module_states": "false",
            "fsdp_cpu_ram_efficient_loading": "false",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        },
    ),
}


def _launch(config: Path, out: Path, fullshard: bool, *extra: str) -> list[dict]:
    argv = [
        str(BIN / "accelerate"),
        "launch",
        "--config_file",
        str(config),
        str(SCRIPTS / "accelerate_train.py"),
        "--out",
        str(out),
        *extra,
    ]
    return launch(argv, out, fullshard=fullshard)


@pytest.mark.parametrize("case", list(_CASES))
def test_accelerate_trains_and_resumes_on_fullshard_as_on_torch(case: str, tmp_path: Path) -> None:
    mixed_precision, fsdp = _CASES[case]
    config = tmp_path / "fsdp.yaml"
    fsdp_lines = "\n".join(f"  {key}: {value}" for key, value in fsdp.items())
    config.write_text(_CONFIG.format(mixed_precision=mixed_precision, fsdp=fsdp_lines))

    torch_run = _launch(config, tmp_path / "torch", False)
    check_served(torch_run, fullshard=False)
    with pytest.raises(AssertionError, match="units not fullshard"):
        check_served(torch_run, fullshard=True)  # a run on torch's FSDP is told apart
    ours = _launch(config, tmp_path / "fullshard", True, "--save", str(tmp_path / "ckpt"))
    check_served(ours, fullshard=True)
    assert_losses_close(ours, torch_run, rtol=1e-5)
    resumed = _launch(config, tmp_path / "resumed", True, "--resume", str(tmp_path / "ckpt"))
    check_served(resumed, fullshard=True)
    # a new model and optimizer loaded from the checkpoint continue as the uninterrupted run
    assert_losses_close(resumed, ours, rtol=1e-6, steps=slice(3, None))
