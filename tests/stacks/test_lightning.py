"""Lightning, unmodified, on fullshard: Fabric and the Trainer with ``FSDPStrategy``
(FSDP1) and with ``ModelParallelStrategy`` whose parallelize function / ``configure_model``
calls ``fully_shard``, on 2 CPU processes Lightning launches itself, plus
``FULLSHARD_INSTALL=1`` (issue 31).

Each run saves after step 3 through Lightning's checkpointing (sharded) and resumes from it
in new processes; the resumed steps equal the uninterrupted ones. ``ModelParallelStrategy``
is compared with the same run on torch's FSDP2. torch's FSDP1 cannot run ``FSDPStrategy``
on a CPU ("FSDP needs a non-CPU accelerator device": Lightning passes ``device_id=None``
for CPU modules), so that strategy is compared with Lightning's DDP, which must agree to
fp32 rounding. The only patch is Lightning's GPU-only check of ``FSDPStrategy``
(``cpu_patches``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from stacks import SCRIPTS, assert_losses_close, check_served, launch

pytest.importorskip("lightning")
pytest.importorskip("transformers")


def _launch(out: Path, fullshard: bool, api: str, strategy: str, *extra: str) -> list:
    argv = [
        sys.executable,
        str(SCRIPTS / "lightning_train.py"),
        "--api",
        api,
        "--strategy",
        strategy,
        "--out",
        str(out),
        *extra,
    ]
    return launch(argv, out, fullshard=fullshard)


@pytest.mark.parametrize("api", ["fabric", "trainer"])
@pytest.mark.parametrize("strategy", ["fsdp", "model_parallel"])
def test_lightning_trains_and_resumes_on_fullshard(api: str, strategy: str, tmp_path: Path) -> None:
    if strategy == "fsdp":
        reference = _launch(tmp_path / "ddp", False, api, "ddp")
        with pytest.raises(AssertionError, match="has no FSDP unit"):
            check_served(reference, fullshard=True)  # a fall back to DDP is told apart
    else:
        reference = _launch(tmp_path / "torch", False, api, strategy)
        check_served(reference, fullshard=False)
    checkpoint = tmp_path / "ckpt" / "step3.ckpt"
    checkpoint.parent.mkdir()
    ours = _launch(tmp_path / "ours", True, api, strategy, "--save", str(checkpoint))
    check_served(ours, fullshard=True)
    assert_losses_close(ours, reference, rtol=1e-5)
    resumed = _launch(tmp_path / "resumed", True, api, strategy, "--resume", str(checkpoint))
    check_served(resumed, fullshard=True)
    assert_losses_close(resumed, ours, rtol=1e-6, steps=slice(3, None))
