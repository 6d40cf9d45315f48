"""``fullshard plan``: will this model fit on N devices with this strategy?

Per-rank bytes of parameters, gradients, optimizer state, unsharded units and activations,
and the bytes each rank sends per step, from the analytical model in `fullshard.memory`
(the one `fullshard bench` checks against measured peaks). The model is one of the
presets, a parameter count with a layer shape, or a Hugging Face style ``config.json``;
one FSDP unit per transformer block, the embeddings, final norm and head in the root unit.

Pure arithmetic, no torch: a 70B model on 512 GPUs is answered in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from ..memory import (
    SHARED_MEMORY_CELL_BYTES,
    STRATEGIES,
    MemoryEstimate,
    communication_bytes,
    estimate,
    transformer_activations,
)

__all__ = [
    "PRESETS",
    "ModelShape",
    "PlanResult",
    "gpt_shape",
    "main",
    "make_plan",
    "shape_from_hf_config",
]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, as far as memory is concerned."""

    name: str
    n_layers: int
    d_model: int
    ffn: int
    vocab: int
    n_heads: int
    kv_heads: int
    seq_len: int
    """Default sequence length for activations (the context the model was built for)."""
    gated_mlp: bool = False
    """SwiGLU-style MLP: three ``d_model x ffn`` matrices instead of two."""
    tied_embeddings: bool = True
    learned_positions: bool = False
    """A ``seq_len x d_model`` positional embedding in the root unit (GPT-2 style)."""
    bias: bool = False
    layer_norm: bool = False
    """LayerNorm (weight and bias) instead of RMSNorm (weight only)."""
    unit_numel_override: int | None = None
    """For shapes given as a parameter count: the block size derived from it."""

    @property
    def unit_numel(self) -> int:
        """Parameters of one transformer block (one FSDP unit)."""
        if self.unit_numel_override is not None:
            return self.unit_numel_override
        d, f = self.d_model, self.ffn
        kv_dim = d * self.kv_heads // self.n_heads
        attention = 2 * d * d + 2 * d * kv_dim
        mlp = (3 if self.gated_mlp else 2) * d * f
        norms = 2 * (2 * d if self.layer_norm else d)
        biases = (d + 2 * kv_dim + d + f + d + (f if self.gated_mlp else 0)) if self.bias else 0
        return attention + mlp + norms + biases

    @property
    def root_numel(self) -> int:
        """Embeddings, final norm and (untied) head: the root unit's own parameters."""
        d = self.d_model
        embeddings = self.vocab * d * (1 if self.tied_embeddings else 2)
        positions = self.seq_len * d if self.learned_positions else 0
        return embeddings + positions + (2 * d if self.layer_norm else d)

    @property
    def params(self) -> int:
        return self.n_layers * self.unit_numel + self.root_numel


def gpt_shape(name: str, n_layers: int, d_model: int, n_heads: int, seq_len: int) -> ModelShape:
    """The shape of `fullshard.examples.gpt.GPT` (byte vocabulary, tied head, learned
    positions, LayerNorm, biases, GELU MLP of 4 x ``d_model``)."""
    return ModelShape(
        name,
        n_layers,
        d_model,
        4 * d_model,
        256,
        n_heads,
        n_heads,
        seq_len,
        tied_embeddings=True,
        learned_positions=True,
        bias=True,
        layer_norm=True,
    )


def _llama(name: str, n_layers: int, d_model: int, ffn: int, n_heads: int, kv: int) -> ModelShape:
    return ModelShape(name, n_layers, d_model, ffn, 32000, n_heads, kv, 4096, True, False)


PRESETS: dict[str, ModelShape] = {
    # fullshard.examples.gpt.GPT shapes; `fullshard train --preset` builds these.
    "tiny": gpt_shape("tiny", 2, 64, 4, 64),
    "small": gpt_shape("small", 4, 128, 4, 128),
    "medium": gpt_shape("medium", 6, 384, 6, 256),
    "100m": gpt_shape("100m", 8, 1024, 16, 256),
    # The benchmark's two configurations (`fullshard bench --config comm|compute`).
    "bench-comm": gpt_shape("bench-comm", 8, 1024, 8, 64),
    "bench-compute": gpt_shape("bench-compute", 6, 256, 8, 128),
    # Published shapes, for planning.
    "llama2-7b": _llama("llama2-7b", 32, 4096, 11008, 32, 32),
    "llama2-13b": _llama("llama2-13b", 40, 5120, 13824, 40, 40),
    "llama2-70b": _llama("llama2-70b", 80, 8192, 28672, 64, 8),
}


def shape_from_hf_config(path: str | Path) -> ModelShape:
    """A `ModelShape` from a Hugging Face style ``config.json`` (Llama, Mistral, Qwen2,
    GPT-2, GPT-NeoX, OPT and the like: the usual key spellings)."""
    try:
        config: dict[str, Any] = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SystemExit(f"fullshard plan: --hf-config {path}: no such file") from None
    except json.JSONDecodeError as error:
        raise SystemExit(f"fullshard plan: --hf-config {path} is not JSON: {error}") from None

    def pick(*keys: str, default: Any = None) -> Any:
        for key in keys:
            if config.get(key) is not None:
                return config[key]
        if default is None:
            raise SystemExit(
                f"fullshard plan: --hf-config {path} has none of {', '.join(keys)}; "
                "it must describe a decoder-only transformer"
            )
        return default

    d_model = int(pick("hidden_size", "n_embd", "d_model"))
    n_heads = int(pick("num_attention_heads", "n_head", "num_heads"))
    model_type = str(config.get("model_type", ""))
    activation = str(config.get("hidden_act", config.get("activation_function", "")))
    gpt2_like = model_type in ("gpt2", "gpt_neox", "opt", "gptj", "bloom", "falcon")
    return ModelShape(
        name=str(pick("_name_or_path", "model_type", default=Path(path).stem)),
        n_layers=int(pick("num_hidden_layers", "n_layer", "num_layers")),
        d_model=d_model,
        ffn=int(pick("intermediate_size", "n_inner", "ffn_dim", default=4 * d_model)),
        vocab=int(pick("vocab_size")),
        n_heads=n_heads,
        kv_heads=int(pick("num_key_value_heads", default=n_heads)),
        seq_len=int(pick("max_position_embeddings", "n_positions", "n_ctx", default=2048)),
        gated_mlp=activation in ("silu", "swiglu", "swish") or "gate" in activation,
        tied_embeddings=bool(config.get("tie_word_embeddings", gpt2_like)),
        learned_positions=model_type in ("gpt2", "opt"),
        bias=bool(config.get("bias", config.get("attention_bias", gpt2_like))),
        layer_norm=gpt2_like,
    )


def shape_from_count(
    params: int, n_layers: int, d_model: int, vocab: int, ffn: int | None, seq_len: int
) -> ModelShape:
    """A model of ``params`` parameters in ``n_layers`` equal blocks of width ``d_model``
    (Llama-style: untied head, gated MLP when ``ffn`` is not given)."""
    shape = ModelShape(
        f"{_human_count(params)} params",
        n_layers,
        d_model,
        ffn or 8 * d_model // 3,
        vocab,
        1,
        1,
        seq_len,
        gated_mlp=ffn is None,
        tied_embeddings=False,
    )
    per_block = (params - shape.root_numel) // n_layers
    if per_block <= 0:
        raise SystemExit(
            f"fullshard plan: --params {params} is smaller than the embeddings alone "
            f"({shape.root_numel} = 2 x vocab {vocab} x d_model {d_model})"
        )
    return replace(shape, unit_numel_override=per_block)


_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1, "adagrad": 1}


@dataclass(frozen=True)
class PlanResult:
    """One rank's memory and traffic for one configuration."""

    shape: ModelShape
    world_size: int
    strategy: str
    shard_group_size: int
    param_dtype: str
    compute_dtype: str
    cpu_offload: bool
    batch: int
    seq_len: int
    memory: MemoryEstimate
    host_bytes: int
    """Model state kept in host memory with ``cpu_offload`` (params, grads, optimizer)."""
    comm_bytes_per_step: int
    device: str = "cuda"

    @property
    def device_total(self) -> int:
        return self.memory.total


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
) -> PlanResult:
    """Per-rank memory and communication of training ``shape`` (see the module docstring)."""
    param_bytes = _DTYPE_BYTES[param_dtype]
    compute_dtype = param_dtype if mixed_precision == "none" else mixed_precision
    compute_bytes = _DTYPE_BYTES[compute_dtype]
    seq_len = seq_len or shape.seq_len
    group = shard_group_size or world_size
    activations = _activations(shape, batch, seq_len, compute_bytes, activation_checkpointing)
    resident = estimate(
        [shape.unit_numel] * shape.n_layers,
        world_size,
        strategy,
        root_numel=shape.root_numel,
        param_bytes=param_bytes,
        compute_bytes=compute_bytes,
        optim_states_per_param=_OPTIMIZER_STATES[optimizer],
        activations=activations,
        shard_group_size=group,
        # CPU ranks of one host exchange through shared memory (its staging counts)
        shared_memory_cell_bytes=SHARED_MEMORY_CELL_BYTES if device == "cpu" else 0,
    )
    memory, host = resident, 0
    if cpu_offload:  # the model state moves to host memory; the rest stays on the device
        host = resident.params + resident.grads + resident.optimizer
        memory = replace(resident, params=0, grads=0, optimizer=0)
    return PlanResult(
        shape,
        world_size,
        strategy,
        group if strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") else world_size,
        param_dtype,
        compute_dtype,
        cpu_offload,
        batch,
        seq_len,
        memory,
        host,
        _comm_bytes(shape, world_size, strategy, compute_bytes, group),
        device,
    )


def _activations(
    shape: ModelShape, batch: int, seq_len: int, compute_bytes: int, checkpointed: bool
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
    )


def _comm_bytes(
    shape: ModelShape, world_size: int, strategy: str, compute_bytes: int, shard_group_size: int
) -> int:
    """Bytes each rank sends per step (a ring estimate)."""
    return communication_bytes(
        [shape.unit_numel] * shape.n_layers,
        world_size,
        strategy,
        root_numel=shape.root_numel,
        compute_bytes=compute_bytes,
        shard_group_size=shard_group_size,
    )


# -- output ---------------------------------------------------------------------------------


def _human_count(count: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(int(count))


def human_bytes(num: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size:
            return f"{num / size:.2f} {unit}"
    return f"{int(num)} B"


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5TiB', '4096' -> bytes (GB and GiB both mean 2**30 here)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 80GiB, 24GB, 512MiB)")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * 1024**power)


def format_plan(plan: PlanResult, device_memory: int | None = None) -> str:
    shape, memory = plan.shape, plan.memory
    hybrid = ""
    if plan.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        hybrid = f" (shard over {plan.shard_group_size}, replicate x{plan.world_size // plan.shard_group_size})"
    lines = [
        f"model: {shape.name}: {_human_count(shape.params)} parameters, {shape.n_layers} blocks "
        f"of {_human_count(shape.unit_numel)} (one FSDP unit each), root unit "
        f"{_human_count(shape.root_numel)}",
        f"setup: {plan.world_size} ranks, {plan.strategy}{hybrid}, params {plan.param_dtype}, "
        f"compute {plan.compute_dtype}, cpu offload {'on' if plan.cpu_offload else 'off'}, "
        f"batch {plan.batch} x {plan.seq_len} tokens per rank",
        "",
        "| per rank | bytes |",
        "|---|---|",
        f"| parameters (shard) | {human_bytes(memory.params)} |",
        f"| gradients (shard) | {human_bytes(memory.grads)} |",
        f"| optimizer state | {human_bytes(memory.optimizer)} |",
        f"| unsharded units (params and grads in flight) | {human_bytes(memory.unsharded)} |",
        f"| activations (estimate) | {human_bytes(memory.activations)} |",
    ]
    if memory.staging:
        lines.append(f"| shared-memory transport staging | {human_bytes(memory.staging)} |")
    lines += [
        f"| **{'host' if plan.device == 'cpu' else 'device'} total** | "
        f"**{human_bytes(memory.total)}** |",
    ]
    if plan.cpu_offload:
        lines.append(
            f"| host memory (offloaded params, grads, optimizer) | {human_bytes(plan.host_bytes)} |"
        )
    lines.append(f"| sent per step (ring estimate) | {human_bytes(plan.comm_bytes_per_step)} |")
    if device_memory is not None:
        verdict = "fits" if memory.total <= device_memory else "does NOT fit"
        lines += [
            "",
            f"{verdict} in {human_bytes(device_memory)} per device "
            f"({100 * memory.total / device_memory:.0f}% used)",
        ]
    return "\n".join(lines)


def _plot(plan_at: dict[int, PlanResult], path: str, device_memory: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(plan_at)
    parts = {
        "parameters": [plan_at[n].memory.params for n in sizes],
        "gradients": [plan_at[n].memory.grads for n in sizes],
        "optimizer": [plan_at[n].memory.optimizer for n in sizes],
        "unsharded units": [plan_at[n].memory.unsharded for n in sizes],
        "activations": [plan_at[n].memory.activations for n in sizes],
        "shared-memory staging": [plan_at[n].memory.staging for n in sizes],
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(n) for n in sizes]
    bottom = [0.0] * len(sizes)
    for name, values in parts.items():
        gib = [v / 2**30 for v in values]
        ax.bar(labels, gib, bottom=bottom, label=name)
        bottom = [b + g for b, g in zip(bottom, gib)]
    if device_memory is not None:
        ax.axhline(device_memory / 2**30, color="black", linestyle="--", label="device memory")
    last = plan_at[sizes[-1]]
    ax.set_xlabel("ranks")
    ax.set_ylabel("GiB per rank")
    ax.set_title(
        f"{last.shape.name}: {last.strategy}, compute {last.compute_dtype}, "
        f"batch {last.batch}x{last.seq_len}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--preset", choices=sorted(PRESETS), help="a named shape")
    model.add_argument("--hf-config", metavar="PATH", help="a Hugging Face style config.json")
    model.add_argument("--params", type=float, help="parameter count, e.g. 70e9")
    model.add_argument("--layers", type=int, help="with --params: transformer blocks")
    model.add_argument("--d-model", type=int, help="with --params: hidden width")
    model.add_argument("--ffn", type=int, help="with --params: MLP width (default: gated 8/3 d)")
    model.add_argument("--vocab", type=int, default=32000, help="with --params (default 32000)")
    setup = parser.add_argument_group("setup")
    setup.add_argument("--world-size", type=int, default=8, help="ranks (default 8)")
    setup.add_argument("--strategy", choices=STRATEGIES, default="FULL_SHARD")
    setup.add_argument(
        "--shard-group-size",
        type=int,
        help="hybrid strategies: ranks a unit is sharded over (default: all)",
    )
    setup.add_argument("--param-dtype", choices=sorted(_DTYPE_BYTES), default="fp32")
    setup.add_argument(
        "--mixed-precision",
        choices=["none", "bf16", "fp16"],
        default="none",
        help="compute and communication dtype (MixedPrecision.param_dtype)",
    )
    setup.add_argument("--optimizer", choices=sorted(_OPTIMIZER_STATES), default="adam")
    setup.add_argument("--cpu-offload", action="store_true", help="CPUOffload(offload_params=True)")
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


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    shape = _shape(args, parser)
    for name in ("world_size", "batch", "seq_len", "shard_group_size", "layers", "d_model"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    hybrid = args.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
    if args.shard_group_size is not None and not hybrid:
        parser.error("--shard-group-size applies to HYBRID_SHARD and _HYBRID_SHARD_ZERO2 only")
    if hybrid and args.world_size % (args.shard_group_size or args.world_size):
        parser.error(
            f"--world-size {args.world_size} must be a multiple of --shard-group-size "
            f"{args.shard_group_size}"
        )

    def plan_for(world_size: int) -> PlanResult:
        group = args.shard_group_size
        if hybrid and group is not None:
            group = math.gcd(group, world_size)
        return make_plan(
            shape,
            world_size,
            args.strategy,
            shard_group_size=group,
            param_dtype=args.param_dtype,
            mixed_precision=args.mixed_precision,
            optimizer=args.optimizer,
            cpu_offload=args.cpu_offload,
            batch=args.batch,
            seq_len=args.seq_len,
            activation_checkpointing=args.activation_checkpointing,
            device=args.device,
        )

    plan = plan_for(args.world_size)
    print(format_plan(plan, args.device_memory))
    if args.json:
        record = asdict(plan)
        record["memory"]["total"] = plan.memory.total
        record["memory"]["peak_added"] = plan.memory.peak_added
        record["shape"]["params"] = shape.params
        Path(args.json).write_text(json.dumps(record, indent=1))
    if args.plot:
        sizes = sorted(
            {2**k for k in range(int(math.log2(args.world_size)) + 1)} | {args.world_size}
        )
        _plot({n: plan_for(n) for n in sizes}, args.plot, args.device_memory)
        print(f"\nchart: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fullshard plan", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), parser)
