"""What ``fullshard train``'s ranks train on: the text, its held-out part and the batches.

Batches are a function of (seed, step, rank) alone, so a run resumed from a checkpoint draws
exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import torch


def load_corpus(path: str | None) -> torch.Tensor:
    """The training text as a 1-D uint8 tensor of bytes: the shipped corpus by default, a
    file, or every file under a folder (sorted by path, separated by a newline)."""
    if path is None:
        raw = resources.files("fullshard").joinpath("data/corpus.txt").read_bytes()
    elif Path(path).is_dir():
        files = sorted(p for p in Path(path).rglob("*") if p.is_file())
        raw = b"\n".join(p.read_bytes() for p in files)
    else:
        raw = Path(path).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def split_corpus(
    corpus: torch.Tensor, seq_len: int, source: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first 95% to train on, the rest held out; both must hold a sequence."""
    split = int(corpus.numel() * 0.95)
    train_data, heldout_data = corpus[:split], corpus[split:]
    if heldout_data.numel() <= seq_len + 1:
        need = 20 * (seq_len + 2)
        raise ValueError(
            f"the corpus {source} ({corpus.numel()} bytes) is too small for sequences of "
            f"{seq_len} bytes: its last 5% is held out and must hold one; give at least "
            f"{need} bytes of text, or a smaller --seq-len"
        )
    return train_data, heldout_data


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of `data`: inputs (B, T) and next-byte targets (B, T), as int64."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)  # (T + 1,)
    windows = data[starts[:, None] + offsets].long()  # (B, T + 1)
    return windows[:, :-1], windows[:, 1:]


def batch_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """The sampler of ``step`` on ``rank``: a function of the three alone (resumable)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 4_099 + rank)
