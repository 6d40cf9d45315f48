"""fullshard's environment switches (fullshard/_switches.py): typed, checked where read, and
read once per model construction, not on every collective."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fullshard import _switches as switches
from fullshard._switches import DEFAULT_SHM_CELL_BYTES, Switches
from harness import run_on_ranks


def test_defaults_when_nothing_is_set() -> None:
    assert Switches.from_environ({}) == Switches(
        collective_timeout=None,
        debug_checks=False,
        gloo_rings=True,
        shared_memory=True,
        shm_cell_bytes=DEFAULT_SHM_CELL_BYTES,
        reductions_in_flight=None,
        use_full_prec_in_eval=False,
        use_unsafe_setattr=False,
    )


def test_each_variable_sets_its_field() -> None:
    read = Switches.from_environ(
        {
            "FULLSHARD_COLLECTIVE_TIMEOUT": "2.5",
            "FULLSHARD_DEBUG": "1",
            "FULLSHARD_GLOO_RINGS": "0",
            "FULLSHARD_SHM": "0",
            "FULLSHARD_SHM_CELL_MIB": "0.01",  # 10485 bytes: two whole pages
            "FULLSHARD_REDUCTIONS_IN_FLIGHT": "3",
            "FSDP_USE_FULL_PREC_IN_EVAL": "1",
            "FSDP_USE_UNSAFE_SETATTR": "1",
        }
    )
    assert read == Switches(
        collective_timeout=timedelta(seconds=2.5),
        debug_checks=True,
        gloo_rings=False,
        shared_memory=False,
        shm_cell_bytes=8192,
        reductions_in_flight=3,
        use_full_prec_in_eval=True,
        use_unsafe_setattr=True,
    )
    assert Switches.from_environ({"TORCH_DISTRIBUTED_DEBUG": "detail"}).debug_checks
    assert not Switches.from_environ({"TORCH_DISTRIBUTED_DEBUG": "INFO"}).debug_checks


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_reductions_in_flight_must_be_a_count(value: str) -> None:
    with pytest.raises(
        ValueError, match=f"FULLSHARD_REDUCTIONS_IN_FLIGHT must be a whole .*{value}"
    ):
        Switches.from_environ({"FULLSHARD_REDUCTIONS_IN_FLIGHT": value})


def test_current_reads_once_until_reloaded_or_forgotten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FULLSHARD_GLOO_RINGS", "0")
    switches.forget()
    try:
        assert not switches.current().gloo_rings
        monkeypatch.setenv("FULLSHARD_GLOO_RINGS", "1")
        assert not switches.current().gloo_rings  # kept, not read again
        assert switches.reload().gloo_rings
        monkeypatch.setenv("FULLSHARD_GLOO_RINGS", "0")
        switches.forget()
        assert not switches.current().gloo_rings
    finally:
        switches.forget()


def _env_changed_after_construction() -> tuple[Switches, bool]:
    """Build a unit, then set a bad collective timeout and a full-precision eval: the step that
    follows (whose every collective waits with the timeout) uses what was read at
    construction."""
    from fullshard import FullyShardedDataParallel as FSDP

    model = FSDP(nn.Linear(4, 4))
    os.environ["FULLSHARD_COLLECTIVE_TIMEOUT"] = "soon"
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        model(torch.randn(2, 4)).sum().backward()
    finally:
        del os.environ["FULLSHARD_COLLECTIVE_TIMEOUT"], os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    dist.barrier()
    return model._unit.settings.switches, model._use_full_prec_in_eval


def test_a_unit_keeps_the_switches_read_at_its_construction() -> None:
    for read, full_prec_in_eval in run_on_ranks(2, _env_changed_after_construction):
        assert read == Switches.from_environ({})
        assert not full_prec_in_eval


def _construction_reads_the_environment() -> bool:
    from fullshard import FullyShardedDataParallel as FSDP

    os.environ["FULLSHARD_COLLECTIVE_TIMEOUT"] = "never"
    try:
        with pytest.raises(ValueError, match="FULLSHARD_COLLECTIVE_TIMEOUT='never' is not a"):
            FSDP(nn.Linear(4, 4))
    finally:
        del os.environ["FULLSHARD_COLLECTIVE_TIMEOUT"]
    os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        model = FSDP(nn.Linear(4, 4))
    finally:
        del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
    return model._use_full_prec_in_eval


def test_construction_reads_the_environment_and_checks_it() -> None:
    assert run_on_ranks(2, _construction_reads_the_environment) == [True, True]
