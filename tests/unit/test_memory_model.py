"""fullshard.memory: the analytical per-rank memory model (arithmetic, no ranks), and the
optimizer temporaries it counts, measured on torch's optimizers."""

from __future__ import annotations

import pytest
import torch
from live_bytes import NewTensorBytes

from fullshard import ShardingStrategy
from fullshard._comm.constants import SHARED_MEMORY_SLOTS
from fullshard.memory import communication_bytes, estimate, gpt_activations


def test_full_shard_splits_model_state_and_counts_units_in_flight() -> None:
    """FULL_SHARD on 4 ranks: shards of 1/4, Adam's 2 states, three unit-sized buffers in
    backward plus the root's parameters."""
    result = estimate([1000, 1000, 400], 4, root_numel=100)
    sharded = 250 + 250 + 100 + 25
    assert result.params == result.grads == sharded * 4
    assert result.optimizer == 2 * sharded * 4
    assert result.unsharded == (1000 + 100 + 2 * 1000) * 4
    assert result.transient == 1000 * 4  # the gradient copy-in of the largest unit
    held = result.grads + result.optimizer + result.unsharded + result.transient
    assert result.peak_added == held
    assert result.total == result.params + result.peak_added


def test_strategies_and_precision_change_what_is_unsharded() -> None:
    """NO_SHARD gathers nothing; SHARD_GRAD_OP keeps every unit; bf16 halves it."""
    no_shard = estimate([1000, 1000], 4, ShardingStrategy.NO_SHARD)
    assert no_shard.params == 2000 * 4 and no_shard.unsharded == 2 * 1000 * 4
    zero2 = estimate([1000, 1000], 4, ShardingStrategy.SHARD_GRAD_OP)
    assert zero2.unsharded == (2000 + 2 * 1000) * 4
    bf16 = estimate([1000, 1000], 4, compute_bytes=2)
    assert bf16.unsharded == estimate([1000, 1000], 4).unsharded // 2
    hybrid = estimate([1000], 8, ShardingStrategy.HYBRID_SHARD, shard_group_size=2)
    assert hybrid.params == 500 * 4


def test_offload_moves_model_state_off_the_device() -> None:
    """With parameter offload only unsharded units (and their gradients' copy-in) and
    activations stay on the device."""
    result = estimate([1000], 2, offload_params=True, activations=123)
    assert (result.params, result.grads, result.optimizer) == (0, 0, 0)
    assert result.peak_added == result.unsharded + 1000 * 4 + 123


def test_gpt_activations_scale_with_batch_and_depth() -> None:
    """Activations grow linearly in batch and (but for the head and workspace) in depth."""
    one = gpt_activations(1, 64, 128, 4, 4, 256, 4)
    assert gpt_activations(2, 64, 128, 4, 4, 256, 4) == 2 * one
    deeper = gpt_activations(1, 64, 128, 8, 4, 256, 4)
    per_block = (4 + 3 + 2 + 2 + 8) * 64 * 128 * 4
    assert deeper - one == 4 * per_block


def test_bad_world_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        estimate([1], 0)


def test_frozen_parameters_count_no_gradient_or_optimizer_state() -> None:
    """trainable_numels: gradients and Adam's state cover trainable shards only; a mixed
    unit's segments are padded on their own; units with frozen parameters reshard one unit
    later in backward."""
    result = estimate([1000, 1000, 400], 4, root_numel=100, trainable_numels=[10, 10, 0])
    # root all trainable (default): 25; units: trainable 3 + 3 + 0, frozen 248 + 248 + 100.
    assert result.grads == (3 + 3 + 0 + 25) * 4
    assert result.optimizer == 2 * result.grads
    assert result.params == (3 + 248 + 3 + 248 + 100 + 25) * 4
    # The root, the unit computing, the unit finishing (awaiting its inputs' gradients),
    # one prefetched unit, and one unit's gradient (10).
    assert result.unsharded == (100 + 1000 + 1000 + 1000 + 10) * 4
    every = estimate([1000, 1000, 400], 4, root_numel=100, trainable_numels=[1000, 1000, 400])
    assert every == estimate([1000, 1000, 400], 4, root_numel=100)


def test_frozen_parameters_send_no_gradient_bytes() -> None:
    """The reduction's bytes cover the trainable elements; the all-gathers still all."""
    full = communication_bytes([1000, 1000], 2, root_numel=0)
    frozen = communication_bytes([1000, 1000], 2, trainable_numels=[0, 0])
    assert full - frozen == 2000 * 4 // 2  # one reduce-scatter of every unit, (N - 1) / N
    no_shard = communication_bytes([1000], 2, "NO_SHARD", trainable_numels=[100])
    assert no_shard == 2 * 100 * 4 // 2


def test_trainable_numels_must_fit_their_units() -> None:
    with pytest.raises(ValueError, match="trainable_numels"):
        estimate([10, 10], 2, trainable_numels=[11, 0])
    with pytest.raises(ValueError, match="trainable_numels"):
        estimate([10, 10], 2, trainable_numels=[1])


def test_reshard_after_forward_to_k_ranks_keeps_a_kth_of_each_unit() -> None:
    """fully_shard(reshard_after_forward=k): FULL_SHARD's memory plus every unit's parameters
    over k ranks (compute dtype), and backward's all-gathers within those k ranks; only for
    the strategies that reshard after forward, and k must be a proper factor of the group."""
    units, world = [1000, 1000, 1001], 8
    full = estimate(units, world, "FULL_SHARD", root_numel=10, compute_bytes=2)
    kept = estimate(
        units, world, "FULL_SHARD", root_numel=10, compute_bytes=2, post_forward_shards=4
    )
    assert kept.unsharded - full.unsharded == (250 + 250 + 251) * 2
    assert (kept.params, kept.grads, kept.optimizer) == (full.params, full.grads, full.optimizer)
    sent = communication_bytes(units, world, "FULL_SHARD", root_numel=10)
    sent_kept = communication_bytes(
        units, world, "FULL_SHARD", root_numel=10, post_forward_shards=4
    )
    assert abs(sent - sent_kept - sum(units) * 4 * (7 / 8 - 3 / 4)) <= 1  # int rounding
    hybrid = estimate(units, 16, "HYBRID_SHARD", shard_group_size=8, post_forward_shards=2)
    assert (
        hybrid.unsharded - estimate(units, 16, "HYBRID_SHARD", shard_group_size=8).unsharded
        == (500 + 500 + 501) * 4
    )
    cell = 4 * 2**20  # CPU ranks of one host: the k-rank group's file as well
    on_cpu = {"shared_memory_cell_bytes": cell}
    big = [2**24] * 3
    extra = estimate(big, world, post_forward_shards=2, **on_cpu).staging
    assert extra - estimate(big, world, **on_cpu).staging == SHARED_MEMORY_SLOTS * 2 * cell
    for strategy, k in [
        ("SHARD_GRAD_OP", 4),
        ("FULL_SHARD", 3),
        ("FULL_SHARD", 8),
        ("FULL_SHARD", 1),
    ]:
        with pytest.raises(ValueError, match="post_forward_shards"):
            estimate(units, world, strategy, post_forward_shards=k)


def test_transient_tensors_of_the_step_by_door_and_precision() -> None:
    """[Note: transient tensors of the step]: Adam's two temporaries of the largest tensor
    the optimizer steps (FSDP1: a unit's flat shard; FSDP2: a parameter's shard), the
    gradient copy-in of either door (one unit, compute dtype), and with bf16 the cast
    all-gather inputs (two shards) and the reduced shard cast back to fp32."""
    units, root = [1000, 1000, 400], 100
    base = estimate(units, 4, root_numel=root)
    assert base.transient == 1000 * 4  # no optimizer temporaries asked for: the copy-in
    fsdp1 = estimate(units, 4, root_numel=root, optim_temporaries=2)
    assert fsdp1.transient == 2 * 250 * 4 + 1000 * 4
    assert fsdp1.peak_added == base.peak_added + 2 * 250 * 4
    fsdp2 = estimate(
        units, 4, root_numel=root, optim_temporaries=2, api="fsdp2", largest_param_numel=600
    )
    assert fsdp2.transient == 2 * 150 * 4 + 1000 * 4
    bf16 = estimate(units, 4, root_numel=root, compute_bytes=2, optim_temporaries=2)
    assert bf16.transient == 2 * 250 * 4 + 1000 * 2 + 2 * 250 * 2 + 250 * 4
    offloaded = estimate(units, 4, optim_temporaries=2, offload_params=True)
    assert offloaded.transient == 1000 * 4  # the step's temporaries run on the host
    with pytest.raises(ValueError, match="unknown api"):
        estimate(units, 4, api="fsdp3")


def test_plan_passes_the_door_and_the_optimizers_temporaries() -> None:
    """make_plan: Adam's 3 temporaries, SGD's none; both doors hold the copy-in gradient,
    fsdp2 steps per parameter (the MLP matrix, d_model x ffn, is the largest), and on CUDA
    either door through torch's foreach step: one temporary of all the trainable shards."""
    from fullshard.cli.plan import PRESETS, make_plan

    shape = PRESETS["bench-compute"]
    adam = make_plan(shape, 2, device="cpu").memory
    sgd = make_plan(shape, 2, optimizer="sgd", device="cpu").memory
    unit_shard = -(-shape.unit_numel // 2)
    assert adam.transient - sgd.transient == 3 * unit_shard * 4
    fsdp2 = make_plan(shape, 2, device="cpu", api="fsdp2").memory
    mlp_shard = shape.d_model * shape.ffn // 2
    assert fsdp2.transient == 3 * mlp_shard * 4 + shape.unit_numel * 4
    for api in ("fsdp1", "fsdp2"):
        on_cuda = make_plan(shape, 2, device="cuda", api=api).memory
        assert on_cuda.transient == on_cuda.grads + shape.unit_numel * 4  # Adam: grads' size


@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "sgd-momentum", "adagrad"])
@pytest.mark.parametrize("foreach", [False, True])
def test_optimizer_temporaries_are_what_torchs_optimizers_allocate(
    name: str, foreach: bool
) -> None:
    """The plan's tables of optimizer temporaries against the bytes torch's own optimizers
    allocate in a step (after the first, which builds the state): the single-tensor loop
    holds `_OPTIMIZER_TEMPORARIES` tensors of the largest parameter (the two largest side by
    side, as a model's units are), the foreach step `_FOREACH_TEMPORARIES` of all of them."""
    from fullshard.cli.plan import _FOREACH_TEMPORARIES, _OPTIMIZER_TEMPORARIES

    make = {
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.1, foreach=foreach),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=foreach),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=foreach),
        "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=foreach),
        "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1, foreach=foreach),
    }[name]
    sizes = [100, 300, 300, 50]
    params = [torch.nn.Parameter(torch.randn(n)) for n in sizes]
    for param in params:
        param.grad = torch.randn_like(param)
    optim = make(params)
    optim.step()
    state = [v for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
    with NewTensorBytes([*params, *(p.grad for p in params), *state]) as seen:
        optim.step()
    if foreach:
        assert seen.peak == _FOREACH_TEMPORARIES[name] * sum(sizes) * 4
    else:
        assert seen.peak == _OPTIMIZER_TEMPORARIES[name] * max(sizes) * 4


def test_flat_parameters_take_torchs_foreach_step_as_torchs_fsdp1_do() -> None:
    """fullshard's FlatParameter is on torch's list of types the optimizers' foreach step
    takes (torch's FSDP1 flat parameters are plain nn.Parameters, which are), and a foreach
    Adam step over flat parameters equals the single-tensor one."""
    from torch.optim.optimizer import _foreach_supported_types

    from fullshard._engine.flat_segment import FlatParameter

    assert FlatParameter in _foreach_supported_types
    steps = []
    for foreach in (False, True):
        torch.manual_seed(0)
        params = [FlatParameter(torch.randn(n)) for n in (5, 8)]
        optim = torch.optim.Adam(params, lr=0.1, foreach=foreach)
        for _ in range(2):
            for param in params:
                param.grad = torch.randn_like(param)
            optim.step()
        steps.append([p.detach().clone() for p in params])
    for single, multi in zip(*steps):
        torch.testing.assert_close(single, multi)
