"""The models ``fullshard plan`` plans for: a decoder-only transformer's shape (`ModelShape`),
as far as memory is concerned, from a preset, a Hugging Face style ``config.json`` or a
parameter count. Pure arithmetic, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "PRESETS",
    "ModelShape",
    "gpt_shape",
    "human_count",
    "shape_from_count",
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

    def tp_problem(self, tp: int) -> str | None:
        """Why ``tp`` tensor-parallel ranks cannot split this shape's heads and MLP (None:
        they can)."""
        for what, count in (("attention heads", self.n_heads), ("kv heads", self.kv_heads)):
            if count % tp:
                return f"--tp {tp} does not divide the model's {count} {what}"
        if self.ffn % tp:
            return f"--tp {tp} does not divide the model's MLP width {self.ffn}"
        return None

    def unit_numel_per_tp_rank(self, tp: int) -> int:
        """One block's parameters on each of ``tp`` tensor-parallel ranks, under torchtitan's
        (Megatron's) plan: q, k, v and the MLP's input matrices split by output feature
        (``ColwiseParallel``: their weights' rows, and their biases), the attention and MLP
        output matrices by input feature (``RowwiseParallel``: their weights' columns; their
        biases, ``2 * d_model``, replicated), the norms replicated."""
        norms = 2 * (2 * self.d_model if self.layer_norm else self.d_model)
        replicated = norms + (2 * self.d_model if self.bias else 0)
        return -(-(self.unit_numel - replicated) // tp) + replicated

    def root_numel_per_tp_rank(self, tp: int) -> int:
        """The root unit's parameters on each of ``tp`` tensor-parallel ranks: the token
        embedding and an untied head split by vocabulary (their weights' rows, rounded up),
        learned positions and the final norm replicated."""
        d = self.d_model
        embeddings = -(-self.vocab // tp) * d * (1 if self.tied_embeddings else 2)
        return embeddings + self.root_numel - self.vocab * d * (1 if self.tied_embeddings else 2)


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
        f"{human_count(params)} params",
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


def human_count(count: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= size:
            return f"{count / size:.3g}{unit}"
    return str(int(count))
