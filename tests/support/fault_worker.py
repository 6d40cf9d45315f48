"""One rank of a fault-injection scenario (run by tests/comm/test_faults.py, one process per rank).

    RANK=0 WORLD_SIZE=2 MASTER_PORT=... python tests/support/fault_worker.py SCENARIO

Trains a 4-block MLP under fullshard; rank 1 misbehaves as SCENARIO says at step 2:
``forward`` (dies in blocks.1's forward), ``backward`` (dies instead of issuing its second
reduce-scatter), ``hang`` (stops in blocks.1's forward without dying), ``save`` (dies in the
middle of a checkpoint save), ``optim_state_dict`` (dies before the ranks build one). Every rank prints ``SURVIVED <seconds since the fault>`` or
``FAILED <seconds> <error>`` on its last line; the fault time comes from rank 1 through a file.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import fullshard.checkpoint as ckpt
from fullshard import FullyShardedDataParallel as FSDP
from fullshard._comm import collectives as comm
from fullshard.wrap import ModuleWrapPolicy
from models import LinearBlock

FAULT_STEP = 2


def _fault(workdir: Path) -> None:
    """Record when the fault happens (rank 1), so survivors can report their delay."""
    (workdir / "fault_time").write_text(repr(time.time()))


def main(scenario: str, workdir: Path) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = FSDP(
        nn.Sequential(*[LinearBlock(32) for _ in range(4)]),
        auto_wrap_policy=ModuleWrapPolicy({LinearBlock}),
    )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = 0
    if rank == 1 and scenario in ("forward", "hang"):
        target = model.module[1]

        def misbehave(*_: object) -> None:
            if step == FAULT_STEP:
                _fault(workdir)
                if scenario == "forward":
                    os._exit(1)
                time.sleep(3600)

        target.register_forward_pre_hook(misbehave)
    if rank == 1 and scenario == "backward":
        issue = comm.reduce_scatter_into
        calls = []

        def dying_reduce_scatter(*args: object, **kwargs: object) -> comm.Pending:
            if step == FAULT_STEP:
                calls.append(1)
                if len(calls) == 2:
                    _fault(workdir)
                    os._exit(1)
            return issue(*args, **kwargs)  # type: ignore[arg-type]

        comm.reduce_scatter_into = dying_reduce_scatter  # type: ignore[assignment]
    if rank == 1 and scenario == "save":
        import torch.distributed.checkpoint as dcp

        def die_while_saving(*args: object, **kwargs: object) -> None:
            _fault(workdir)
            os._exit(1)

        dcp.save = die_while_saving  # type: ignore[assignment]
    try:
        for step in range(4):
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank * 100 + step))
            model(x).sum().backward()
            optim.step()
            optim.zero_grad()
            if scenario == "save" and step == FAULT_STEP:
                ckpt.save(workdir / "ckpt", model, optim, step=step)
            if scenario == "optim_state_dict" and step == FAULT_STEP:
                if rank == 1:
                    _fault(workdir)
                    os._exit(1)
                time.sleep(0.5)  # rank 1 is gone by now
                FSDP.optim_state_dict(model, optim)
        print("SURVIVED", flush=True)
    except Exception as error:  # the survivors' error is what the test reads
        fault = float((workdir / "fault_time").read_text())
        print(f"FAILED {time.time() - fault:.2f} {type(error).__name__}: {error}", flush=True)
        sys.stdout.flush()
        os._exit(3)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
