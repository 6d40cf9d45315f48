"""A small GPT-style decoder-only transformer over bytes (vocab 256).

Pre-norm blocks of causal self-attention and an MLP, learned positional embeddings and an
output head tied to the token embedding, in the spirit of nanoGPT. `Block` is the unit the
training example hands to `ModuleWrapPolicy`, so each block becomes one FSDP unit and the
embeddings, final norm and tied head stay in the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "MLP", "Block", "CausalSelfAttention", "GPTConfig", "num_params"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model; the defaults train in minutes on two CPU ranks."""

    vocab_size: int = 256
    """Number of token ids; 256 for raw bytes."""
    seq_len: int = 128
    """Longest sequence the positional embedding covers."""
    d_model: int = 128
    """Width of the residual stream."""
    n_heads: int = 4
    """Attention heads; must divide `d_model`."""
    n_layers: int = 4
    """Number of transformer blocks."""
    mlp_ratio: int = 4
    """Hidden width of the MLP as a multiple of `d_model`."""

    def __post_init__(self) -> None:
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        for name in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: q, k and v projections, SDPA, output projection.

    q, k and v are three `nn.Linear`s rather than one fused ``qkv`` of ``3 * d_model``
    outputs, so that tensor parallelism can split each by output feature
    (``ColwiseParallel``): each rank then holds whole heads of q, k and v. A fused weight
    split that way would give the first rank all of q and half of k. State dicts of the
    fused layout (``attn.qkv.weight`` of shape (3C, C) and ``attn.qkv.bias`` (3C,), rows q,
    then k, then v) still load: a pre-hook splits them into the three (`_split_fused_qkv`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.q = nn.Linear(config.d_model, config.d_model)
        self.k = nn.Linear(config.d_model, config.d_model)
        self.v = nn.Linear(config.d_model, config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.register_load_state_dict_pre_hook(_split_fused_qkv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape  # (B, T, C)
        # Under tensor parallelism q, k and v hold this rank's heads only: (B, T, C / tp).
        q, k, v = self.q(x), self.k(x), self.v(x)  # 3 x (B, T, C')
        head_dim = x.shape[-1] // self.n_heads
        width = q.shape[-1]
        heads = width // head_dim  # this rank's heads
        q = q.view(batch, seq, heads, head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(batch, seq, heads, head_dim).transpose(1, 2)  # (B, H, T, D)
        v = v.view(batch, seq, heads, head_dim).transpose(1, 2)  # (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(batch, seq, width)  # (B, T, C')
        out: torch.Tensor = self.proj(y)  # (B, T, C)
        return out


def _split_fused_qkv(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    """Load-state-dict pre-hook: a fused ``qkv`` projection's weight (3C, C) and bias (3C,)
    become ``q``'s, ``k``'s and ``v``'s (rows 0..C-1, C..2C-1, 2C..3C-1), the layout this
    module had before it split them."""
    for kind in ("weight", "bias"):
        fused = state_dict.pop(f"{prefix}qkv.{kind}", None)
        if fused is None:
            continue
        if fused.shape[0] % 3:
            raise ValueError(
                f"{prefix}qkv.{kind} has {fused.shape[0]} rows, not 3 x d_model: it is no "
                "fused q, k, v projection of this model"
            )
        for name, piece in zip(("q", "k", "v"), fused.chunk(3, dim=0)):
            state_dict[f"{prefix}{name}.{kind}"] = piece


class MLP(nn.Module):
    """Position-wise feed-forward network with a GELU."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.d_model
        self.fc = nn.Linear(config.d_model, hidden)
        self.proj = nn.Linear(hidden, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(F.gelu(self.fc(x)))  # (B, T, C)
        return out


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_attn(x))  # (B, T, C)
        out: torch.Tensor = x + self.mlp(self.ln_mlp(x))  # (B, T, C)
        return out


class GPT(nn.Module):
    """Decoder-only language model; `forward` maps token ids (B, T) to logits (B, T, V).

    The output head shares its weight with the token embedding (weight tying), so the
    model holds one (V, C) matrix used twice; both users live in the root FSDP unit.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)
        # Residual projections get a smaller init so the stream's variance does not grow
        # with depth (GPT-2's scheme).
        for name, param in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / (2 * config.n_layers) ** 0.5)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        seq = idx.shape[1]  # idx: (B, T)
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence length {seq} exceeds the model's seq_len {self.config.seq_len}"
            )
        positions = torch.arange(seq, device=idx.device)  # (T,)
        x = self.tok_emb(idx) + self.pos_emb(positions)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits: torch.Tensor = self.lm_head(self.ln_f(x))  # (B, T, V)
        return logits


def num_params(model: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in model.parameters())
