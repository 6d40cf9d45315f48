"""An analytical model of each rank's training memory under fullshard.

Given the units' sizes, the world size, the strategy, the precisions and the optimizer, it
gives the bytes one rank holds at its peak, split the way they are allocated:

- ``params``: this rank's shard of every unit (the whole model with NO_SHARD), in the
  parameters' dtype; on the CPU with parameter offload.
- ``grads``: the sharded gradients, same size and dtype as the shards.
- ``optimizer``: ``optim_states_per_param`` tensors of the shard's size (Adam: 2).
- ``unsharded``: units whose full parameters or full gradients are alive at once. In
  backward, while unit k's gradient is computed, either unit k-1's parameters were
  prefetched (BACKWARD_PRE) or unit k+1's gradient is still being reduced (BACKWARD_POST,
  None): three buffers of the largest unit's size in the compute dtype (see
  ``_runtime.reductions_in_flight``), plus the root unit's parameters, kept through the step
  (see [Note: the root keeps its parameters]). SHARD_GRAD_OP keeps every unit's parameters
  from forward to backward, plus two gradients.
- ``activations``: what the caller estimates for the model and batch (``gpt_activations``
  for the example GPT).

``peak_added`` is what training adds on top of the parameters already built:
``grads + optimizer + unsharded + activations``; the benchmark compares it with the measured
peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from .api import ShardingStrategy

__all__ = ["MemoryEstimate", "estimate", "gpt_activations"]


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the training peak."""

    params: int
    grads: int
    optimizer: int
    unsharded: int
    activations: int

    @property
    def peak_added(self) -> int:
        """What training adds to the parameters built before it (the measured quantity)."""
        return self.grads + self.optimizer + self.unsharded + self.activations

    @property
    def total(self) -> int:
        return self.params + self.peak_added


def _shard(numel: int, num_shards: int) -> int:
    return -(-numel // num_shards)


def estimate(
    unit_numels: list[int],
    world_size: int,
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
    *,
    root_numel: int = 0,
    param_bytes: int = 4,
    compute_bytes: int | None = None,
    optim_states_per_param: int = 2,
    offload_params: bool = False,
    activations: int = 0,
    shard_group_size: int | None = None,
) -> MemoryEstimate:
    """Per-rank peak memory of training with one FSDP unit per entry of ``unit_numels``
    (the root unit's own parameters in ``root_numel``). ``compute_bytes`` is the compute
    dtype's size (``MixedPrecision.param_dtype``; default ``param_bytes``);
    ``shard_group_size`` the ranks a unit is sharded over (hybrid strategies: the node
    size; default ``world_size``). With ``offload_params`` the shards, gradients and
    optimizer state are on the CPU and are not counted here."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    compute_bytes = compute_bytes or param_bytes
    shards = shard_group_size or world_size
    if strategy == ShardingStrategy.NO_SHARD:
        shards = 1
    numels = [*unit_numels, root_numel]
    sharded = sum(_shard(numel, shards) for numel in numels)
    params = sharded * param_bytes
    grads = sharded * param_bytes
    optimizer = sharded * param_bytes * optim_states_per_param
    if offload_params:
        params = grads = optimizer = 0
    largest = max(unit_numels, default=0)
    if strategy == ShardingStrategy.NO_SHARD:
        unsharded_params = 0  # the shard is the whole unit: nothing is gathered
    elif strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2):
        unsharded_params = sum(numels)  # kept from forward to backward
    else:
        unsharded_params = largest + root_numel
    unsharded = (unsharded_params + 2 * largest) * compute_bytes
    return MemoryEstimate(params, grads, optimizer, unsharded, activations)


def gpt_activations(
    batch: int, seq_len: int, d_model: int, n_layers: int, mlp_ratio: int, vocab: int, bytes_: int
) -> int:
    """Bytes autograd saves for backward in ``fullshard.examples.gpt.GPT``, plus the
    gradient workspace of one block. Per block, in units of ``batch * seq_len * d_model``
    elements: 2 layer-norm inputs and 2 outputs, the qkv projection (3), the attention
    output and the projection input (2), the two residual sums (2), and the MLP's hidden
    activation before and after the GELU (2 * mlp_ratio). The logits and their softmax
    (``batch * seq_len * vocab`` each) and one block's worth of gradients in flight."""
    tokens_width = batch * seq_len * d_model
    per_block = (4 + 3 + 2 + 2 + 2 * mlp_ratio) * tokens_width
    logits = 2 * batch * seq_len * vocab
    return (n_layers * per_block + per_block + logits) * bytes_
