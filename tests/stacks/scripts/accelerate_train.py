"""A training script as accelerate's users write it: the FSDP settings come from
``accelerate launch --config_file``; the script only builds the model (a Llama from its
config: random weights), an AdamW, and steps.

    accelerate launch --config_file fsdp.yaml accelerate_train.py --out DIR [--save DIR]
        [--resume DIR]

Five steps; ``--save DIR`` saves the state after step 3 (``save_state``) and trains on;
``--resume DIR`` loads it into a new model and optimizer (``load_state``) and runs steps 4
and 5. Each rank writes its losses (``report.py``).
"""

from __future__ import annotations

import argparse

import report
import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

STEPS, SAVE_AFTER = 5, 3


def make_model(rank: int, weights_on_rank0_only: bool) -> torch.nn.Module:
    # With cpu_ram_efficient_loading only rank 0's weights count (accelerate broadcasts
    # them): the other ranks start from other weights, so a missed broadcast shows.
    torch.manual_seed(rank if weights_on_rank0_only else 0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=40,
        intermediate_size=72,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()

    accelerator = Accelerator()
    plugin = accelerator.state.fsdp_plugin
    model = make_model(accelerator.process_index, bool(plugin and plugin.cpu_ram_efficient_loading))
    if plugin is not None and plugin.fsdp_version == 1:
        # FSDP1 flattens parameters: accelerate's docs prepare the model first
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = accelerator.prepare(model, optimizer)
    first = 0
    if args.resume:
        accelerator.load_state(args.resume)
        first = SAVE_AFTER
    losses = []
    for step in range(first, STEPS):
        generator = torch.Generator().manual_seed(100 * step + accelerator.process_index)
        ids = torch.randint(0, 96, (2, 12), generator=generator)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if args.save and step + 1 == SAVE_AFTER:
            accelerator.save_state(args.save)
    report.write(args.out, losses, model, distributed_type=str(accelerator.distributed_type))
    report.finish()


if __name__ == "__main__":
    main()
