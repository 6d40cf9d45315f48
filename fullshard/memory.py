"""An analytical model of each rank's training memory under fullshard.

Given the units' sizes, the world size, the strategy, the precisions and the optimizer, it
gives the bytes one rank holds at its peak, split the way they are allocated:

- ``params``: this rank's shard of every unit (the whole model with NO_SHARD), in the
  parameters' dtype; on the CPU with parameter offload.
- ``grads``: the sharded gradients, same size and dtype as the shards of the trainable
  parameters (all of them unless ``trainable_numels`` says otherwise).
- ``optimizer``: ``optim_states_per_param`` tensors of the trainable shard's size (Adam: 2).
- ``unsharded``: units whose full parameters or full gradients are alive at once. In
  backward, while unit k's gradient is computed, either unit k-1's parameters were
  prefetched (BACKWARD_PRE) or unit k+1's gradient is still being reduced (BACKWARD_POST,
  None): three buffers of the largest unit's size in the compute dtype (see
  ``_engine/runtime.reductions_in_flight``), plus the root unit's parameters, kept through the step
  (see [Note: the root keeps its parameters]). SHARD_GRAD_OP keeps every unit's parameters
  from forward to backward, plus two gradients. Unsharded gradients cover trainable elements
  only; a unit with frozen parameters reshards once its inputs' gradients are computed, so
  one more unit's parameters are alive as the next unit's backward begins (see [Note:
  resharding units with frozen parameters] in _engine/runtime.py). With ``fully_shard``'s
  ``reshard_after_forward=k`` (``post_forward_shards``), every unit also keeps its
  parameters sharded over ``k`` ranks (``1/k`` of each, compute dtype) from its forward to
  its backward: all of them are alive as backward begins.
- ``activations``: what the caller estimates for the model and batch (``gpt_activations``
  for the example GPT).
- ``staging``: CPU ranks of one host only (``shared_memory_cell_bytes``): the pages of the
  shared-memory transport's file this rank writes and reads (see
  [Note: shared-memory transport]): per slot, every rank's cell up to the largest piece;
  with ``post_forward_shards`` also the file of this rank's group of ``k``.

- ``transient``: short-lived tensors of the step that the terms above leave out (see
  [Note: transient tensors of the step]).

``peak_added`` is what training adds on top of the parameters already built:
``grads + optimizer + unsharded + activations + staging + transient``; the benchmark
compares it with the measured peak, for each door (``api``: ``"fsdp1"`` for
``FullyShardedDataParallel``, ``"fsdp2"`` for ``fully_shard``).

[Note: transient tensors of the step]
Three kinds, each allocated by code the model can name:

- the optimizer's temporaries (``optim_temporaries``): torch's Adam off CUDA runs its
  single-tensor loop (``foreach`` is for CUDA tensors only), which per parameter builds
  ``exp_avg_sq.sqrt()`` and its quotient by the bias correction before adding eps in place,
  while its loop variable ``denom`` still holds the previous parameter's quotient: three
  tensors of a parameter's size, in the parameters' dtype, counted at the largest's (the
  largest tensors come in neighbouring pairs: a model's equal units, an MLP's two matrices).
  The optimizer sees one flat shard per unit through ``FullyShardedDataParallel`` (the largest
  unit's shard) and each parameter's DTensor shard through ``fully_shard`` (the largest
  parameter's shard, ``largest_param_numel``). With ``optim_foreach`` the step is torch's
  ``foreach`` implementation, its default for CUDA tensors of the types it lists (plain
  tensors, ``nn.Parameter``, DTensor, and fullshard's ``FlatParameter``, which
  ``flat_segment`` adds as torch's FSDP1 flat parameters are plain ``nn.Parameter``s): either
  door's parameters on CUDA. Its
  temporaries are lists over every parameter at once: Adam's ``_foreach_sqrt`` of all the
  ``exp_avg_sq`` tensors is one tensor of the whole trainable shard (``optim_temporaries``
  then counts such lists: 1 for Adam). Not counted with parameter offload (the step runs on
  the host).
- the gradient copy-in: the backward of the node that made a unit's parameters from its
  flat buffer holds every parameter's gradient while it copies them into the one flat
  gradient that is reduce-scattered: one more unit-sized gradient in the compute dtype.
  Both doors: ``fully_shard``'s parameters are separate tensors (``_Unflatten.backward`` in
  ``_engine/dim0_unsharded.py``), ``FullyShardedDataParallel``'s are views of the flat
  buffer, split from it as ``torch.split`` does (``_SplitLeaf.backward`` in
  ``_engine/flat_segment.py``; autograd holds the views' gradients until the split's
  backward runs, as it did for ``torch.split``'s concatenation). Over the CPU's
  shared-memory transport the reduce-scatter reads the gradients where they lie instead
  ([Note: gradients reduced where autograd left them] in ``_engine/left_grads.py``): the
  flat gradient is fresh memory that is never written, and the parameters' gradients live
  until the reduce-scatter ends instead; the term is kept (the measured peaks did not move
  beyond their run-to-run spread; docs/benchmarks.md).
- mixed precision (``compute_bytes != param_bytes``): the all-gather's input is the shard
  cast to the compute dtype (``FlatSegment.unshard``), alive until the all-gather lands, for
  the unit being gathered and the one prefetched (two of the largest unit's shard, compute
  dtype); the reduced gradient shard is cast back to the parameters' dtype before it is
  added to the sharded gradient (``finalize_grad``: one of the largest unit's shard).

``api`` is the door (``"fsdp1"``, ``"fsdp2"``); ``optim_temporaries`` the tensors the
optimizer's step holds at its peak, per parameter (Adam off CUDA: 3; default 0), or with
``optim_foreach`` over all of them (Adam: 1); ``largest_param_numel`` the largest original
parameter (default: a whole unit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ._comm.constants import SHARED_MEMORY_CELL_BYTES as SHARED_MEMORY_CELL_BYTES
from ._comm.constants import SHARED_MEMORY_SLOTS

if TYPE_CHECKING:  # no torch at import: `fullshard plan` answers without loading it
    from .api import ShardingStrategy

__all__ = [
    "MemoryEstimate",
    "communication_bytes",
    "estimate",
    "gpt_activations",
    "tensor_parallel_bytes",
    "transformer_activations",
]

Strategy = Union["ShardingStrategy", str]
"""A `ShardingStrategy` or its name."""

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_KEEPS_UNSHARDED_AFTER_FORWARD = ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_PAGE = 4096
APIS = ("fsdp1", "fsdp2")
"""The doors: ``FullyShardedDataParallel`` and ``fully_shard``."""


def _strategy_name(strategy: Strategy) -> str:
    name = strategy if isinstance(strategy, str) else strategy.name
    if name not in STRATEGIES:
        raise ValueError(f"unknown sharding strategy {name!r}; choose from {', '.join(STRATEGIES)}")
    return name


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank at the training peak."""

    params: int
    grads: int
    optimizer: int
    unsharded: int
    activations: int
    staging: int = 0
    transient: int = 0
    """See [Note: transient tensors of the step]."""

    @property
    def peak_added(self) -> int:
        """What training adds to the parameters built before it (the measured quantity)."""
        held = self.grads + self.optimizer + self.unsharded + self.activations
        return held + self.staging + self.transient

    @property
    def total(self) -> int:
        return self.params + self.peak_added


def _shard(numel: int, num_shards: int) -> int:
    return -(-numel // num_shards)


def _trainable(
    unit_numels: list[int],
    root_numel: int,
    trainable_numels: list[int] | None,
    root_trainable_numel: int | None,
) -> list[int]:
    """Trainable elements per unit, the root last (all of them by default), checked."""
    trainable = [*unit_numels] if trainable_numels is None else [*trainable_numels]
    trainable.append(root_numel if root_trainable_numel is None else root_trainable_numel)
    numels = [*unit_numels, root_numel]
    if len(trainable) != len(numels) or not all(0 <= t <= n for t, n in zip(trainable, numels)):
        raise ValueError(
            f"trainable_numels {trainable[:-1]} (root {trainable[-1]}) must give, per unit of "
            f"unit_numels {unit_numels} (root {root_numel}), a count between 0 and its size"
        )
    return trainable


def _is_mixed(numel: int, trainable: int) -> bool:
    """The unit has frozen and trainable elements: two flat segments."""
    return 0 < trainable < numel


def estimate(
    unit_numels: list[int],
    world_size: int,
    strategy: Strategy = "FULL_SHARD",
    *,
    root_numel: int = 0,
    param_bytes: int = 4,
    compute_bytes: int | None = None,
    optim_states_per_param: int = 2,
    offload_params: bool = False,
    activations: int = 0,
    shard_group_size: int | None = None,
    reduce_bytes: int | None = None,
    shared_memory_cell_bytes: int = 0,
    trainable_numels: list[int] | None = None,
    root_trainable_numel: int | None = None,
    post_forward_shards: int | None = None,
    api: str = "fsdp1",
    optim_temporaries: int = 0,
    largest_param_numel: int | None = None,
    optim_foreach: bool = False,
) -> MemoryEstimate:
    """Per-rank peak memory of training with one FSDP unit per entry of ``unit_numels``
    (the root unit's own parameters in ``root_numel``). ``compute_bytes`` is the compute
    dtype's size (``MixedPrecision.param_dtype``; default ``param_bytes``);
    ``shard_group_size`` the ranks a unit is sharded over (hybrid strategies: the node
    size; default ``world_size``). With ``offload_params`` the shards, gradients and
    optimizer state are on the CPU and are not counted here. ``shared_memory_cell_bytes``
    (CPU ranks on one host: ``FULLSHARD_SHM_CELL_MIB``, 4 MiB by default; 0 otherwise)
    counts the shared-memory transport's staging; ``reduce_bytes`` is the gradients'
    reduction dtype's size (default ``compute_bytes``). ``trainable_numels`` (and
    ``root_trainable_numel``) give the elements of each unit that require grad when some
    are frozen (default: all): gradients and optimizer state count those only.
    ``post_forward_shards``: ``fully_shard(reshard_after_forward=k)``'s ``k``. ``api``,
    ``optim_temporaries``, ``largest_param_numel``, ``optim_foreach``: [Note: transient
    tensors of the step]."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    name = _strategy_name(strategy)
    compute_bytes = compute_bytes or param_bytes
    shards = _shard_ranks(name, world_size, shard_group_size)
    _check_post_forward(name, shards, post_forward_shards)
    trainable = _trainable(unit_numels, root_numel, trainable_numels, root_trainable_numel)
    params, grads, optimizer = (0, 0, 0) if offload_params else _model_state(
        [*unit_numels, root_numel], trainable, shards, param_bytes, optim_states_per_param
    )  # fmt: skip
    unsharded = _unsharded_numel(name, unit_numels, trainable, root_numel) * compute_bytes
    if post_forward_shards:
        unsharded += sum(_shard(n, post_forward_shards) for n in unit_numels) * compute_bytes
    staging = 0
    if shared_memory_cell_bytes and name != "NO_SHARD" and shards > 1:
        staging = _staging(
            unit_numels, trainable, shards, compute_bytes, reduce_bytes or compute_bytes,
            shared_memory_cell_bytes, post_forward_shards,
        )  # fmt: skip
    transient = _transient(
        api, unit_numels, trainable, shards, param_bytes, compute_bytes,
        0 if offload_params else optim_temporaries, largest_param_numel, optim_foreach,
    )  # fmt: skip
    return MemoryEstimate(params, grads, optimizer, unsharded, activations, staging, transient)


def _model_state(
    numels: list[int], trainable: list[int], shards: int, param_bytes: int, states: int
) -> tuple[int, int, int]:
    """Bytes of this rank's parameter shards, gradient shards and optimizer state."""
    # A mixed unit's trainable and frozen segments are padded and sharded on their own.
    sharded = sum(
        _shard(t, shards) + _shard(n - t, shards) if _is_mixed(n, t) else _shard(n, shards)
        for n, t in zip(numels, trainable)
    )
    sharded_trainable = sum(_shard(t, shards) for t in trainable)
    grads = sharded_trainable * param_bytes
    return sharded * param_bytes, grads, grads * states


def _transient(
    api: str,
    unit_numels: list[int],
    trainable: list[int],
    shards: int,
    param_bytes: int,
    compute_bytes: int,
    optim_temporaries: int,
    largest_param_numel: int | None,
    optim_foreach: bool = False,
) -> int:
    """Bytes of [Note: transient tensors of the step]: the optimizer's temporaries,
    ``fully_shard``'s gradient copy-in and mixed precision's cast shards."""
    if api not in APIS:
        raise ValueError(f"unknown api {api!r}; choose from {', '.join(APIS)}")
    largest = max(unit_numels, default=0)
    largest_grad = max(trainable[:-1], default=0)
    stepped = _shard(max(trainable), shards)  # FSDP1: one flat shard per unit (and root)
    if optim_foreach:  # one temporary per tensor, all alive at once
        stepped = sum(_shard(t, shards) for t in trainable)
    elif api == "fsdp2":
        stepped = _shard(min(largest_param_numel or max(trainable), max(trainable)), shards)
    transient = optim_temporaries * stepped * param_bytes
    transient += largest_grad * compute_bytes  # the gradient copy-in, either door
    if compute_bytes != param_bytes and shards > 1:
        transient += 2 * _shard(largest, shards) * compute_bytes
        transient += _shard(largest_grad, shards) * param_bytes
    return transient


def _staging(
    unit_numels: list[int],
    trainable: list[int],
    shards: int,
    compute_bytes: int,
    reduce_bytes: int,
    cell_bytes: int,
    post_forward_shards: int | None,
) -> int:
    """The shared-memory files' pages a rank touches: its shard group's (the largest
    gather or reduce-scatter piece) and, with ``post_forward_shards``, its k-rank group's."""
    largest = max(unit_numels, default=0)
    reduce_piece = (shards - 1) * _shard(max(trainable[:-1], default=0), shards) * reduce_bytes
    gather_piece = _shard(largest, shards) * compute_bytes
    staging = _file_bytes(shards, max(gather_piece, reduce_piece), cell_bytes)
    if post_forward_shards:
        k = post_forward_shards
        staging += _file_bytes(k, _shard(largest, k) * compute_bytes, cell_bytes)
    return staging


def _file_bytes(ranks: int, piece: int, cell_bytes: int) -> int:
    """The pages of a group's shared-memory file a rank touches: per slot, each rank's cell
    up to the largest piece."""
    touched = min(cell_bytes, piece)
    return SHARED_MEMORY_SLOTS * ranks * -(-touched // _PAGE) * _PAGE


def _unsharded_numel(
    name: str, unit_numels: list[int], trainable: list[int], root_numel: int
) -> int:
    """Peak elements of unsharded parameters and gradients in backward (see the module
    docstring): unit k's parameters and gradient, and unit k-1's prefetched parameters or
    unit k+1's gradient in reduction; with frozen parameters, unit k+1's parameters too."""
    largest = max(unit_numels, default=0)
    largest_grad = max(trainable[:-1], default=0)
    if name == "NO_SHARD":  # the shard is the whole unit: nothing is gathered
        return 2 * largest_grad
    if name in _KEEPS_UNSHARDED_AFTER_FORWARD:
        return root_numel + sum(unit_numels) + 2 * largest_grad  # kept from forward on
    # A unit with frozen parameters reshards once its inputs' gradients are computed too,
    # about when the next unit's backward begins: one more unit's parameters alive then.
    finishing = largest if any(t < n for n, t in zip(unit_numels, trainable)) else 0
    return root_numel + largest + finishing + largest_grad + largest


def _check_post_forward(name: str, shards: int, post_forward_shards: int | None) -> None:
    """``reshard_after_forward=k`` reshards after forward (FULL_SHARD, HYBRID_SHARD) to a
    group strictly between one rank and the shard group, which ``k`` divides."""
    if post_forward_shards is None:
        return
    if name not in ("FULL_SHARD", "HYBRID_SHARD"):
        raise ValueError(f"post_forward_shards applies to FULL_SHARD and HYBRID_SHARD, not {name}")
    if not 1 < post_forward_shards < shards or shards % post_forward_shards:
        raise ValueError(
            f"post_forward_shards must be a factor of the shard group's {shards} ranks between "
            f"2 and {shards - 1}, not {post_forward_shards} (1 is SHARD_GRAD_OP's memory, "
            f"{shards} FULL_SHARD's)"
        )


def _shard_ranks(name: str, world_size: int, shard_group_size: int | None) -> int:
    if name == "NO_SHARD":
        return 1
    if name in _HYBRID:
        shards = shard_group_size or world_size
        if world_size % shards:
            raise ValueError(
                f"{name}: world size {world_size} is not a multiple of the shard group size "
                f"{shards} (the ranks per node)"
            )
        return shards
    return world_size


def communication_bytes(
    unit_numels: list[int],
    world_size: int,
    strategy: Strategy = "FULL_SHARD",
    *,
    root_numel: int = 0,
    compute_bytes: int = 4,
    reduce_bytes: int | None = None,
    shard_group_size: int | None = None,
    trainable_numels: list[int] | None = None,
    root_trainable_numel: int | None = None,
    post_forward_shards: int | None = None,
) -> int:
    """Bytes one rank sends per training step (ring estimate, as ``fullshard._comm.collectives``
    counts them): with G ranks sharding a unit of B bytes, an all-gather or a reduce-scatter
    sends ``B (G - 1) / G``; an all-reduce twice that. FULL_SHARD gathers every unit twice
    (forward and backward; the root once) and reduce-scatters its gradient once;
    SHARD_GRAD_OP gathers once; NO_SHARD all-reduces the gradient; the hybrid strategies
    also all-reduce each gradient shard over the ``world_size / G`` replicas. Gradients are
    reduced for the trainable elements only (``trainable_numels``, ``root_trainable_numel``;
    default: all). With ``post_forward_shards`` (``k``) backward's all-gathers run within
    groups of ``k`` ranks."""
    name = _strategy_name(strategy)
    reduce_bytes = reduce_bytes or compute_bytes
    shards = _shard_ranks(name, world_size, shard_group_size)
    _check_post_forward(name, shards, post_forward_shards)
    total = sum(unit_numels) + root_numel
    reduced = sum(_trainable(unit_numels, root_numel, trainable_numels, root_trainable_numel))
    if name == "NO_SHARD":
        return int(2 * reduced * reduce_bytes * (world_size - 1) / world_size)
    gathers = total if name in _KEEPS_UNSHARDED_AFTER_FORWARD else 2 * sum(unit_numels) + root_numel
    backward_gathers = 0.0
    if post_forward_shards:  # backward's gathers move to the k-rank groups
        k = post_forward_shards
        gathers -= sum(unit_numels)
        backward_gathers = sum(unit_numels) * compute_bytes * (k - 1) / k
    within = (gathers * compute_bytes + reduced * reduce_bytes) * (shards - 1) / shards
    within += backward_gathers
    replicas = world_size // shards
    across = (
        2 * (reduced / shards) * reduce_bytes * (replicas - 1) / replicas if replicas > 1 else 0
    )
    return int(within + across)


def transformer_activations(
    batch: int,
    seq_len: int,
    d_model: int,
    n_layers: int,
    ffn: int,
    vocab: int,
    bytes_: int,
    *,
    gated_mlp: bool = False,
    checkpointed: bool = False,
    tp: int = 1,
) -> int:
    """Bytes autograd saves for backward in a pre-norm decoder with fused (flash) attention,
    no activation checkpointing, plus one block's gradient workspace. Per block, with
    ``N = batch * seq_len`` tokens: 11 tensors of ``N * d_model`` (2 layer-norm inputs and
    2 outputs, q, k and v, the attention output and the projection's input, the two
    residual sums) and the MLP's hidden tensors, 2 of ``N * ffn`` (before and after the
    activation; 3 with a gated MLP). The logits and their softmax, ``N * vocab`` each. With
    ``checkpointed`` (activation checkpointing per block) a block keeps only its input and
    one block's tensors exist at a time, while it is recomputed.

    With ``tp`` tensor-parallel ranks (torchtitan's plan: sequence parallel around the
    norms, heads and MLP columns split, loss parallel) every tensor is split ``tp`` ways
    except the two all-gathered inputs of the attention and MLP input projections, which
    autograd saves whole (2 of the 11)."""
    tokens = batch * seq_len
    split = 9 if tp > 1 else 11
    whole = 11 - split
    hidden = (3 if gated_mlp else 2) * tokens * ffn
    per_block = whole * tokens * d_model + _shard(split * tokens * d_model + hidden, tp)
    kept = _shard(tokens * d_model, tp)
    saved = n_layers * (kept if checkpointed else per_block)
    logits = _shard(2 * tokens * vocab, tp)
    return (saved + per_block + logits) * bytes_


def tensor_parallel_bytes(
    batch: int,
    seq_len: int,
    d_model: int,
    n_layers: int,
    bytes_: int,
    tp: int,
    *,
    checkpointed: bool = False,
) -> int:
    """Bytes one rank sends per step for ``tp``-way tensor parallelism with sequence
    parallel (torchtitan's plan; ring estimate): per block an all-gather before the
    attention and the MLP and a reduce-scatter after each in forward, the transposes in
    backward (8 collectives of ``batch * seq_len * d_model`` elements, 12 when activation
    checkpointing recomputes the forward), and 4 around the embedding and the head; each
    sends ``(tp - 1) / tp`` of the tensor."""
    if tp == 1:
        return 0
    collectives = (12 if checkpointed else 8) * n_layers + 4
    return int(collectives * batch * seq_len * d_model * bytes_ * (tp - 1) / tp)


def gpt_activations(
    batch: int, seq_len: int, d_model: int, n_layers: int, mlp_ratio: int, vocab: int, bytes_: int
) -> int:
    """Bytes autograd saves for backward in ``fullshard.examples.gpt.GPT``, plus the
    gradient workspace of one block. Per block, in units of ``batch * seq_len * d_model``
    elements: 2 layer-norm inputs and 2 outputs, the q, k and v projections (3), the attention
    output and the projection input (2), the two residual sums (2), and the MLP's hidden
    activation before and after the GELU (2 * mlp_ratio). The logits and their softmax
    (``batch * seq_len * vocab`` each) and one block's worth of gradients in flight."""
    return transformer_activations(
        batch, seq_len, d_model, n_layers, mlp_ratio * d_model, vocab, bytes_
    )
