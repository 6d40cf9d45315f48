"""The shared-memory transport (see [Note: shared-memory transport]): the same results as
gloo's collectives for any sizes, dtypes, world sizes and orders of waiting; pieces larger
than a cell; mismatches and fallbacks."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
import torch.distributed as dist

from fullshard import _switches as switches
from fullshard._comm import collectives as comm
from fullshard._comm import shared_memory as shm
from fullshard._switches import Switches
from harness import RankError, run_on_ranks

pytestmark = pytest.mark.skipif(
    not shm._ORDERED_STORES, reason="the transport runs on x86-64 only (see its note)"
)

TINY_CELLS = {"FULLSHARD_SHM_CELL_MIB": str(4096 / 2**20)}  # one page: 1024 fp32 per cell


def _uses_transport(group: dist.ProcessGroup) -> bool:
    return shm._TRANSPORTS.get(group) is not None


def _random_schedule(seed: int, num_ops: int, in_flight: int) -> None:
    """Issue ``num_ops`` random all-gathers and reduce-scatters (sizes, dtypes, divisors)
    with up to ``in_flight`` outstanding, waiting them in a random order; every result must
    equal what gloo's own collectives give on the same inputs (computed first: a rank must
    not block in gloo while its transport has pieces outstanding, see [Note: draining])."""
    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    schedule = random.Random(seed)  # the same on every rank: the collectives must match
    data = torch.Generator().manual_seed(1000 * seed + rank)  # different on every rank
    ops = []
    for _ in range(num_ops):
        numel = schedule.choice([0, 1, 7, 1000, 1024, 3001, 5000])
        dtype = schedule.choice([torch.float32, torch.bfloat16, torch.float16])
        if schedule.random() < 0.5:
            shard = torch.randn(numel, generator=data).to(dtype)
            expected = torch.empty(numel * num_ranks, dtype=dtype)
            dist.all_gather_into_tensor(expected, shard)
            ops.append(("all_gather", shard, expected, 1.0, None))
        else:
            predivide = schedule.choice([1.0, float(num_ranks), 3.0])
            full = torch.randn(numel * num_ranks, generator=data).to(dtype)
            places = _places(full, schedule) if schedule.random() < 0.5 else None
            # The transport's sum: this rank's term first, then the others in rank order.
            divided = [torch.empty_like(full) for _ in range(num_ranks)]
            dist.all_gather(divided, full / predivide)
            chunks = [tensor.chunk(num_ranks)[rank] if numel else tensor for tensor in divided]
            expected = chunks[rank].clone()
            for source in range(num_ranks):
                if source != rank:
                    expected.add_(chunks[source])
            ops.append(("reduce_scatter", full, expected, predivide, places))
    outstanding: list[tuple[comm.Pending, torch.Tensor, torch.Tensor]] = []

    def finish(index: int) -> None:
        pending, result, expected = outstanding.pop(index)
        pending.wait()
        torch.testing.assert_close(result, expected, rtol=0, atol=0)

    for kind, source, expected, predivide, places in ops:
        result = torch.full_like(expected, float("nan"))
        if kind == "all_gather":
            pending = comm.all_gather_into(result, source, group, "test")
        elif places is not None:  # ``source`` gives sizes only: NaN if it were read
            sizes = torch.full_like(source, float("nan"))
            pending = comm.reduce_scatter_into(
                result, sizes, group, "t", predivide=predivide, places=places
            )
        else:
            pending = comm.reduce_scatter_into(result, source, group, "t", predivide=predivide)
        outstanding.append((pending, result, expected))
        if len(outstanding) >= in_flight:
            finish(schedule.randrange(len(outstanding)))
    while outstanding:
        finish(schedule.randrange(len(outstanding)))
    assert _uses_transport(group)


def _places(full: torch.Tensor, schedule: random.Random) -> list[tuple[int, torch.Tensor]]:
    """``full`` as a reduce-scatter's places: cut at random points (across the ranks'
    chunks and the cells' pieces), some runs left out and zeroed in ``full`` (the zeros
    that no place covers stand for), the others copies of ``full`` 's elements."""
    total = full.numel()
    cuts = sorted(schedule.sample(range(1, total), min(6, total - 1))) if total > 1 else []
    places = []
    for start, end in zip([0, *cuts], [*cuts, total]):
        if schedule.random() < 0.3:
            full[start:end] = 0
        else:
            places.append((start, full[start:end].clone()))
    return places


@pytest.mark.parametrize("num_ranks", [2, 3, 4])
@pytest.mark.parametrize("in_flight", [1, 3, 9])
def test_random_collectives_equal_gloo(num_ranks: int, in_flight: int) -> None:
    """Pieces larger than a cell (1024 fp32), zero-size ops, up to 9 collectives outstanding
    over 4 slots (issue cannot post them all: `wait` does), waited in random order; half
    the reduce-scatters read places, with gaps, instead of their input."""
    run_on_ranks(num_ranks, _random_schedule, num_ranks, 40, in_flight, env=TINY_CELLS)


def test_random_collectives_equal_gloo_default_cells() -> None:
    run_on_ranks(2, _random_schedule, 7, 30, 3)


def _two_rank_bitwise() -> None:
    """On 2 ranks the reduce-scatter is one addition: bitwise gloo's, with the division."""
    rank = dist.get_rank()
    full = torch.randn(4000, generator=torch.Generator().manual_seed(rank))
    expected = torch.empty(2000)
    dist.reduce_scatter_tensor(expected, full / 2)
    result = torch.empty(2000)
    comm.reduce_scatter_into(result, full.clone(), dist.group.WORLD, "t", predivide=2.0).wait()
    assert torch.equal(result, expected)


def test_two_rank_reduce_scatter_is_bitwise_gloos() -> None:
    run_on_ranks(2, _two_rank_bitwise, env=TINY_CELLS)


def _mismatched_sizes() -> None:
    rank = dist.get_rank()
    numel = 10 if rank == 0 else 12
    output = torch.empty(2 * numel)
    comm.all_gather_into(output, torch.ones(numel), dist.group.WORLD, "blocks.0").wait()


def _skipped_unit() -> None:
    """Rank 1 skips blocks.1 (rank-dependent control flow); the units have equal sizes."""
    for unit in ("blocks.0", "blocks.1", "blocks.2"):
        if unit == "blocks.1" and dist.get_rank() == 1:
            continue
        comm.all_gather_into(torch.empty(8), torch.ones(4), dist.group.WORLD, unit).wait()


@pytest.mark.parametrize("mistake", ["sizes", "skipped_unit"])
def test_ranks_running_different_collectives_get_an_error(mistake: str) -> None:
    """Where gloo would abort, hang or silently mix two units' bytes (equal sizes), the
    transport's signatures catch the difference, without FULLSHARD_DEBUG."""
    with pytest.raises(RankError) as error:
        run_on_ranks(2, _mismatched_sizes if mistake == "sizes" else _skipped_unit)
    text = str(error.value)
    assert "CollectiveMismatchError" in text
    if mistake == "sizes":
        assert "rank 1 ran a different collective than this rank (rank 0: all-gather of " in text
        assert "module blocks.0 of 20 x torch.float32)" in text
    else:
        assert "(rank 0: all-gather of module blocks.1 of 8 x torch.float32)" in text
        assert "(rank 1: all-gather of module blocks.2 of 8 x torch.float32)" in text


def _no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(28, "No space left on device")


def _falls_back(broken_rank: int, why: str) -> bool:
    """Setup fails on ``broken_rank``: no shared directory there, or (rank 0) a /dev/shm too
    small for the file. Every rank then uses gloo."""
    fallocate = os.posix_fallocate
    if dist.get_rank() == broken_rank:
        if why == "no_directory":
            shm._SHM_DIR = "/nonexistent-fullshard-test"
        else:
            os.posix_fallocate = _no_space
    try:
        group = dist.new_group(list(range(dist.get_world_size())))
        rank = dist.get_rank()
        output = torch.empty(4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comm.all_gather_into(output, torch.full((2,), float(rank)), group, "t").wait()
        if why == "no_space" and rank == 0:
            assert any(
                "cannot hold the shared-memory transport's" in str(w.message) for w in caught
            )
        assert output.tolist() == [0.0, 0.0, 1.0, 1.0]
        return _uses_transport(group)
    finally:
        shm._SHM_DIR = "/dev/shm"
        os.posix_fallocate = fallocate


@pytest.mark.parametrize(
    ("broken_rank", "why"), [(0, "no_directory"), (1, "no_directory"), (0, "no_space")]
)
def test_a_rank_that_cannot_share_the_file_makes_all_use_gloo(broken_rank: int, why: str) -> None:
    """If the creator or a joiner cannot map the file (e.g. another host), or /dev/shm
    cannot hold it, no rank uses the transport for that group, and results are the same."""
    assert run_on_ranks(2, _falls_back, broken_rank, why) == [False, False]


def _leaves_no_file() -> list[str]:
    group = dist.new_group([0, 1])
    output = torch.empty(2)
    comm.all_gather_into(output, torch.ones(1), group, "t").wait()
    assert _uses_transport(group)
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(shm.FILE_PREFIX))


def test_the_file_is_unlinked_once_every_rank_has_it() -> None:
    """No file is left in /dev/shm (a crash later cannot leak it)."""
    before = {name for name in os.listdir("/dev/shm") if name.startswith("fullshard-")}
    left = run_on_ranks(2, _leaves_no_file)
    assert set(left[0]) <= before and set(left[1]) <= before


def _switched_off() -> bool:
    group = dist.new_group([0, 1])
    output = torch.empty(2)
    comm.all_gather_into(output, torch.ones(1), group, "t").wait()
    return group in shm._TRANSPORTS


def test_fullshard_shm_0_uses_gloo() -> None:
    assert run_on_ranks(2, _switched_off, env={"FULLSHARD_SHM": "0"}) == [False, False]


def test_cell_size_must_be_sensible() -> None:
    with pytest.raises(ValueError, match="FULLSHARD_SHM_CELL_MIB='lots' is not a number"):
        Switches.from_environ({"FULLSHARD_SHM_CELL_MIB": "lots"})
    with pytest.raises(ValueError, match=r"must be in \(0, 1024\]"):
        Switches.from_environ({"FULLSHARD_SHM_CELL_MIB": "0"})


def _staging_after_steps(num_ranks: int) -> tuple[int, int]:
    """Train 3 steps of 3 equal units (as transformer blocks are); return the bytes of the
    transport's file this rank touched and the memory model's staging for the units."""
    from torch import nn

    from fullshard import FullyShardedDataParallel as FSDP
    from fullshard.memory import estimate

    torch.manual_seed(0)
    # A group of its own: its transport is made here, with this call's cell size (the
    # default group's was made by whichever earlier test used these workers first).
    group = dist.new_group(list(range(num_ranks)))
    units = [FSDP(nn.Linear(200, 200), process_group=group) for _ in range(3)]
    model = FSDP(nn.Sequential(*units), process_group=group)
    for _ in range(3):
        model(torch.randn(2, 200)).sum().backward()
    transport = shm._TRANSPORTS[group]
    assert transport is not None
    cell = switches.current().shm_cell_bytes
    predicted = estimate([200 * 200 + 200] * 3, num_ranks, shared_memory_cell_bytes=cell)
    touched = transport.resident_bytes()
    del model, units, transport
    dist.destroy_process_group(group)
    return touched, predicted.staging


@pytest.mark.parametrize("num_ranks", [2, 3])
@pytest.mark.parametrize("cell", ["4 MiB", "16 KiB"])
def test_memory_model_bounds_the_staging_the_transport_touches(num_ranks: int, cell: str) -> None:
    """`fullshard.memory.estimate`'s staging bounds the bytes the transport touched, and
    equals them once the largest pieces fill the cells (16 KiB cells; with 4 MiB cells, a
    slot that only ever carried smaller pieces touched less)."""
    mib = "4" if cell == "4 MiB" else str(16384 / 2**20)
    results = run_on_ranks(
        num_ranks, _staging_after_steps, num_ranks, env={"FULLSHARD_SHM_CELL_MIB": mib}
    )
    for touched, predicted in results:
        assert 0 < touched <= predicted, (touched, predicted)
        if cell == "16 KiB":
            assert touched == predicted


def test_the_default_cell_is_the_memory_models() -> None:
    """Unset, FULLSHARD_SHM_CELL_MIB gives the cell `fullshard.memory` counts (the slots are
    one constant, `fullshard.memory.SHARED_MEMORY_SLOTS`, for both)."""
    from fullshard.memory import SHARED_MEMORY_CELL_BYTES

    assert Switches.from_environ({}).shm_cell_bytes == SHARED_MEMORY_CELL_BYTES


def _three_groups_waiting_in_a_cycle() -> None:
    """Groups {0,2}, {0,1}, {1,2}; each rank issues a many-piece all-gather on both of its
    groups, then waits them in an order that makes each rank wait on a peer that is itself
    waiting on another group: only a wait that moves every transport completes."""
    rank = dist.get_rank()
    groups = {pair: dist.new_group(list(pair)) for pair in [(0, 2), (0, 1), (1, 2)]}
    mine = [pair for pair in groups if rank in pair]  # issue order: the same within a group
    waits = {0: [(0, 1), (0, 2)], 1: [(1, 2), (0, 1)], 2: [(0, 2), (1, 2)]}[rank]
    for pair in mine:  # set every transport up first (a setup drains the others)
        comm.all_gather_into(torch.empty(2), torch.ones(1), groups[pair], "setup").wait()
    numel = 10 * 1024  # 10 pieces of one page per rank, over 4 slots
    pending = {}
    for pair in mine:
        output = torch.empty(2 * numel)
        shard = torch.full((numel,), float(rank))
        pending[pair] = (comm.all_gather_into(output, shard, groups[pair], str(pair)), output)
    for pair in waits:
        work, output = pending[pair]
        work.wait()
        assert output[:numel].eq(pair[0]).all() and output[numel:].eq(pair[1]).all()


def test_waits_across_groups_do_not_deadlock() -> None:
    run_on_ranks(
        3,
        _three_groups_waiting_in_a_cycle,
        env={**TINY_CELLS, "FULLSHARD_COLLECTIVE_TIMEOUT": "20"},
        timeout=90,
    )


def _mismatch_found_while_draining() -> None:
    rank = dist.get_rank()
    numel = 10 if rank == 0 else 12
    comm.all_gather_into(torch.empty(2 * numel), torch.ones(numel), dist.group.WORLD, "b.0")
    comm.all_reduce(torch.ones(1), dist.group.WORLD, "clip_grad_norm_").wait()  # drains first


def test_a_mismatch_first_seen_while_draining_is_a_collective_mismatch_error() -> None:
    with pytest.raises(RankError) as error:
        run_on_ranks(2, _mismatch_found_while_draining)
    assert "CollectiveMismatchError" in str(error.value)
    assert "TransportMismatchError" not in str(error.value)
