"""Lightning scripts as their users write them, Fabric and Trainer, on 2 CPU processes that
Lightning launches itself: a Llama from its config (random weights), AdamW, five steps.

    python lightning_train.py --api fabric|trainer --strategy fsdp|model_parallel|ddp
        --out DIR [--save PATH] [--resume PATH]

``fsdp`` is ``FSDPStrategy`` (FSDP1, each decoder layer a unit); ``model_parallel`` is
``ModelParallelStrategy`` whose parallelize function (Fabric) or ``configure_model``
(Trainer) calls ``fully_shard`` on the data-parallel mesh; ``ddp`` is the reference.
``--save PATH`` checkpoints after step 3 through Lightning (``fabric.save`` /
``ModelCheckpoint``); ``--resume PATH`` loads it in new processes and runs steps 4 and 5.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import report
import torch
from lightning.fabric.strategies import FSDPStrategy as FabricFSDP
from lightning.fabric.strategies import ModelParallelStrategy as FabricModelParallel
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

STEPS, SAVE_AFTER = 5, 3


def make_model() -> LlamaForCausalLM:
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
    return LlamaForCausalLM(config)


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(100 * step + rank))


def shard(model: torch.nn.Module, mesh: object) -> torch.nn.Module:
    """The parallelize function: fully_shard each decoder layer, then the model."""
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["data_parallel"])
    fully_shard(model, mesh=mesh["data_parallel"])
    return model


def run_fabric(args: argparse.Namespace) -> None:
    strategy = {
        "fsdp": lambda: FabricFSDP(auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="sharded"),
        "model_parallel": lambda: FabricModelParallel(
            parallelize_fn=shard, data_parallel_size=2, tensor_parallel_size=1
        ),
        "ddp": lambda: "ddp",
    }[args.strategy]()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    first = 0
    if args.resume:
        state = {"model": model, "optimizer": optimizer, "step": 0}
        fabric.load(args.resume, state)
        first = state["step"]
    losses = []
    for step in range(first, STEPS):
        loss = model(
            input_ids=batch(step, fabric.global_rank), labels=batch(step, fabric.global_rank)
        ).loss
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if args.save and step + 1 == SAVE_AFTER:
            fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": step + 1})
    report.write(args.out, losses, model)


class Llama(L.LightningModule):
    def __init__(self, parallelize: bool) -> None:
        super().__init__()
        self.model = make_model()
        self.parallelize = parallelize
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.parallelize:
            shard(self.model, self.device_mesh)

    def training_step(self, step_batch: torch.Tensor, index: int) -> torch.Tensor:
        ids = batch(self.global_step, self.global_rank)
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run_trainer(args: argparse.Namespace) -> None:
    strategy = {
        "fsdp": lambda: FSDPStrategy(
            auto_wrap_policy={LlamaDecoderLayer}, state_dict_type="sharded"
        ),
        "model_parallel": lambda: ModelParallelStrategy(
            data_parallel_size=2, tensor_parallel_size=1
        ),
        "ddp": lambda: "ddp",
    }[args.strategy]()
    callbacks = []
    if args.save:
        callbacks.append(
            ModelCheckpoint(
                dirpath=os.path.dirname(args.save),
                filename=os.path.splitext(os.path.basename(args.save))[0],  # adds .ckpt
                every_n_train_steps=SAVE_AFTER,
                save_top_k=-1,
                enable_version_counter=False,
            )
        )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(args.save),
        use_distributed_sampler=False,
    )
    module = Llama(parallelize=args.strategy == "model_parallel")
    data = torch.utils.data.DataLoader(torch.zeros(STEPS * 4, 1), batch_size=1)
    trainer.fit(module, data, ckpt_path=args.resume)
    report.write(args.out, module.losses, trainer.strategy.model)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=["fabric", "trainer"], required=True)
    parser.add_argument("--strategy", choices=["fsdp", "model_parallel", "ddp"], required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--save")
    parser.add_argument("--resume")
    args = parser.parse_args()
    (run_fabric if args.api == "fabric" else run_trainer)(args)
    report.finish()


if __name__ == "__main__":
    main()
