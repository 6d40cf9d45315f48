"""fullshard's collectives on gloo: the point-to-point rings (see [Note: rings on gloo]) give
what gloo's own all-gather and reduce-scatter give, at every world size. (The rings carry
what the shared-memory transport does not: FULLSHARD_SHM=0 here; tests/comm/test_shared_memory.py
tests that transport.)"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
import torch
import torch.distributed as dist

from fullshard._comm import collectives as comm
from harness import run_on_ranks

RINGS = {"FULLSHARD_SHM": "0"}


def _compare_with_gloo(numel: int, dtype: torch.dtype) -> None:
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    generator = torch.Generator().manual_seed(rank)
    group = dist.group.WORLD
    assert comm._uses_ring(group, torch.empty(0)) == (os.environ.get("FULLSHARD_GLOO_RINGS") != "0")
    full = torch.randn(numel * num_ranks, generator=generator).to(dtype)
    reduced = torch.empty(numel, dtype=dtype)
    comm.reduce_scatter_into(reduced, full, group, "test").wait()
    expected = torch.empty_like(reduced)
    dist.reduce_scatter_tensor(expected, full)
    if num_ranks == 2:  # one addition, a + b: bitwise what any reduce-scatter gives
        torch.testing.assert_close(reduced, expected, rtol=0, atol=0)
    else:  # the ring sums in another order: a few units in the last place apart
        ulp = torch.finfo(dtype).eps * full.abs().max().item() * num_ranks
        torch.testing.assert_close(reduced, expected, rtol=0, atol=4 * ulp)
    shard = torch.randn(numel, generator=generator).to(dtype)
    gathered = torch.empty(numel * num_ranks, dtype=dtype)
    comm.all_gather_into(gathered, shard, group, "test").wait()
    expected_gathered = torch.empty_like(gathered)
    dist.all_gather_into_tensor(expected_gathered, shard)
    torch.testing.assert_close(gathered, expected_gathered, rtol=0, atol=0)


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rings_match_gloo_collectives(num_ranks: int, dtype: torch.dtype) -> None:
    """Ring reduce-scatter and all-gather equal gloo's (bitwise on 2 ranks)."""
    run_on_ranks(num_ranks, _compare_with_gloo, 1000, dtype, env=RINGS)


def test_gloo_rings_can_be_switched_off() -> None:
    """FULLSHARD_GLOO_RINGS=0 uses gloo's own collectives (same results)."""
    gloo = {**RINGS, "FULLSHARD_GLOO_RINGS": "0"}
    run_on_ranks(2, _compare_with_gloo, 7, torch.float32, env=gloo)


def _overlapping_rings() -> None:
    """Two rings in flight at once (a prefetch and a reduction) stay paired by their tags."""
    rank = dist.get_rank()
    group = dist.group.WORLD
    first, second = torch.empty(8), torch.empty(8)
    work_a = comm.all_gather_into(first, torch.full((4,), float(rank)), group, "a")
    work_b = comm.all_gather_into(second, torch.full((4,), 10.0 + rank), group, "b")
    work_b.wait()
    work_a.wait()
    assert first.tolist() == [0.0] * 4 + [1.0] * 4
    assert second.tolist() == [10.0] * 4 + [11.0] * 4


def test_rings_in_flight_together_do_not_mix() -> None:
    """Concurrent rings, waited in the other order, each get their own data."""
    run_on_ranks(2, _overlapping_rings, env=RINGS)
    run_on_ranks(2, _overlapping_rings)  # the same through the shared-memory transport


def _tags_of_a_destroyed_group() -> tuple[int | None, bool]:
    gc.collect()
    counted = len(comm._TAGS)
    group = dist.new_group([0, 1])
    out = torch.empty(4)
    comm.all_gather_into(out, torch.full((2,), float(dist.get_rank())), group, "old").wait()
    first = comm._TAGS.get(group)
    dead = weakref.ref(group)
    dist.destroy_process_group(group)
    del group
    gc.collect()
    assert dead() is None, "the destroyed group is still referenced"
    return first, len(comm._TAGS) <= counted


def test_ring_tags_go_with_their_group() -> None:
    """The rings' per-group tag count is dropped with the group: keyed by ``id`` it stayed,
    and a later group that got the dead one's ``id`` on some ranks only continued its count
    there while the others started at 1 (messages that never match: a hang)."""
    assert run_on_ranks(2, _tags_of_a_destroyed_group, env=RINGS) == [(1, True)] * 2


def test_counters_keep_a_bounded_history_of_labels() -> None:
    """Counts and bytes keep adding up forever; the per-call label history keeps only the
    most recent calls, so a long training run does not grow it without bound."""
    from fullshard._comm.collectives import _KEPT_LABELS, CollectiveCounters

    counters = CollectiveCounters()
    for call in range(_KEPT_LABELS + 5):
        counters.record("all_gather", f"unit{call}", 8)
    assert counters.calls["all_gather"] == _KEPT_LABELS + 5
    assert counters.total_bytes == 8 * (_KEPT_LABELS + 5)
    assert len(counters.labels) == _KEPT_LABELS
    assert counters.labels[0] == ("all_gather", "unit5")


def test_ranks_problem_names_the_ranks_unless_every_rank_found_the_same() -> None:
    """The message every rank raises for what some ranks found: the text alone where every
    rank found it, else each text after the ranks that found it."""
    assert comm.ranks_problem(["", ""]) == ""
    assert comm.ranks_problem(["bad", "bad"]) == "bad"
    assert comm.ranks_problem(["", "bad", "bad"]) == "rank 1, 2: bad"
    assert comm.ranks_problem(["y", "x", "y"]) == "rank 0, 2: y; rank 1: x"
