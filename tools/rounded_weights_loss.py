"""Held-out loss of a trained `fullshard train` checkpoint with its weights rounded to int8.

One process, no process group: loads the model state of a checkpoint of the GPT presets
(``--preset``), then evaluates the same held-out batches with exact weights and with every
weight matrix rounded in several block schemes, as ``fullshard.compress``'s int8 all-gather
rounds them (blocks of each rank's rows, ``--ranks`` ranks) and finer ones. It tells how
much of a compressed run's loss is the rounding itself, apart from the trajectory.

    python tools/rounded_weights_loss.py OUT/checkpoint --preset medium
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from fullshard.cli.plan_shapes import PRESETS
from fullshard.cli.train_data import batch_generator, load_corpus, sample_batch, split_corpus
from fullshard.examples.gpt import GPT, GPTConfig


def rank_column_blocks(weight: torch.Tensor, ranks: int, rows: int | None) -> torch.Tensor:
    """Rounded in blocks of one column of (at most ``rows`` of) each rank's rows."""
    out = []
    for part in weight.chunk(ranks, 0):
        flat = part.flatten(1)
        for block in flat.split(rows or max(flat.shape[0], 1), 0):
            scale = block.abs().amax(0).clamp_min(1e-30) / 127
            out.append((block / scale).round().clamp(-127, 127) * scale)
    return torch.cat(out).view_as(weight)


def row_blocks(weight: torch.Tensor, size: int) -> torch.Tensor:
    """Rounded in blocks of ``size`` consecutive elements of a row."""
    flat = weight.flatten(1)
    blocks = flat.reshape(flat.shape[0], -1, size)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return ((blocks / scale).round().clamp(-127, 127) * scale).view_as(weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=16)
    args = parser.parse_args()
    shape = PRESETS[args.preset]
    config = GPTConfig(
        seq_len=shape.seq_len, d_model=shape.d_model, n_heads=shape.n_heads, n_layers=shape.n_layers
    )
    model = GPT(config)
    state = {"model." + k: v for k, v in model.state_dict().items()}
    dcp.load(state, checkpoint_id=args.checkpoint, no_dist=True)
    model.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
    exact = {k: v.clone() for k, v in model.state_dict().items()}
    _, heldout = split_corpus(load_corpus(None), config.seq_len, "the shipped corpus")
    generator = batch_generator(1, 0, 0)
    batches = [
        sample_batch(heldout, args.batch_size, config.seq_len, generator)
        for _ in range(args.batches)
    ]

    @torch.no_grad()
    def loss() -> float:
        losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten()) for x, y in batches]
        return torch.stack(losses).mean().item()

    schemes: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "each rank's rows (fullshard.compress)": lambda w: rank_column_blocks(w, args.ranks, None),
        "64 of a rank's rows": lambda w: rank_column_blocks(w, args.ranks, 64),
        "16 of a rank's rows": lambda w: rank_column_blocks(w, args.ranks, 16),
        "128 elements of a row": lambda w: row_blocks(w, 128),
        "32 elements of a row": lambda w: row_blocks(w, 32),
    }
    base = loss()
    print(f"exact weights: held-out loss {base:.4f}")
    for name, round_weight in schemes.items():
        model.load_state_dict(exact)
        errors = []
        with torch.no_grad():
            for param in model.parameters():
                if param.ndim >= 2:
                    rounded = round_weight(param)
                    errors.append(((rounded - param).norm() / param.norm()).item())
                    param.copy_(rounded)
        rounded_loss = loss()
        print(
            f"blocks of {name}: mean relative weight error {sum(errors) / len(errors):.4%}, "
            f"held-out loss {rounded_loss:.4f} ({rounded_loss / base - 1:+.3%})"
        )


if __name__ == "__main__":
    main()
