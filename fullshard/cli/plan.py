"""``fullshard plan``: will this model fit on N devices with this strategy?

Per-rank bytes of parameters, gradients, optimizer state, unsharded units and activations,
and the bytes each rank sends per step, from the analytical model in `fullshard.memory`
(the one `fullshard bench` checks against measured peaks). The model is one of the
presets, a parameter count with a layer shape, or a Hugging Face style ``config.json``;
one FSDP unit per transformer block, the embeddings, final norm and head in the root unit.

``--api fsdp2`` plans ``fully_shard`` applied the same way (each block, then the root):
``--reshard-after-forward true`` is FULL_SHARD's memory and traffic, ``false``
SHARD_GRAD_OP's, and either with ``--shard-group-size`` (a 2-D (replicate, shard) mesh)
HYBRID_SHARD's or _HYBRID_SHARD_ZERO2's (see [Note: FSDP2's memory in the plan]); an int
``k`` is FULL_SHARD's (HYBRID_SHARD's) plus every unit's parameters kept sharded over ``k``
ranks from forward to backward, whose all-gathers then run within those ranks. ``--tp T``
(with fsdp2) plans tensor parallelism over T ranks inside each data-parallel rank, as
torchtitan composes it (``parallelize_module`` with sequence parallel, then
``fully_shard(block, mesh=world_mesh["dp"])``): each block and the root hold their
tensor-parallel piece, which ``fully_shard`` shards over the ``world_size / T``
data-parallel ranks; activations split T ways (see `transformer_activations`), and the
tensor-parallel traffic is its own row.

Pure arithmetic, no torch: a 70B model on 512 GPUs is answered in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

from ..memory import (
    SHARED_MEMORY_CELL_BYTES,
    STRATEGIES,
    MemoryEstimate,
    communication_bytes,
    estimate,
    tensor_parallel_bytes,
    transformer_activations,
)
from . import reshard_flag
from .plan_output import HYBRID_STRATEGIES as _HYBRID
from .plan_output import PlanResult, format_plan, parse_bytes, plot
from .plan_shapes import (
    PRESETS,
    ModelShape,
    gpt_shape,
    shape_from_count,
    shape_from_hf_config,
)

__all__ = [
    "PRESETS",
    "ModelShape",
    "PlanResult",
    "fsdp2_strategy",
    "gpt_shape",
    "main",
    "make_plan",
    "shape_from_hf_config",
    "tp_problem",
]


_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1}
_OPTIMIZER_TEMPORARIES = {"adam": 3, "adamw": 3, "sgd": 0, "sgd-momentum": 0, "adagrad": 2}
"""Tensors of a parameter's size alive at the peak of each optimizer's single-tensor step:
what it builds for one parameter (Adam: ``exp_avg_sq.sqrt()`` and its quotient; Adagrad:
``state_sum.sqrt()``) and the one its loop variable still holds from the parameter before
(Adam's ``denom``, Adagrad's ``std``). See [Note: transient tensors of the step] in
fullshard/memory.py; tests/unit/test_memory_model.py measures them on torch's optimizers."""
_FOREACH_TEMPORARIES = {"adam": 1, "adamw": 1, "sgd": 0, "sgd-momentum": 0, "adagrad": 2}
"""Tensors of the whole trainable shard each optimizer's ``foreach`` step builds (Adam:
``_foreach_sqrt(exp_avg_sqs)``; Adagrad: ``_foreach_sqrt(state_sums)`` and the step's
numerators): torch's default on CUDA, for either door's parameters (DTensors, flat
parameters)."""
_FSDP2_STRATEGIES = {
    # (2-D mesh, reshard_after_forward) -> the FSDP1 strategy with the same memory model
    (False, True): "FULL_SHARD",
    (False, False): "SHARD_GRAD_OP",
    (True, True): "HYBRID_SHARD",
    (True, False): "_HYBRID_SHARD_ZERO2",
}

# [Note: FSDP2's memory in the plan]
# fullshard's fully_shard runs on the FSDP1 engine with the parameters split on dim 0 instead
# of flattened, so the same units are gathered, kept and reduced: its memory is FULL_SHARD's
# (reshard_after_forward=True) or SHARD_GRAD_OP's (False), hybrid on a 2-D mesh. One thing
# differs: an unsharded parameter is its own tensor. Where the transport gathers into a
# buffer (gloo, rings; the shared-memory transport copies each peer's rows straight into the
# parameters), the parameters are copied out of it and then it is freed, so a unit's
# parameters exist twice for a moment. That moment stays within the peak modelled here when
# every parameter trains: in backward it comes as a unit waits for its all-gather, with the
# next unit's prefetch in flight and no gradient alive (three unit-sized buffers, as while a
# gradient is computed); in forward under SHARD_GRAD_OP, the last unit's buffer beside every
# unit's parameters is at most backward's two gradients. Measured (torch.profiler's count of
# CPU allocations over one step of `fullshard bench --config comm`'s model, 2 ranks, on the
# shared-memory transport and with FULLSHARD_SHM=0 alike): FSDP1 and FSDP2 both peak at
# 347.1 MiB (FULL_SHARD) and 539.3 MiB (SHARD_GRAD_OP) per rank. The resident set of CPU
# ranks grows more under FSDP2 (`fullshard bench --config comm`: 1008 vs 955 MiB FULL_SHARD,
# 1256 vs 1094 MiB SHARD_GRAD_OP; the plan's 842 and 1178 MiB are then 16% and 6% under):
# the per-parameter blocks fragment the heap, which this model does not count.
# reshard_after_forward=k adds every unit's parameters over k ranks (and, on CPU, the k-group's
# file). 4 CPU ranks, the comm model, 2 runs: medians 922 (k=2) and 710 MiB (True) per rank,
# 212 apart; the model: 766 and 542 MiB, 224 apart (totals 17% and 24% under, as above).
_TP_NOTES = (
    "tensor parallel as torchtitan plans it: q, k, v and the MLP's input matrices split by "
    "output feature, the output matrices by input feature, norms replicated, sequence "
    "parallel between blocks, "
    "the embedding and an untied head split by vocabulary; fully_shard shards each rank's "
    "piece over the data-parallel ranks of its column of the (dp, tp) mesh",
)
_FSDP2_NOTES = (
    "fully_shard runs fullshard's FSDP1 engine with parameters split on dim 0: this is the "
    "memory model of the FSDP1 strategy named above",
    "each unsharded parameter is its own tensor (copied out of the all-gathered buffer, which "
    "is then freed, where the transport gathers into one): a unit's parameters exist twice "
    "for a moment, within the peak above (allocator peaks measured equal to FSDP1's); CPU "
    "ranks' resident set was 5% (FULL_SHARD) to 15% (SHARD_GRAD_OP) above FSDP1's in "
    "`fullshard bench --config comm` (heap fragmentation, not modelled)",
)


def fsdp2_strategy(reshard_after_forward: bool, two_d_mesh: bool) -> str:
    """The FSDP1 strategy whose memory model ``fully_shard`` follows (see [Note: FSDP2's
    memory in the plan])."""
    return _FSDP2_STRATEGIES[(two_d_mesh, reshard_after_forward)]


def make_plan(
    shape: ModelShape,
    world_size: int,
    strategy: str = "FULL_SHARD",
    *,
    shard_group_size: int | None = None,
    param_dtype: str = "fp32",
    mixed_precision: str = "none",
    optimizer: str = "adam",
    cpu_offload: bool = False,
    batch: int = 1,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    device: str = "cuda",
    api: str = "fsdp1",
    post_forward_shards: int | None = None,
    tp: int = 1,
) -> PlanResult:
    """Per-rank memory and communication of training ``shape`` (see the module docstring).
    With ``api="fsdp2"``, ``strategy`` is the one `fsdp2_strategy` names,
    ``post_forward_shards`` is ``reshard_after_forward=k``'s ``k``, and ``tp`` the
    tensor-parallel ranks inside each data-parallel rank (``shard_group_size`` then counts
    data-parallel ranks)."""
    _check_api(api, strategy, post_forward_shards, tp_problem(shape, world_size, tp, api))
    param_bytes = _DTYPE_BYTES[param_dtype]
    compute_dtype = param_dtype if mixed_precision == "none" else mixed_precision
    compute_bytes = _DTYPE_BYTES[compute_dtype]
    seq_len = seq_len or shape.seq_len
    dp = world_size // tp  # fully_shard's ranks: each holds a tensor-parallel piece
    group = shard_group_size or dp
    units = [shape.unit_numel_per_tp_rank(tp)] * shape.n_layers
    root = shape.root_numel_per_tp_rank(tp)
    activations = _activations(shape, batch, seq_len, compute_bytes, activation_checkpointing, tp)
    foreach = device == "cuda"  # see _FOREACH_TEMPORARIES
    resident = estimate(
        units, dp, strategy, root_numel=root, param_bytes=param_bytes,
        compute_bytes=compute_bytes, optim_states_per_param=_OPTIMIZER_STATES[optimizer],
        activations=activations, shard_group_size=group,
        # CPU ranks of one host exchange through shared memory (its staging counts)
        shared_memory_cell_bytes=SHARED_MEMORY_CELL_BYTES if device == "cpu" else 0,
        post_forward_shards=post_forward_shards, api=api,
        optim_temporaries=(_FOREACH_TEMPORARIES if foreach else _OPTIMIZER_TEMPORARIES)[optimizer],
        largest_param_numel=_largest_param_per_tp_rank(shape, tp), optim_foreach=foreach,
    )  # fmt: skip
    memory, host = _offloaded(resident) if cpu_offload else (resident, 0)
    fsdp_bytes = communication_bytes(
        units, dp, strategy, root_numel=root, compute_bytes=compute_bytes,
        shard_group_size=group, post_forward_shards=post_forward_shards,
    )  # fmt: skip
    tp_bytes = tensor_parallel_bytes(
        batch, seq_len, shape.d_model, shape.n_layers, compute_bytes, tp,
        checkpointed=activation_checkpointing,
    )  # fmt: skip
    notes = (_FSDP2_NOTES + (_TP_NOTES if tp > 1 else ())) if api == "fsdp2" else ()
    shard_ranks = group if strategy in _HYBRID else dp
    return PlanResult(
        shape, world_size, strategy, shard_ranks, param_dtype, compute_dtype, cpu_offload,
        batch, seq_len, memory, host, fsdp_bytes, device, api, notes, post_forward_shards, tp,
        tp_bytes,
    )  # fmt: skip


def _largest_param_per_tp_rank(shape: ModelShape, tp: int) -> int:
    """The largest original parameter on each tensor-parallel rank: an MLP matrix or the
    token embedding (both split ``tp`` ways)."""
    return max(shape.d_model * shape.ffn, shape.vocab * shape.d_model) // tp


def _offloaded(resident: MemoryEstimate) -> tuple[MemoryEstimate, int]:
    """The model state moves to host memory (its bytes); the rest stays on the device."""
    host = resident.params + resident.grads + resident.optimizer
    return replace(resident, params=0, grads=0, optimizer=0), host


def _check_api(
    api: str, strategy: str, post_forward_shards: int | None, tp_error: str | None
) -> None:
    if tp_error:
        raise ValueError(tp_error)
    if api == "fsdp2" and strategy not in _FSDP2_STRATEGIES.values():
        raise ValueError(f"fully_shard has no {strategy}; see fsdp2_strategy")
    if post_forward_shards is not None and api != "fsdp2":
        raise ValueError("post_forward_shards is fully_shard's reshard_after_forward=k")


def tp_problem(shape: ModelShape, world_size: int | None, tp: int, api: str) -> str | None:
    """Why ``tp`` tensor-parallel ranks cannot be planned, in the command's flags (None: they
    can); `make_plan` raises it, ``fullshard plan`` and ``fullshard train`` report it as a
    usage error. ``world_size`` None: not known yet (``fullshard train`` checks it apart)."""
    if tp == 1:
        return None
    if tp < 1:
        return f"--tp must be positive, got {tp}"
    if api != "fsdp2":
        return f"--tp {tp} composes tensor parallelism with fully_shard: add --api fsdp2"
    if world_size is not None and world_size % tp:
        return f"--world-size {world_size} must be a multiple of --tp {tp}"
    problem = shape.tp_problem(tp)
    return f"{problem} ({shape.name}): pick a --tp that divides them" if problem else None


def _activations(
    shape: ModelShape, batch: int, seq_len: int, compute_bytes: int, checkpointed: bool, tp: int
) -> int:
    """Activation bytes per rank of ``shape``'s blocks (`transformer_activations`)."""
    return transformer_activations(
        batch,
        seq_len,
        shape.d_model,
        shape.n_layers,
        shape.ffn,
        shape.vocab,
        compute_bytes,
        gated_mlp=shape.gated_mlp,
        checkpointed=checkpointed,
        tp=tp,
    )


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--preset", choices=sorted(PRESETS), help="a named shape")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face style config.json")
    model.add_argument("--params", type=float, help="parameter count, e.g. 70e9")
    model.add_argument("--layers", type=int, help="with --params: transformer blocks")
    model.add_argument("--d-model", type=int, help="with --params: hidden width")
    model.add_argument("--ffn", type=int, help="with --params: MLP width (default: gated 8/3 d)")
    model.add_argument("--vocab", type=int, default=32000, help="with --params (default 32000)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    _add_model_arguments(parser)
    setup = parser.add_argument_group("setup")
    setup.add_argument("--world-size", type=int, default=8, help="ranks (default 8)")
    setup.add_argument(
        "--api",
        choices=["fsdp1", "fsdp2"],
        default="fsdp1",
        help="fsdp1: FullyShardedDataParallel with --strategy (default); fsdp2: fully_shard "
        "with --reshard-after-forward",
    )
    setup.add_argument(
        "--strategy", choices=STRATEGIES, default=None, help="fsdp1 (default FULL_SHARD)"
    )
    reshard_flag.add_argument(
        setup,
        help="fsdp2 (default true): true plans as FULL_SHARD, false as SHARD_GRAD_OP, an int K "
        "(a factor of the shard group's ranks) as FULL_SHARD plus the parameters kept sharded "
        "over K ranks from forward to backward",
    )
    setup.add_argument(
        "--shard-group-size",
        type=int,
        help="ranks a unit is sharded over (default: all): fsdp1's hybrid strategies; with "
        "fsdp2, a 2-D (replicate, shard) mesh (HSDP)",
    )
    setup.add_argument(
        "--tp",
        type=int,
        default=1,
        help="fsdp2: tensor-parallel ranks inside each data-parallel rank (default 1); "
        "fully_shard shards over --world-size / --tp ranks (--shard-group-size counts those)",
    )
    setup.add_argument("--param-dtype", choices=sorted(_DTYPE_BYTES), default="fp32")
    setup.add_argument(
        "--mixed-precision",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="compute and communication dtype (MixedPrecision.param_dtype; fsdp2: "
        "MixedPrecisionPolicy.param_dtype)",
    )
    setup.add_argument("--optimizer", choices=sorted(_OPTIMIZER_STATES), default="adam")
    setup.add_argument(
        "--cpu-offload",
        action="store_true",
        help="CPUOffload(offload_params=True); fsdp2: CPUOffloadPolicy()",
    )
    setup.add_argument("--batch", type=int, default=1, help="sequences per rank (default 1)")
    setup.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    setup.add_argument("--activation-checkpointing", action="store_true")
    setup.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="cpu: ranks on one host's CPUs with gloo (counts the shared-memory staging)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--device-memory", type=parse_bytes, help="e.g. 80GiB: say whether it fits")
    out.add_argument("--json", metavar="PATH", help="write the plan here")
    out.add_argument("--plot", metavar="PATH", help="PNG: memory per rank over world sizes")


def _shape(args: argparse.Namespace, parser: argparse.ArgumentParser) -> ModelShape:
    given = [name for name in ("preset", "hf_config", "params") if getattr(args, name) is not None]
    if len(given) != 1:
        parser.error("give exactly one of --preset, --hf-config, --params")
    if args.preset:
        return PRESETS[args.preset]
    if args.hf_config:
        return shape_from_hf_config(args.hf_config)
    if args.layers is None or args.d_model is None:
        parser.error("--params needs --layers and --d-model (the block shape)")
    return shape_from_count(
        int(args.params), args.layers, args.d_model, args.vocab, args.ffn, args.seq_len or 4096
    )


def _post_forward_at(args: argparse.Namespace, strategy: str, shard_ranks: int) -> int | None:
    """``--reshard-after-forward K``'s ranks at a shard group of ``shard_ranks`` (a size of
    ``--plot``'s sweep that K does not divide plans as true)."""
    k = args.reshard_after_forward
    if args.api != "fsdp2" or strategy not in ("FULL_SHARD", "HYBRID_SHARD"):
        return None
    if reshard_flag.factor_problem(k, shard_ranks):
        return None
    return reshard_flag.post_forward_shards(k, shard_ranks)[1]


def _strategy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """The memory model's strategy: ``--strategy`` (fsdp1), or the one ``fully_shard``'s
    options amount to (fsdp2)."""
    if args.api == "fsdp1":
        if args.reshard_after_forward is not None:
            parser.error(
                "--reshard-after-forward is fully_shard's option: add --api fsdp2, or with "
                "--api fsdp1 use --strategy FULL_SHARD (true) or SHARD_GRAD_OP (false)"
            )
        return str(args.strategy or "FULL_SHARD")
    if args.strategy is not None:
        parser.error(
            f"--strategy {args.strategy} is FullyShardedDataParallel's option; with --api fsdp2 "
            "use --reshard-after-forward true (FULL_SHARD) or false (SHARD_GRAD_OP), and "
            "--shard-group-size for a 2-D (replicate, shard) mesh (HYBRID_SHARD)"
        )
    shard_ranks = args.shard_group_size or args.world_size // args.tp
    k = args.reshard_after_forward
    problem = reshard_flag.factor_problem(k, shard_ranks)
    if problem:
        parser.error(
            f"{problem} (--reshard-after-forward: the ranks of the shard group, "
            "--shard-group-size or else --world-size / --tp)"
        )
    reshard, _ = reshard_flag.post_forward_shards(k, shard_ranks)
    return fsdp2_strategy(reshard, two_d_mesh=args.shard_group_size is not None)


def _check_sizes(
    args: argparse.Namespace, parser: argparse.ArgumentParser, shape: ModelShape
) -> None:
    """Sizes are positive, and ``--tp`` can split ``shape`` over the world (usage errors)."""
    for name in ("world_size", "batch", "seq_len", "shard_group_size", "layers", "d_model", "tp"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    problem = tp_problem(shape, args.world_size, args.tp, args.api)
    if problem:
        parser.error(problem)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    shape = _shape(args, parser)
    _check_sizes(args, parser, shape)
    strategy = _strategy(args, parser)
    hybrid = strategy in _HYBRID
    dp = args.world_size // args.tp
    if args.shard_group_size is not None and not hybrid:
        parser.error("--shard-group-size applies to HYBRID_SHARD and _HYBRID_SHARD_ZERO2 only")
    if hybrid and dp % (args.shard_group_size or dp):
        parser.error(
            f"--world-size {args.world_size} / --tp {args.tp} ({dp} data-parallel ranks) must "
            f"be a multiple of --shard-group-size {args.shard_group_size}"
        )

    def plan_for(world_size: int) -> PlanResult:
        group = args.shard_group_size
        if hybrid and group is not None:
            group = math.gcd(group, world_size // args.tp)
        return make_plan(
            shape,
            world_size,
            strategy,
            shard_group_size=group,
            param_dtype=args.param_dtype,
            mixed_precision=args.mixed_precision,
            optimizer=args.optimizer,
            cpu_offload=args.cpu_offload,
            batch=args.batch,
            seq_len=args.seq_len,
            activation_checkpointing=args.activation_checkpointing,
            device=args.device,
            api=args.api,
            post_forward_shards=_post_forward_at(args, strategy, group or world_size // args.tp),
            tp=args.tp,
        )

    plan = plan_for(args.world_size)
    print(format_plan(plan, args.device_memory))
    if args.json:
        record = asdict(plan)
        record["memory"]["total"] = plan.memory.total
        record["memory"]["peak_added"] = plan.memory.peak_added
        record["shape"]["params"] = shape.params
        record["reshard_after_forward"] = (
            plan.reshard_after_forward if args.api == "fsdp2" else None
        )
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.plot:
        sizes = sorted(
            n
            for n in {2**k for k in range(int(math.log2(args.world_size)) + 1)} | {args.world_size}
            if n % args.tp == 0
        )
        plot({n: plan_for(n) for n in sizes}, args.plot, args.device_memory)
        print(f"\nchart: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fullshard plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)
