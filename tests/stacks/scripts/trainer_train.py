"""A transformers ``Trainer`` script as its users write it: FSDP from ``TrainingArguments``
(``--fsdp``, ``--fsdp_config``), a Llama from its config (random weights), a fixed dataset.

    torchrun --nproc-per-node 2 trainer_train.py --out DIR --fsdp "full_shard auto_wrap"
        --fsdp-config JSON [--save-steps 3] [--resume DIR]

Five steps, the loss logged at each; ``--resume`` continues from a checkpoint the Trainer
saved (``resume_from_checkpoint``). Each rank writes the logged losses (``report.py``).
"""

from __future__ import annotations

import argparse
import json

import report
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

STEPS = 5


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 96, (n, 12), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--fsdp", default="full_shard auto_wrap")
    parser.add_argument("--fsdp-config", default="{}")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
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
    model = LlamaForCausalLM(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        bf16=args.bf16,
        fsdp=args.fsdp,
        fsdp_config=json.loads(args.fsdp_config),
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=Tokens(64))
    trainer.train(resume_from_checkpoint=args.resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    report.write(
        args.out,
        losses,
        trainer.model_wrapped,
        distributed_type=str(trainer.accelerator.distributed_type),
    )
    report.finish()


if __name__ == "__main__":
    main()
