"""torchtitan's model building as its trainer does it (``torchtitan/trainer.py``), on CPU
ranks: the llama3 debug model built on the meta device, torchtitan's own
``parallelize_llama`` (its ``apply_fsdp_to_decoder``: ``fully_shard`` per block, the
embeddings, the norm and output as one group, the root), ``to_empty`` and
``init_weights``, ``disable_fsdp_gradient_division`` (torchtitan scales by the global
token count itself), then AdamW steps.

    torchrun --nproc-per-node 2 torchtitan_train.py --out DIR [--spmd-backend NAME]

torchtitan's trainer itself does not run on a CPU (see docs/ecosystem.md); neither does its
attention: flex attention's backward is CUDA-only, and SDPA is refused for language models.
Here flex attention's forward runs its causal attention through SDPA instead (the model's
kernel on a CPU; nothing of its FSDP).
"""

from __future__ import annotations

import argparse

import report
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.fsdp import disable_fsdp_gradient_division
from torchtitan.models.common.attention import FlexAttention
from torchtitan.models.llama3 import model_registry

STEPS = 3


def _causal_sdpa(self, q, k, v, *, attention_masks, scale=None, enable_gqa=False, **kwargs):  # type: ignore[no-untyped-def]
    """FlexAttention's forward on a CPU: flex attention has no backward there
    ("FlexAttention does not support backward on CPU"), so the same causal attention over
    one document per row (the masks built below) runs through SDPA."""
    assert not kwargs.get("score_mod") and not kwargs.get("out_transform")
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=enable_gqa,
    )
    return out.transpose(1, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--spmd-backend", default="partial_dtensor")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    world_size = dist.get_world_size()

    FlexAttention.forward = _causal_sdpa
    spec = model_registry("debugmodel")
    with torch.device("meta"):
        model = spec.model.build()
    parallelism = ParallelismConfig(
        data_parallel_shard_degree=world_size, spmd_backend=args.spmd_backend
    )
    parallel_dims = ParallelDims.from_config(parallelism, world_size)
    parallel_dims.build_mesh()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    model = spec.parallelize_fn(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(enable=False),
        ac_config=None,
        dump_folder="/tmp",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    disable_fsdp_gradient_division(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            # gloo has no PREMUL_SUM, which torch's FSDP2 uses for a divide factor of 1.0
            module.set_force_sum_reduction_for_comms(True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    losses = []
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        tokens = torch.randint(0, 2048, (2, 33), generator=generator)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        # one document per row, as the trainer builds them (flex attention's block mask)
        positions = torch.arange(inputs.shape[1]).expand_as(inputs)
        masks = model.get_attention_masks(positions=positions)
        logits = model(inputs, attention_masks=masks, positions=positions)
        total = torch.tensor(float(labels.numel() * world_size))  # the global token count
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
            )
            / total
        )
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * world_size)
    report.write(args.out, losses, model)
    report.finish()


if __name__ == "__main__":
    main()
