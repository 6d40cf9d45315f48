"""``fullshard.checkpoint`` (issue 5): exact resume, resharding, crash safety, metadata checks,
and the memory of a rank-0-only full state dict, on gloo CPU ranks.

Exact resume: 6 uninterrupted steps against 3 steps, ``save``, a new process group and a new
model, ``load``, 3 more steps. Every rank takes its rows of one global batch per step (12
rows: divisible by 2, 3 and 4), so the global loss is the same computation at any world size.
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

import fullshard.checkpoint as ckpt
from fullshard import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._safe_dcp import MetadataUnpickler, SafeLoadPlanner
from fullshard.wrap import ModuleWrapPolicy
from harness import RankError, run_on_ranks

GLOBAL_BATCH = 12


def _model(strategy: ShardingStrategy, use_orig_params: bool, seed: int, group: Any = None) -> FSDP:
    torch.manual_seed(seed)
    module = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 33), nn.ReLU(), nn.Linear(33, 4)
    )
    return FSDP(
        module,
        sharding_strategy=strategy,
        use_orig_params=use_orig_params,
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
        process_group=group,
    )


def _train(model: FSDP, optim: torch.optim.Optimizer, steps: range) -> list[float]:
    """One step per global batch; returns the global (all-ranks mean) losses."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = GLOBAL_BATCH // world_size
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(1000 + step)
        inputs = torch.randn(GLOBAL_BATCH, 16, generator=generator)[rank * rows : (rank + 1) * rows]
        target = torch.randn(GLOBAL_BATCH, 4, generator=generator)[rank * rows : (rank + 1) * rows]
        loss = nn.functional.mse_loss(model(inputs), target)
        loss.backward()
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    return losses


def _adam(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.Adam([{"params": params[:1], "lr": 0.02}, {"params": params[1:]}], lr=0.01)


def _uninterrupted(strategy: ShardingStrategy, use_orig_params: bool) -> list[float]:
    model = _model(strategy, use_orig_params, seed=0)
    return _train(model, _adam(model), range(6))


def _first_half(path: str, strategy: ShardingStrategy, use_orig_params: bool) -> list[float]:
    model = _model(strategy, use_orig_params, seed=0)
    optim = _adam(model)
    losses = _train(model, optim, range(3))
    ckpt.save(path, model, optim, step=3, note="half")
    return losses


def _second_half(path: str, strategy: ShardingStrategy, use_orig_params: bool) -> list[float]:
    group = dist.new_group(list(range(dist.get_world_size())))  # a new process group
    model = _model(strategy, use_orig_params, seed=1, group=group)  # other initial values
    optim = _adam(model)
    extra = ckpt.load(path, model, optim)
    assert extra == {"step": 3, "note": "half"}, extra
    return _train(model, optim, range(extra["step"], 6))


RESUMES = [
    (2, 2, ShardingStrategy.FULL_SHARD, False),
    (2, 2, ShardingStrategy.FULL_SHARD, True),
    (2, 2, ShardingStrategy.SHARD_GRAD_OP, True),
    (4, 2, ShardingStrategy.FULL_SHARD, False),
    (2, 3, ShardingStrategy.FULL_SHARD, True),
]


@pytest.mark.parametrize(
    "saved_on, resumed_on, strategy, use_orig_params",
    RESUMES,
    ids=[f"{a}->{b}-{s.name}-orig{o}" for a, b, s, o in RESUMES],
)
def test_resume_matches_uninterrupted_run(
    saved_on: int,
    resumed_on: int,
    strategy: ShardingStrategy,
    use_orig_params: bool,
    tmp_path: Path,
) -> None:
    """3 steps + save + new group + load + 3 steps == 6 steps: bitwise at the same world
    size, within 1e-5 relative across world sizes."""
    path = str(tmp_path / "ckpt")
    expected = run_on_ranks(saved_on, _uninterrupted, strategy, use_orig_params)[0]
    first = run_on_ranks(saved_on, _first_half, path, strategy, use_orig_params)[0]
    second = run_on_ranks(resumed_on, _second_half, path, strategy, use_orig_params)[0]
    assert first == expected[:3]
    if saved_on == resumed_on:
        assert second == expected[3:]
    else:
        torch.testing.assert_close(
            torch.tensor(second, dtype=torch.float64),
            torch.tensor(expected[3:], dtype=torch.float64),
            rtol=1e-5,
            atol=0,
        )


# -- crash safety ------------------------------------------------------------------------------


def _full_state(model: FSDP, optim: torch.optim.Optimizer) -> dict[str, Any]:
    """Every rank's view of the full model and optimizer state (collective)."""
    return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}


def _save_good(path: str) -> dict[str, Any]:
    model = _model(ShardingStrategy.FULL_SHARD, True, seed=0)
    optim = _adam(model)
    _train(model, optim, range(2))
    ckpt.save(path, model, optim, step=2)
    return _full_state(model, optim)


def _crash_during_save(path: str, where: str) -> None:
    """Train on, then save again, with one rank dying at ``where``."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    model = _model(ShardingStrategy.FULL_SHARD, True, seed=0)
    optim = _adam(model)
    _train(model, optim, range(4))
    rank = dist.get_rank()
    if where == "writing" and rank == 1:  # dies after writing some of its files
        write_data = FileSystemWriter.write_data

        def dying(self: Any, plan: Any, planner: Any) -> Any:
            write_data(self, plan, planner).wait()
            os._exit(1)

        FileSystemWriter.write_data = dying  # type: ignore[method-assign]
    if where == "committing" and rank == 0:  # every file written, nothing swapped in yet
        ckpt._commit = lambda partial, path: os._exit(1)  # type: ignore[assignment]
    ckpt.save(path, model, optim, step=4)


def _load_and_compare(path: str) -> dict[str, Any]:
    model = _model(ShardingStrategy.FULL_SHARD, True, seed=5)
    optim = _adam(model)
    extra = ckpt.load(path, model, optim)
    assert extra == {"step": 2}
    return _full_state(model, optim)


def _assert_same_state(actual: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, torch.Tensor):
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=where)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys(), where
        for key, value in expected.items():
            _assert_same_state(actual[key], value, f"{where}.{key}")
    elif isinstance(expected, list):
        assert len(actual) == len(expected), where
        for index, value in enumerate(expected):
            _assert_same_state(actual[index], value, f"{where}[{index}]")
    else:
        assert actual == expected, where


@pytest.mark.parametrize("where", ["writing", "committing"])
def test_crash_mid_save_leaves_previous_checkpoint(where: str, tmp_path: Path) -> None:
    """A rank killed while writing (or before the swap) fails the save; the previous
    checkpoint is untouched and loads exactly."""
    path = str(tmp_path / "ckpt")
    expected = run_on_ranks(2, _save_good, path)[0]
    with pytest.raises(RankError):
        run_on_ranks(2, _crash_during_save, path, where, timeout=60)
    assert any(p.name.startswith(".ckpt.partial-") for p in tmp_path.iterdir())
    actual = run_on_ranks(2, _load_and_compare, path)[0]
    _assert_same_state(actual, expected)
    assert ckpt.read_metadata(path)["step"] == 2


def _save_twice(path: str) -> None:
    model = _model(ShardingStrategy.FULL_SHARD, False, seed=0)
    optim = _adam(model)
    _train(model, optim, range(2))
    ckpt.save(path, model, optim, step=2)


def test_interrupted_swap_falls_back_to_previous(tmp_path: Path) -> None:
    """Between the two renames only `.<name>.previous` exists: load finds it (with a
    warning), and the next save cleans up."""
    path = tmp_path / "ckpt"
    run_on_ranks(2, _save_twice, str(path))
    path.rename(tmp_path / ".ckpt.previous")  # as a crash between the renames leaves it
    with pytest.warns(UserWarning, match="loading the previous complete one"):
        metadata = ckpt.read_metadata(path)
    assert metadata["step"] == 2 and metadata["world_size"] == 2
    run_on_ranks(2, _save_twice, str(path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def _load_what_each_rank_finds(paths: list[str]) -> str:
    """Load with each rank given its own path (as ranks on hosts that see different
    folders would find them): the error every rank raises."""
    model = _model(ShardingStrategy.FULL_SHARD, False, seed=0)
    with pytest.raises((FileNotFoundError, ValueError)) as info:
        ckpt.load(paths[dist.get_rank()], model, _adam(model))
    return f"{type(info.value).__name__}: {info.value}"


def test_ranks_that_find_different_checkpoints_all_raise(tmp_path: Path) -> None:
    """Each rank resolves the path on its own file system. A rank that finds no checkpoint,
    or ranks that find different ones (a save swapping it in between their looks: one
    finds the folder, another its previous one), raised on some ranks only, the others
    waiting in the load's collectives, or loaded two different checkpoints. Every rank now
    raises the same error, naming each rank's finding."""
    path = tmp_path / "ckpt"
    run_on_ranks(2, _save_twice, str(path))
    missing = run_on_ranks(2, _load_what_each_rank_finds, [str(path), str(tmp_path / "none")])
    for message in missing:  # each names its own path first, then every rank's finding
        assert message.startswith("FileNotFoundError: cannot load the checkpoint at"), missing
        assert message.endswith(f"rank 1: FileNotFoundError: no checkpoint at {tmp_path}/none")
    swapping = tmp_path / "swapping"
    shutil.copytree(path, swapping)
    shutil.copytree(path, tmp_path / ".swapped.previous")  # rank 1 finds only the previous
    paths = [str(swapping), str(tmp_path / "swapped")]  # rank 1 warns that it found the previous
    found = run_on_ranks(2, _load_what_each_rank_finds, paths)
    for message in found:
        assert message.startswith("ValueError: the ranks found different checkpoints"), found
        assert "(rank 0: current; rank 1: previous)" in message, found


def _save_where_rank0_cannot_write(path: str) -> str:
    model = _model(ShardingStrategy.FULL_SHARD, False, seed=0)
    with pytest.raises(OSError) as info:
        ckpt.save(path, model, _adam(model), step=1)
    return str(info.value)


def test_a_save_rank0_cannot_write_fails_on_every_rank(tmp_path: Path) -> None:
    """Rank 0 creates the folder and swaps the checkpoint in; where that fails (here the
    parent is a file), every rank raises rank 0's error. The others waited in a barrier
    and learned only that rank 0 was gone, or nothing until the group's timeout."""
    (tmp_path / "a_file").write_text("")
    messages = run_on_ranks(2, _save_where_rank0_cannot_write, str(tmp_path / "a_file" / "ckpt"))
    assert messages[0] == messages[1], messages
    assert "checkpoint.save failed on rank 0 while creating" in messages[0], messages
    assert "FileExistsError" in messages[0], messages


# -- metadata, mismatches, safety ----------------------------------------------------------------


def _load_into_other_model(path: str) -> None:
    torch.manual_seed(0)
    other = FSDP(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 30), nn.ReLU(), nn.Linear(30, 4)),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    with pytest.raises(ckpt.CheckpointMismatchError) as info:
        ckpt.load(path, other)
    message = str(info.value)
    assert "shapes differ: 2.weight (checkpoint (33, 32), model (30, 32))" in message
    assert "4.weight (checkpoint (4, 33), model (4, 30))" in message
    deeper = FSDP(nn.Sequential(nn.Linear(16, 32)), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    missing = r"in the checkpoint but not in the model: 2\.bias, 2\.weight, 4\.bias, 4\.weight"
    with pytest.raises(ckpt.CheckpointMismatchError, match=missing):
        ckpt.load(path, deeper)


def test_checkpoint_metadata_and_mismatch_errors(tmp_path: Path) -> None:
    """The metadata records step, world size, strategy, names and shapes; loading into
    another model names every differing parameter."""
    path = tmp_path / "ckpt"
    run_on_ranks(2, _save_twice, str(path))
    metadata = ckpt.read_metadata(path)
    assert metadata["step"] == 2 and metadata["world_size"] == 2
    assert metadata["sharding_strategies"] == ["FULL_SHARD"]
    assert metadata["model"]["2.weight"] == {"shape": [33, 32], "dtype": "float32"}
    assert metadata["optimizer"] == "Adam"
    assert metadata["optimizer_states"]["0.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    run_on_ranks(2, _load_into_other_model, str(path))
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        ckpt.read_metadata(tmp_path / "missing")
    (tmp_path / "half").mkdir()
    with pytest.raises(ValueError, match="not a complete fullshard checkpoint"):
        ckpt.read_metadata(tmp_path / "half")


class _Payload:
    """Unpickling this would run code: weights_only loading must refuse it."""

    def __reduce__(self) -> Any:
        return (os.mkdir, (f"{self.path}.pwned",))

    def __init__(self, path: str) -> None:
        self.path = path


def _load_refuses_pickled_code(path: str) -> None:
    state = {"value": _Payload(path)}
    dcp.save(state, checkpoint_id=path)
    # DCP wraps the rank's error in a CheckpointException (a BaseException).
    with pytest.raises(BaseException, match="Weights only load failed"):
        dcp.load({"value": None}, checkpoint_id=path, planner=SafeLoadPlanner())
    assert not os.path.exists(f"{path}.pwned")


def test_loading_runs_no_pickled_code(tmp_path: Path) -> None:
    """Non-tensor items are read with weights_only=True: a planted object is refused."""
    run_on_ranks(1, _load_refuses_pickled_code, str(tmp_path / "evil"))


def _load_expecting(path: str, message: str, verify: bool = True) -> None:
    model = _model(ShardingStrategy.FULL_SHARD, False, seed=1)
    # DCP wraps a rank's error in a CheckpointException (a BaseException).
    with pytest.raises(BaseException, match=message):
        ckpt.load(path, model, _adam(model), verify=verify)


def _flip_a_byte(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))


def test_damaged_files_are_caught_by_their_digests(tmp_path: Path) -> None:
    """One flipped bit in a data file (which DCP alone loads silently, as garbage), a
    truncated file, a missing one: load names each against the save's record."""
    path = tmp_path / "ckpt"
    run_on_ranks(2, _save_twice, str(path))
    files = ckpt.read_metadata(path)["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    _flip_a_byte(path / "__1_0.distcp")
    run_on_ranks(
        2, _load_expecting, str(path), r"damaged: __1_0\.distcp's contents changed since the save"
    )
    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data[:100])
    (path / ".metadata").unlink()
    expected = (
        rf"\.metadata is missing; __0_0\.distcp has 100 bytes, {len(data)} saved; "
        r"__1_0\.distcp's contents changed"
    )
    run_on_ranks(2, _load_expecting, str(path), expected)


def test_tampered_metadata_is_refused(tmp_path: Path) -> None:
    """DCP's .metadata is a pickle: one that would run code is refused without running it,
    and one that points a data file outside the checkpoint folder is refused too."""
    path = tmp_path / "ckpt"
    run_on_ranks(2, _save_twice, str(path))
    metadata_file = path / ".metadata"
    good = metadata_file.read_bytes()

    metadata_file.write_bytes(pickle.dumps(_Payload(str(tmp_path / "m"))))
    # The recorded digest catches the change first; without verification the unpickler does.
    run_on_ranks(2, _load_expecting, str(path), r"damaged: \.metadata has \d+ bytes, \d+ saved")
    run_on_ranks(
        2, _load_expecting, str(path), "refers to posix.mkdir.*refusing to load it", verify=False
    )
    assert not (tmp_path / "m.pwned").exists()

    with open(metadata_file, "wb") as handle:
        metadata = MetadataUnpickler(io.BytesIO(good)).load()
        first = next(iter(metadata.storage_data))
        metadata.storage_data[first].relative_path = "../../outside.distcp"
        pickle.dump(metadata, handle)
    run_on_ranks(2, _load_expecting, str(path), "outside the checkpoint folder", verify=False)

    metadata_file.write_bytes(good)  # the untouched metadata still loads
    run_on_ranks(2, _load_and_compare_any, str(path))
    assert ckpt.read_metadata(path)["files"][".metadata"]["bytes"] == len(good)


def _load_and_compare_any(path: str) -> None:
    model = _model(ShardingStrategy.FULL_SHARD, False, seed=1)
    assert ckpt.load(path, model, _adam(model))["step"] == 2


# -- memory of a rank-0-only full state dict ------------------------------------------------------


def _vm_hwm_kib() -> int:
    with open("/proc/self/status") as status:
        match = re.search(r"VmHWM:\s+(\d+) kB", status.read())
    assert match is not None
    return int(match.group(1))


def _reset_peak() -> None:
    """Return freed heap memory to the OS, then restart the high-water mark at the current
    resident size, so the mark measures new memory only."""
    libc = ctypes.CDLL("libc.so.6")
    # Fixed mmap threshold (M_MMAP_THRESHOLD = -3): large buffers are mapped and unmapped,
    # never parked in the heap, so the mark tracks live memory, not allocator retention.
    libc.mallopt(-3, 128 * 1024)
    libc.malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def _rank0_full_save_peak(num_layers: int, width: int) -> dict[str, float]:
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(num_layers)]),
        auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
    )
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(2, width)).sum().backward()
    optim.step()
    optim.zero_grad(set_to_none=True)
    mib = 2**20
    full_bytes = num_layers * width * width * 4
    config = (FullStateDictConfig(True, True), FullOptimStateDictConfig(True, True))
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, *config):
        _reset_peak()
        before = _vm_hwm_kib()
        state = model.state_dict()
        model_peak = (_vm_hwm_kib() - before) / 1024
        osd = FSDP.optim_state_dict(model, optim)
        optim_peak = (_vm_hwm_kib() - before) / 1024
    assert bool(state) == bool(osd) == (dist.get_rank() == 0)
    return {
        "full_mib": full_bytes / mib,
        "unit_mib": width * width * 4 / mib,
        "model_peak_mib": model_peak,
        "model_and_optim_peak_mib": optim_peak,
    }


def test_rank0_only_full_state_dict_memory() -> None:
    """rank0_only FULL state dicts: rank 0's peak grows by the CPU copy it builds plus at most
    one unit (the gather's transient buffer); the other ranks allocate (almost) nothing."""
    rank0, rank1 = run_on_ranks(2, _rank0_full_save_peak, 16, 1024)
    full, unit = rank0["full_mib"], rank0["unit_mib"]  # 64 MiB in 16 units of 4 MiB
    # Measured here: rank 0 +64.1..68.1 MiB, rank 1 +0.1 MiB for the model; with Adam's
    # state (128 MiB more on rank 0) rank 0 +193..201 MiB, rank 1 +1.0 MiB.
    assert rank0["model_peak_mib"] <= full + unit + 1, rank0
    assert rank1["model_peak_mib"] <= 1, rank1
    assert rank0["model_and_optim_peak_mib"] <= 3 * full + 3 * unit, rank0
    assert rank1["model_and_optim_peak_mib"] <= 2, rank1
