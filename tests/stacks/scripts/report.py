"""What a stack script reports, per rank, for the tests to compare (``tests/support/stacks.py``)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

_FSDP_CLASSES = ("FSDPModule", "FullyShardedDataParallel")


def fsdp_units(model: nn.Module) -> list[str]:
    """Per FSDP unit in ``model``, the module its FSDP class comes from (torch's or
    fullshard's): the first class of that name in the unit's MRO."""
    found = []
    for module in model.modules():
        for cls in type(module).__mro__:
            if cls.__name__ in _FSDP_CLASSES:
                found.append(cls.__module__)
                break
    return found


def write(out: str, losses: list[float], model: nn.Module, **extra: Any) -> None:
    """Write this rank's losses and facts to ``<out>/rank<r>.json``."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    report = {
        "rank": rank,
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "losses": losses,
        "units": fsdp_units(model),
        **extra,
    }
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"rank{rank}.json").write_text(json.dumps(report))


def finish() -> None:
    """End the run: every rank has written its report (the barrier), the process group is
    destroyed as torch recommends, and the process leaves without interpreter finalization.
    A gloo worker thread that drops the last reference to a tensor while the interpreter
    finalizes aborts the process ("terminate called without an active exception"; torch's,
    see pytorch/pytorch#179291), with or without the group destroyed: seen on torch's own
    FSDP1 run of the accelerate test as on fullshard's. Everything the tests read is written
    by then, so ``os._exit`` loses nothing."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
