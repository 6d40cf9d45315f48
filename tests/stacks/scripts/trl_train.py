"""TRL's ``SFTTrainer`` as its users write it, FSDP from ``SFTConfig``'s ``fsdp`` arguments:
a Llama from its config (random weights), a word-level tokenizer built here (nothing can be
downloaded), a text dataset.

    torchrun --nproc-per-node 2 trl_train.py --out DIR --output-dir DIR --fsdp-config JSON
        [--save-steps 3] [--resume DIR]
"""

from __future__ import annotations

import argparse
import json

import report
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

STEPS = 5
WORDS = [f"w{i}" for i in range(90)]


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def dataset() -> Dataset:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randint(0, len(WORDS), (64, 10), generator=generator)
    return Dataset.from_dict({"text": [" ".join(WORDS[i] for i in row) for row in rows.tolist()]})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument("--fsdp-config", default="{}")
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume")
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
        pad_token_id=0,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(config)
    sft = SFTConfig(
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
        fsdp="full_shard auto_wrap",
        fsdp_config=json.loads(args.fsdp_config),
        disable_tqdm=True,
        max_length=16,
        bf16=False,
    )
    trainer = SFTTrainer(
        model=model, args=sft, train_dataset=dataset(), processing_class=tokenizer()
    )
    trainer.train(resume_from_checkpoint=args.resume)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    report.write(args.out, losses, trainer.model_wrapped)
    report.finish()


if __name__ == "__main__":
    main()
