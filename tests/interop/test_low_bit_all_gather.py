"""torchao's float8 training under ``fully_shard``: its weights all-gather 1-byte float8
through FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``),
on CPU as torchao runs there. See [Note: all-gather extensions]."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from harness import run_on_ranks

_WIDTHS = (16, 32, 48, 16)
"""float8 matrix products need dims divisible by 16."""


def _float8_model() -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(_WIDTHS):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config)
    return model


def _train(
    api: str, steps: int, reshard_after_forward: bool | int = True
) -> tuple[nn.Module, list[float], float]:
    """Returns the model, the losses, and (fullshard) the all-gather bytes of the last step."""
    if api == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard  # type: ignore[assignment]
    from fullshard._comm.collectives import COUNTERS

    model = _float8_model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        COUNTERS.reset()
        batch = torch.randn(8, _WIDTHS[0], generator=torch.Generator().manual_seed(step))
        batch = batch + dist.get_rank()
        loss = model(batch).square().mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, losses, COUNTERS.bytes_sent["all_gather"]


def _float8_parity() -> None:
    ours, our_losses, gathered = _train("fullshard", 4)
    theirs, their_losses, _ = _train("torch", 4)
    assert our_losses == pytest.approx(their_losses, rel=1e-5), (our_losses, their_losses)
    for (name, mine), their in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(
            mine.to_local().float(), their.to_local().float(), msg=name, rtol=1e-5, atol=1e-6
        )
    # per step, each block's weight gathered twice (forward, backward) as float8 (1 byte per
    # element) and its bias as float32, every rank sending half: no float32 weight bytes
    num_ranks = dist.get_world_size()
    weights = sum(a * b for a, b in itertools.pairwise(_WIDTHS))
    biases = sum(_WIDTHS[1:])
    expected = 2 * (weights * 1 + biases * 4) * (num_ranks - 1) / num_ranks
    assert gathered == expected, (gathered, expected)


def test_torchao_float8_all_gathers_float8_bytes_and_trains_as_torch() -> None:
    """torchao's float8 training (``enable_fsdp_float8_all_gather``) on 2 ranks: 4 AdamW
    steps give torch's FSDP2 losses and parameters, and the all-gathers carry the float8
    weights' bytes (1 per element) plus the float32 biases', nothing more."""
    run_on_ranks(2, _float8_parity)


def _float8_post_forward() -> None:
    ours, our_losses, gathered = _train("fullshard", 3, reshard_after_forward=2)
    theirs, their_losses, _ = _train("torch", 3, reshard_after_forward=True)
    assert our_losses == pytest.approx(their_losses, rel=1e-5), (our_losses, their_losses)
    for (name, mine), their in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(
            mine.to_local().float(), their.to_local().float(), msg=name, rtol=1e-5, atol=1e-6
        )
    # float8 weights and float32 biases, forward over 4 ranks, backward over 2
    weights = sum(a * b for a, b in itertools.pairwise(_WIDTHS))
    biases = sum(_WIDTHS[1:])
    assert gathered == (weights * 1 + biases * 4) * (3 / 4 + 1 / 2), gathered
    with pytest.raises(NotImplementedError):  # torch keeps no extension's output over k
        _train("torch", 1, reshard_after_forward=2)


def test_torchao_float8_kept_over_k_ranks() -> None:
    """torchao's float8 weights with ``reshard_after_forward=2`` on 4 ranks, which torch's
    FSDP2 does not implement (its backward raises NotImplementedError): fullshard keeps
    each weight's float8 all-gather output over the pair between forward and backward,
    gathers within the pair in backward, and trains as torch does with
    ``reshard_after_forward=True``."""
    run_on_ranks(4, _float8_post_forward)


_SHAPES = ((12, 20), (20, 7), (7, 1))
"""(in, out) of three linears: 20 rows split evenly, 7 unevenly (4 and 3, padded to 4),
1 into a row and an empty shard."""


def _int8_train(
    api: str, compress: bool, reshard_after_forward: bool | int = True
) -> tuple[nn.Module, list[float], float]:
    if api == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard  # type: ignore[assignment]
    from fullshard._comm.collectives import COUNTERS
    from fullshard.compress import int8_all_gather

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(*_SHAPES[0]), nn.ReLU(), nn.Linear(*_SHAPES[1]), nn.ReLU(), nn.Linear(*_SHAPES[2])
    )
    if compress:
        assert int8_all_gather(model) == 3
    for index in (0, 2, 4):
        fully_shard(model[index], reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(5):
        COUNTERS.reset()
        batch = torch.randn(6, _SHAPES[0][0], generator=torch.Generator().manual_seed(step))
        loss = model(batch + dist.get_rank()).square().mean()
        if api == "fullshard" and compress:
            assert sum(_held_unsharded_bytes(model[index]) for index in (0, 2, 4)) == 0
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return model, losses, COUNTERS.bytes_sent["all_gather"]


def _held_unsharded_bytes(module: nn.Module) -> int:
    """Bytes the extension tensors of ``module``'s call hold (its weight's unit, beside its
    bias's): none between forward and backward, though autograd saved them."""
    from fullshard import fully_shard

    units = fully_shard.state(module).siblings  # type: ignore[attr-defined]
    assert len(units) == 1, "the weight's unit beside the bias's"
    kept = units[0].handle._extensions._kept
    assert kept, "the forward built the weight from its int8 all-gather"
    for segment in units[0].handle._segments:  # its values are in the weight's local tensor
        assert segment.flat_param._local_shard.untyped_storage().nbytes() == 4, "one zero"
    return sum(t.untyped_storage().nbytes() for k in kept.values() for t in k.to_free)


def _int8_parity() -> None:
    from fullshard.compress import Int8AllGatherWeight

    ours, our_losses, gathered = _int8_train("fullshard", compress=True)
    theirs, their_losses, _ = _int8_train("torch", compress=True)
    _, plain_losses, plain_gathered = _int8_train("fullshard", compress=False)
    assert our_losses == pytest.approx(their_losses, rel=1e-5), (our_losses, their_losses)
    for (name, mine), their in zip(ours.named_parameters(), theirs.parameters()):
        torch.testing.assert_close(mine.full_tensor(), their.full_tensor(), msg=name)
    assert isinstance(ours[0].weight.to_local(), Int8AllGatherWeight)
    # rounding to int8 moves the losses a little (these are near 0), not the training
    assert our_losses == pytest.approx(plain_losses, rel=5e-2), (our_losses, plain_losses)
    assert our_losses != plain_losses
    # per step, each weight gathered twice as int8 (1 byte per element, padded to whole rows
    # per rank) and the float32 biases as they are; evenly split weights gather a float32
    # scale per column per rank with their rows, the others' scales are one all-reduce
    num_ranks = dist.get_world_size()
    per_gather = 0.0
    for cols, rows in _SHAPES:
        padded_rows = -(-rows // num_ranks) * num_ranks
        per_gather += padded_rows * cols * 1 + padded_rows * 4  # weight + bias
        if rows % num_ranks == 0:
            per_gather += num_ranks * cols * 4
    assert gathered == 2 * per_gather * (num_ranks - 1) / num_ranks, gathered
    # biases stay fp32, and 10 rows per rank make the scales 40% of a weight's int8 bytes
    assert gathered < 0.4 * plain_gathered, (gathered, plain_gathered)


def test_int8_all_gather_sends_int8_rows_and_trains_as_torch() -> None:
    """``fullshard.compress.int8_all_gather``: weights all-gathered as int8 (float32
    scales per block) on 2 ranks, one with rows that do not split evenly and one with a
    single row (an empty shard on rank 1): 5 AdamW steps
    give torch's FSDP2 losses and parameters with the same subclass, within 5% of the
    uncompressed run's (near-zero) losses, and the all-gathers carry the int8 rows and the
    float32 biases: under 0.4x the uncompressed bytes. Between forward and backward the weights'
    unsharded tensors hold no storage (freed at reshard, refilled in place for backward), and
    the weights' unit's flat shard holds none at all."""
    run_on_ranks(2, _int8_parity)


def _int8_blocks() -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fullshard import fully_shard
    from fullshard.compress import int8_all_gather

    rank, num_ranks = dist.get_rank(), dist.get_world_size()
    layer = nn.Linear(5, 4 * num_ranks, bias=False)
    with torch.no_grad():  # rank r's rows are 10^r times rank 0's
        layer.weight.copy_(
            torch.randn(4 * num_ranks, 5, generator=torch.Generator().manual_seed(0))
        )
        layer.weight.mul_(torch.logspace(0, num_ranks - 1, num_ranks).repeat_interleave(4)[:, None])
    full = layer.weight.detach().clone()
    int8_all_gather(layer)
    fully_shard(layer)
    mesh = init_device_mesh("cpu", (num_ranks,))
    local = layer.weight.to_local()
    args = (mesh, full.shape, full.stride(), layer, None)
    inputs, metadata = local.fsdp_pre_all_gather(*args)
    assert metadata is None and [t.dtype for t in inputs] == [torch.int8, torch.float32]
    mine = full[4 * rank : 4 * rank + 4]
    torch.testing.assert_close(inputs[1], mine.abs().amax(0, keepdim=True) / 127)
    seen = []
    layer.register_forward_pre_hook(lambda module, _: seen.append(module.weight.detach().clone()))
    layer(torch.randn(2, 5)).sum().backward()
    (unsharded,) = seen
    for block in range(num_ranks):  # each rank's rows within half of its own scale step
        rows = slice(4 * block, 4 * block + 4)
        bound = full[rows].abs().amax(0) / 254 + 1e-6
        assert ((unsharded[rows] - full[rows]).abs() <= bound).all(), block


def test_int8_weights_are_quantized_in_blocks_of_each_ranks_rows() -> None:
    """[Note: int8 blocks] on 2 ranks: an evenly split weight's blocks are each rank's rows,
    with scales of their own, all-gathered with the rows: rank 1's rows are 10x rank 0's, and
    rank 0's rows still round within half of their own step (with one scale per column,
    they would round to a tenth of the precision)."""
    run_on_ranks(2, _int8_blocks)


def _int8_post_forward() -> None:
    from fullshard._comm.collectives import COUNTERS

    kept, kept_losses, kept_gathered = _int8_train("fullshard", True, reshard_after_forward=2)
    scales_all_reduced = COUNTERS.calls["all_reduce"]
    full, full_losses, _ = _int8_train("fullshard", True, reshard_after_forward=True)
    assert kept_losses == full_losses  # the same int8 values, gathered twice or kept
    for (name, mine), their in zip(kept.named_parameters(), full.parameters()):
        assert torch.equal(mine.to_local(), their.to_local()), name
    # forward over the 4 ranks, backward within each pair from what each rank kept: int8
    # rows and scales of the weights, the biases' float32 (padded over 4, then over 2)
    num_ranks, k = dist.get_world_size(), 2
    expected = 0.0
    for cols, rows in _SHAPES:
        weight = (
            -(-rows // num_ranks) * num_ranks * cols
            + (rows % num_ranks == 0) * num_ranks * cols * 4
        )
        expected += weight * ((num_ranks - 1) / num_ranks + (k - 1) / k)
        expected += -(-rows // num_ranks) * num_ranks * 4 * (num_ranks - 1) / num_ranks
        expected += -(-rows // k) * k * 4 * (k - 1) / k
    assert kept_gathered == expected, (kept_gathered, expected)
    # the unevenly split weights' scales: one all-reduce each in forward, none in backward
    assert scales_all_reduced == 2, scales_all_reduced


def test_int8_weights_kept_over_k_ranks_between_forward_and_backward() -> None:
    """``reshard_after_forward=2`` on 4 ranks with int8 weights (ZeRO++'s hpZ): after
    forward each rank keeps its half of its pair's gathered int8 rows and scales, and
    backward gathers them within the pair, with no second quantization (no scales
    all-reduce): the same losses and parameters as ``reshard_after_forward=True`` bit for
    bit, and the bytes of a forward over 4 ranks and a backward over 2."""
    run_on_ranks(4, _int8_post_forward)
