"""Tests of the multi-rank harness, the shared test models and the DDP parity routine."""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import harness
from fullshard._comm import shared_memory as shm
from harness import RankError, RankTimeoutError, requires_cuda_gpus, run_on_ranks
from models import (
    DummyProcessGroup,
    NestedWrappedModule,
    NonUniformReqGradNWM,
    TransformerWithSharedParams,
    nested_wrap,
    transformer_layer_classes,
)
from parity import check_ddp_parity

# ----------------------------------------------------------------------------------------
# Functions run on the ranks (module level, so workers import them by name)


def _rank_info(tag: str) -> tuple[int, int, str, str]:
    return dist.get_rank(), dist.get_world_size(), dist.get_backend(), tag


def _all_reduce_rank_sum() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def _getpid() -> int:
    return os.getpid()


def _read_env(name: str) -> str | None:
    return os.environ.get(name)


def _dirty_torch_state() -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)


def _torch_state() -> tuple[torch.dtype, bool, int]:
    return torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()


def _raise_on_rank_one() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    return 0


def _bare_assert() -> None:
    value = dist.get_rank() + 40
    assert value == 42


def _all_reduce_unless_rank_one() -> None:
    if dist.get_rank() == 1:
        raise KeyError("rank 1 left before the all_reduce")
    dist.all_reduce(torch.ones(1))


def _sleep_on_rank_one(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return dist.get_rank()


def _exit_abruptly(code: int) -> None:
    os._exit(code)


def _skip_everywhere() -> None:
    pytest.skip("skipped inside the ranks")


def _print_and_fail() -> None:
    print(f"hello from rank {dist.get_rank()}")
    raise RuntimeError("failing after printing")


def _wrap_nested_torch_fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy

    # torch's FSDP1 refuses CPU unless device_id names it explicitly.
    wrap = functools.partial(
        FullyShardedDataParallel,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
    )
    assert isinstance(model, NestedWrappedModule)
    nested_wrap(model, wrap)
    return wrap(model)


def _wrap_transformer_torch_fsdp(model: nn.Module) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy(transformer_layer_classes()),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=torch.device("cpu"),
    )


_MODEL_AND_WRAP = {
    "nested": (NestedWrappedModule, _wrap_nested_torch_fsdp),
    "transformer": (TransformerWithSharedParams, _wrap_transformer_torch_fsdp),
}


def _torch_fsdp_parity(kind: str) -> list[float]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model_cls, wrap = _MODEL_AND_WRAP[kind]
    return check_ddp_parity(model_cls, wrap, num_steps=2, fsdp_cls=FullyShardedDataParallel)


def _perturbed_parity_message() -> str:
    from torch.distributed.fsdp import FullyShardedDataParallel

    def perturb_then_wrap(model: nn.Module) -> nn.Module:
        with torch.no_grad():
            next(model.parameters()).add_(1e-3)
        return _wrap_nested_torch_fsdp(model)

    try:
        check_ddp_parity(
            NestedWrappedModule, perturb_then_wrap, num_steps=1, fsdp_cls=FullyShardedDataParallel
        )
    except AssertionError as exc:
        return str(exc)
    return "no mismatch detected"


# ----------------------------------------------------------------------------------------
# Harness


def test_results_come_back_in_rank_order_two_ranks() -> None:
    """Each rank's return value is returned at its rank's index, with gloo initialised."""
    assert run_on_ranks(2, _rank_info, "x") == [(0, 2, "gloo", "x"), (1, 2, "gloo", "x")]
    assert run_on_ranks(2, _all_reduce_rank_sum) == [3.0, 3.0]


def test_pool_reused_across_calls_same_world_size() -> None:
    """Consecutive calls with one world size run in the same worker processes."""
    first = run_on_ranks(2, _getpid)
    start = time.monotonic()
    second = run_on_ranks(2, _getpid)
    elapsed = time.monotonic() - start
    print(f"warm call took {elapsed * 1e3:.1f} ms")
    assert first == second == harness.pool_pids()
    assert len(set(first)) == 2 and os.getpid() not in first
    assert elapsed < 1.0


def test_env_applies_for_one_call_only() -> None:
    """``env`` is visible inside the call and gone afterwards."""
    name = "FULLSHARD_HARNESS_TEST_VAR"
    assert run_on_ranks(2, _read_env, name, env={name: "7"}) == ["7", "7"]
    assert run_on_ranks(2, _read_env, name) == [None, None]


def test_torch_state_reset_between_calls() -> None:
    """A call that changes the default dtype or grad mode does not leak into the next."""
    run_on_ranks(2, _dirty_torch_state)
    assert run_on_ranks(2, _torch_state) == [(torch.float32, True, 1)] * 2


def test_rank_exception_reraised_with_traceback_and_rank() -> None:
    """A rank's exception is re-raised with its rank, type, message and traceback."""
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _raise_on_rank_one)
    message = str(info.value)
    assert "rank 1 failed with ValueError" in message
    assert "ValueError: boom on rank 1" in message
    assert 'raise ValueError("boom on rank 1")' in message  # the source line
    assert "_raise_on_rank_one" in message
    assert info.value.exc_types == {1: "ValueError"}


def test_bare_assert_failure_shows_values_on_ranks() -> None:
    """Test modules are assert-rewritten in the workers, as pytest does in its process."""
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _bare_assert)
    assert "AssertionError: assert 40 == 42" in str(info.value)
    assert "AssertionError: assert 41 == 42" in str(info.value)


def test_pool_kept_after_failure_all_ranks_answered() -> None:
    """A failure every rank answered keeps the workers, with a fresh working group."""
    pids = run_on_ranks(2, _getpid)
    with pytest.raises(RankError, match="default group re-created"):
        run_on_ranks(2, _raise_on_rank_one)
    assert run_on_ranks(2, _getpid) == pids
    assert run_on_ranks(2, _all_reduce_rank_sum) == [3.0, 3.0]


def test_failure_reported_fast_when_peer_stuck_in_collective() -> None:
    """When one rank raises, a peer blocked in a collective costs only the grace period."""
    run_on_ranks(2, _getpid)  # warm pool, so the timing below excludes startup
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _all_reduce_unless_rank_one)
    elapsed = time.monotonic() - start
    print(f"failure with a stuck peer reported after {elapsed:.1f} s")
    message = str(info.value)
    assert "KeyError" in message and "ranks [0] did not answer" in message
    assert "worker pool was killed" in message
    assert "rank 0 stack when killed" in message and "_all_reduce_unless_rank_one" in message
    assert info.value.stuck_ranks == [0]
    assert elapsed < harness.FAILURE_GRACE_S + harness.STACK_DUMP_WAIT_S + 5.0


def test_hang_reported_within_timeout_and_pool_recovers() -> None:
    """A rank that never answers is killed after ``timeout``, its stack reported."""
    old_pids = run_on_ranks(2, _getpid)
    start = time.monotonic()
    with pytest.raises(RankTimeoutError) as info:
        run_on_ranks(2, _sleep_on_rank_one, 60.0, timeout=3.0)
    elapsed = time.monotonic() - start
    print(f"hang reported after {elapsed:.1f} s")
    message = str(info.value)
    assert "ranks [1] did not answer within the timeout of 3 s" in message
    assert "_sleep_on_rank_one" in message  # from the dumped stack
    assert elapsed < 3.0 + harness.STACK_DUMP_WAIT_S + 5.0
    new_pids = run_on_ranks(2, _getpid)
    assert set(new_pids).isdisjoint(old_pids)


def test_worker_output_shown_for_failing_rank() -> None:
    """What a failing rank printed appears in the error message and in our stdout."""
    with pytest.raises(RankError) as info:
        run_on_ranks(2, _print_and_fail)
    assert "hello from rank 0" in str(info.value) and "hello from rank 1" in str(info.value)


def test_skip_inside_ranks_skips_test() -> None:
    """``pytest.skip`` called on the ranks becomes a skip of the calling test."""
    with pytest.raises(pytest.skip.Exception, match="skipped inside the ranks"):
        run_on_ranks(2, _skip_everywhere)


def test_local_function_rejected_before_running() -> None:
    """A function that workers cannot import by name is refused with a clear error."""
    with pytest.raises(ValueError, match="importable by name"):
        run_on_ranks(2, lambda: 0)


def test_requires_cuda_gpus_reason_names_counts() -> None:
    """The skip marker says how many GPUs a test needs and how many exist."""
    mark = requires_cuda_gpus(1000).mark
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert mark.args == (True,)
    assert mark.kwargs["reason"] == f"needs 1000 CUDA GPUs, found {found}"


# ----------------------------------------------------------------------------------------
# Models


def test_models_deterministic_given_seed() -> None:
    """Two constructions from one seed are equal; another seed differs."""
    for cls in (NestedWrappedModule, NonUniformReqGradNWM, TransformerWithSharedParams):
        a, b, c = cls(seed=0).state_dict(), cls(seed=0).state_dict(), cls(seed=1).state_dict()
        assert all(torch.equal(a[fqn], b[fqn]) for fqn in a), cls.__name__
        assert not all(torch.equal(a[fqn], c[fqn]) for fqn in a), cls.__name__


def test_model_inputs_differ_by_rank_and_step() -> None:
    """``get_input`` depends on rank and step, and not on the global RNG."""
    model = TransformerWithSharedParams()
    base = model.get_input("cpu", rank=0, step=0)
    torch.manual_seed(123)
    assert all(torch.equal(x, y) for x, y in zip(base, model.get_input("cpu"), strict=True))
    assert not torch.equal(base[0], model.get_input("cpu", rank=1, step=0)[0])
    assert not torch.equal(base[0], model.get_input("cpu", rank=0, step=1)[0])


def test_transformer_output_proj_tied_to_embedding() -> None:
    """The output projection's weight is the embedding's parameter object."""
    model = TransformerWithSharedParams()
    assert model.output_proj.weight is model.embed_tokens.weight
    loss = model.get_loss(model.get_input("cpu"), model(*model.get_input("cpu")))
    assert loss.dim() == 0


def test_nested_wrap_replaces_targets_inner_first() -> None:
    """``nested_wrap`` wraps module.1.0, module.1 and module.2, inner before outer."""
    model = NestedWrappedModule()
    targets = model.wrap_targets()
    seen: list[nn.Module] = []

    def wrap(module: nn.Module) -> nn.Module:
        seen.append(module)
        return nn.Sequential(module)

    nested_wrap(model, wrap)
    assert seen == targets
    outer, inner = model.get_submodule("module.1"), targets[1]
    assert isinstance(outer, nn.Sequential) and isinstance(inner, nn.Sequential)
    assert outer[0] is inner and model.get_submodule("module.1.0.0.0") is targets[0]
    assert model.get_submodule("module.2.0") is targets[2]


def test_nonuniform_req_grad_freezes_all_but_last_linear() -> None:
    """Only module.2.1 trains; module.2.0 in the same wrap unit is frozen."""
    model = NonUniformReqGradNWM()
    trainable = [fqn for fqn, p in model.named_parameters() if p.requires_grad]
    assert trainable == ["module.2.1.weight", "module.2.1.bias"]


def test_dummy_process_group_reports_rank_and_size() -> None:
    """The dummy group answers rank/size and returns completed works."""
    group = DummyProcessGroup(rank=3, size=8)
    assert (group.rank(), group.size()) == (3, 8)
    work = group.allreduce([torch.ones(1)])
    assert work.wait() and work.get_future().value() == 1


# ----------------------------------------------------------------------------------------
# The parity routine itself, checked against torch's own FSDP


@pytest.mark.parametrize("kind", ["nested", "transformer"])
def test_check_ddp_parity_passes_torch_fsdp_full_shard(kind: str) -> None:
    """Check of the routine itself: torch's FSDP (FULL_SHARD) matches DDP for 2 steps."""
    losses = run_on_ranks(2, _torch_fsdp_parity, kind)
    assert len(losses) == 2 and all(len(per_rank) == 2 for per_rank in losses)
    assert losses[0] != losses[1]  # the ranks saw different data


def test_check_ddp_parity_detects_perturbed_parameter() -> None:
    """Check of the routine itself: a 1e-3 change to one parameter fails the check."""
    messages = run_on_ranks(2, _perturbed_parity_message)
    assert all("differs from DDP's" in m for m in messages), messages


def test_pools_of_other_world_sizes_stay_alive() -> None:
    """Asking for another world size starts another pool and keeps the first: the suite
    alternates world sizes from one parametrized test to the next."""
    two = run_on_ranks(2, _getpid)
    assert run_on_ranks(1, _rank_info, "solo") == [(0, 1, "gloo", "solo")]
    one = harness.pool_pids()
    assert len(one) == 1 and one[0] not in two
    assert run_on_ranks(2, _getpid) == two == harness.pool_pids()


def test_least_recently_used_pool_stops_beyond_the_kept_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Beyond ``KEPT_POOLS`` live pools, the least recently used one is stopped."""
    two = run_on_ranks(2, _getpid)
    monkeypatch.setattr(harness, "KEPT_POOLS", 1)
    run_on_ranks(1, _getpid)
    for pid in two:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped and reaped: no such process
    assert run_on_ranks(2, _getpid) != two


_KEPT_GROUPS: list[Any] = []


def _group_with_a_transport() -> int:
    """A group the call does not destroy, whose shared-memory transport stays mapped."""
    from fullshard._comm import collectives as comm

    group = dist.new_group([0, 1])
    comm.all_gather_into(torch.empty(2), torch.ones(1), group, "t").wait()
    _KEPT_GROUPS.append(group)
    return harness._mapped_shm_bytes(os.getpid())


@pytest.mark.skipif(
    not shm._ORDERED_STORES, reason="the transport runs on x86-64 only (see its note)"
)
def test_a_pool_that_maps_too_much_shared_memory_is_restarted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Groups that tests never destroy keep their transports' files mapped: past
    ``SHM_RECYCLE_BYTES`` the pool is restarted before its next call, under it it is kept."""
    monkeypatch.setattr(harness, "SHM_RECYCLE_BYTES", 2**62)
    first = run_on_ranks(2, _getpid)
    mapped = run_on_ranks(2, _group_with_a_transport, env={"FULLSHARD_SHM": "1"})
    assert min(mapped) > 0
    assert run_on_ranks(2, _getpid) == first
    monkeypatch.setattr(harness, "SHM_RECYCLE_BYTES", min(mapped) - 1)
    second = run_on_ranks(2, _getpid)
    assert not set(second) & set(first)
    assert run_on_ranks(2, _getpid) == second  # the new pool maps nothing yet


# It kills the 1-rank pool, which no later test here reuses.
def test_dead_worker_reported_with_exit_code() -> None:
    """A worker that dies mid-call is reported with its exit code; the next call recovers."""
    with pytest.raises(RankError, match=r"rank 0 failed with a dead worker") as info:
        run_on_ranks(1, _exit_abruptly, 3)
    assert "exit code 3" in str(info.value)
    assert harness.pool_pids() == []
