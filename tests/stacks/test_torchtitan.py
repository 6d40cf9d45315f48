"""torchtitan's FSDP2 application on fullshard (issue 31): its llama3 debug model built as
its trainer builds it and parallelized by its own ``parallelize_llama``
(``apply_fsdp_to_decoder``), ``disable_fsdp_gradient_division`` (an ``isinstance`` gate on
torch's ``FSDPModule``), launched with ``torchrun`` plus ``FULLSHARD_INSTALL=1``, trains to
the losses of the same run on torch's FSDP2.

torchtitan's trainer does not run on a CPU (docs/ecosystem.md), and torchtitan is not one
of the test dependencies: its wheel pins ``datasets<4.8`` (TRL needs newer) and its imports
need triton (about 1 GB). The test skips, saying so, where it is not installed; the README
gives the command that installs it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from stacks import BIN, SCRIPTS, WORLD_SIZE, assert_losses_close, check_served, launch

pytest.importorskip(
    "torchtitan",
    reason="torchtitan is not installed (not a test dependency; README: Stacks, torchtitan)",
)


def _launch(out: Path, fullshard: bool) -> list:
    argv = [
        str(BIN / "torchrun"),
        "--nproc-per-node",
        str(WORLD_SIZE),
        str(SCRIPTS / "torchtitan_train.py"),
        "--out",
        str(out),
    ]
    return launch(argv, out, fullshard=fullshard)


def test_torchtitan_parallelize_trains_on_fullshard_as_on_torch(tmp_path: Path) -> None:
    theirs = _launch(tmp_path / "torch", False)
    check_served(theirs, fullshard=False)
    ours = _launch(tmp_path / "ours", True)
    check_served(ours, fullshard=True)
    assert_losses_close(ours, theirs, rtol=1e-5)
