"""Rank-side helpers shared by the seed ports: torch's ``run_subtests`` and ``_zero_model``."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fullshard import FullyShardedDataParallel as FSDP

__all__ = ["run_subtests", "zero_model"]


def run_subtests(subtest_config: dict[str, list[Any]], test_fn: Callable[..., None]) -> int:
    """Call ``test_fn`` on every combination of the config's values (a fresh deep copy of
    each, as torch's ``FSDPTest.run_subtests`` does), with a barrier after each; return how
    many ran. A failing subtest prints its arguments and the rank before the exception
    propagates (the harness shows a failing rank's output with its traceback)."""
    keys = list(subtest_config)
    count = 0
    for values in itertools.product(*(subtest_config[key] for key in keys)):
        kwargs = copy.deepcopy(dict(zip(keys, values, strict=True)))
        try:
            test_fn(**kwargs)
        except BaseException:
            print(f"rank {dist.get_rank()}: subtest {kwargs} failed", flush=True)
            raise
        dist.barrier()
        count += 1
    return count


def zero_model(model: nn.Module) -> None:
    """common_fsdp's ``_zero_model``: zero every parameter in place, full parameters visible."""
    with FSDP.summon_full_params(model), torch.no_grad():
        for param in model.parameters():
            param.zero_()
