"""torch's own FSDP engines for the benchmark (``fullshard bench`` loads this file from the
source checkout). They live outside the package: fullshard itself never imports torch's FSDP.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
    MixedPrecisionPolicy,
    ShardingStrategy,
    fully_shard,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy


def wrap_fsdp1(
    model: nn.Module, args: argparse.Namespace, device: torch.device, block: type[nn.Module]
) -> nn.Module:
    """torch FSDP1 (`FullyShardedDataParallel`), one unit per ``block``."""
    bf16 = args.mixed_precision == "bf16"
    prefetch = (
        None if args.backward_prefetch == "none" else BackwardPrefetch[args.backward_prefetch]
    )
    return FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({block}),
        sharding_strategy=ShardingStrategy[args.strategy],
        mixed_precision=MixedPrecision(torch.bfloat16, torch.bfloat16) if bf16 else None,
        device_id=device,
        forward_prefetch=args.forward_prefetch,
        backward_prefetch=prefetch,
    )


def wrap_fsdp2(
    model: nn.Module, args: argparse.Namespace, device: torch.device, block: type[nn.Module]
) -> nn.Module:
    """torch FSDP2 (`fully_shard`) on every ``block``, then the root."""
    del device  # fully_shard places the module where its parameters are
    reshard = args.strategy == "FULL_SHARD"
    bf16 = args.mixed_precision == "bf16"
    policy: Any = (
        MixedPrecisionPolicy(torch.bfloat16, torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    )
    for module in model.modules():
        if isinstance(module, block):
            fully_shard(module, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard, mp_policy=policy)
    return model
