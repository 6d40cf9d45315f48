"""The example GPT's attention layout: separate q, k, v projections, and state dicts of the
earlier fused ``qkv`` projection still loading (no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fullshard.examples.gpt import GPT, CausalSelfAttention, GPTConfig

CONFIG = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=4, n_layers=2, mlp_ratio=2)


def _fused_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict in the old layout: each attention's q, k and v weights and
    biases concatenated (q rows first) into ``qkv.weight`` (3C, C) and ``qkv.bias`` (3C,)."""
    state = dict(model.state_dict())
    for key in [k for k in state if k.endswith(".q.weight") or k.endswith(".q.bias")]:
        prefix, kind = key.rsplit("q.", 1)
        pieces = [state.pop(f"{prefix}{name}.{kind}") for name in ("q", "k", "v")]
        state[f"{prefix}qkv.{kind}"] = torch.cat(pieces)
    return state


def _fused_attention(state: dict[str, torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """The old fused module's forward: one projection, split into q, k, v on the last dim."""
    batch, seq, width = x.shape  # (B, T, C)
    qkv = F.linear(x, state["qkv.weight"], state["qkv.bias"])  # (B, T, 3C)
    q, k, v = (
        t.view(batch, seq, heads, width // heads).transpose(1, 2)  # (B, H, T, D)
        for t in qkv.split(width, dim=-1)
    )
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, D)
    y = y.transpose(1, 2).reshape(batch, seq, width)  # (B, T, C)
    return F.linear(y, state["proj.weight"], state["proj.bias"])


def test_fused_qkv_state_dict_loads_and_gives_the_same_output() -> None:
    """A whole GPT's state dict with fused ``qkv`` keys loads strictly into a GPT of other
    weights, which then gives the saved model's logits; one attention module given a fused
    state dict computes what the fused projection computed (q, k, v in that order)."""
    torch.manual_seed(0)
    saved = GPT(CONFIG)
    assert "blocks.0.attn.q.weight" in saved.state_dict()
    fused = _fused_state_dict(saved)
    assert "blocks.0.attn.qkv.weight" in fused and "blocks.0.attn.q.weight" not in fused
    torch.manual_seed(1)
    loaded = GPT(CONFIG)
    idx = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.seq_len))  # (B, T)
    assert not torch.equal(loaded(idx), saved(idx))
    loaded.load_state_dict(fused)  # strict: no missing or unexpected keys
    torch.testing.assert_close(loaded(idx), saved(idx), rtol=0, atol=0)

    attention = CausalSelfAttention(CONFIG)
    state = {
        "qkv.weight": torch.randn(3 * CONFIG.d_model, CONFIG.d_model),
        "qkv.bias": torch.randn(3 * CONFIG.d_model),
        "proj.weight": torch.randn(CONFIG.d_model, CONFIG.d_model),
        "proj.bias": torch.randn(CONFIG.d_model),
    }
    attention.load_state_dict(dict(state))
    x = torch.randn(2, CONFIG.seq_len, CONFIG.d_model)  # (B, T, C)
    want = _fused_attention(state, x, CONFIG.n_heads)
    torch.testing.assert_close(attention(x), want, rtol=1e-6, atol=1e-6)


def test_fused_qkv_of_the_wrong_shape_is_refused() -> None:
    """A ``qkv.weight`` whose rows are not three equal parts is named in the error."""
    attention = CausalSelfAttention(CONFIG)
    state = dict(attention.state_dict())
    for name in ("q", "k", "v"):
        del state[f"{name}.weight"], state[f"{name}.bias"]
    state["qkv.weight"] = torch.zeros(3 * CONFIG.d_model + 1, CONFIG.d_model)
    with pytest.raises(ValueError, match=r"qkv\.weight has 49 rows, not 3 x d_model"):
        attention.load_state_dict(state)
