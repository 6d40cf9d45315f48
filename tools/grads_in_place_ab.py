"""A/B of [Note: gradients reduced where autograd left them] in one pair of processes.

Two ranks train the bench's config (Adam, one unit per block) through one door; steps
alternate, in blocks, between the reduce-scatter reading the gradients where autograd left
them and the flat copy it replaces (``GradReduction._reduces_from_places`` forced False).
Both variants share the processes, the model and the host's noise of the same minutes,
which separate ``fullshard bench`` runs of two checkouts do not. Prints rank 0's median
step (wall) and process CPU time per step for each.

    python tools/grads_in_place_ab.py --door fully_shard --rounds 8 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F


def _worker(rank: int, args: argparse.Namespace) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), FULLSHARD_SHM="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    import fullshard
    from fullshard._engine.grads import GradReduction
    from fullshard.cli.bench import CONFIGS
    from fullshard.examples.gpt import GPT, Block
    from fullshard.wrap import ModuleWrapPolicy

    able = GradReduction._reduces_from_places
    in_place = [True]
    GradReduction._reduces_from_places = (  # type: ignore[method-assign]
        lambda self, grad, left: in_place[0] and able(self, grad, left)
    )
    config = CONFIGS[args.config]
    torch.manual_seed(0)
    model: Any = GPT(config.gpt())
    if args.door == "FullyShardedDataParallel":
        model = fullshard.FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block})
        )
    else:
        for module in [m for m in model.modules() if isinstance(m, Block)] + [model]:
            fullshard.fully_shard(module)
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    wall: dict[bool, list[float]] = {True: [], False: []}
    cpu: dict[bool, list[float]] = {True: [], False: []}

    def step(record: bool) -> None:
        tokens = torch.randint(0, 256, (config.batch, config.seq_len + 1), generator=generator)
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        if record:
            wall[in_place[0]].append(time.perf_counter() - start)
            cpu[in_place[0]].append(time.process_time() - start_cpu)

    for round_ in range(args.rounds):
        for variant in (True, False) if round_ % 2 == 0 else (False, True):
            in_place[0] = variant
            step(record=False)  # a switch takes effect from the next step on
            for _ in range(args.steps):
                step(record=True)
    if rank == 0:
        for variant, name in ((True, "in place"), (False, "flat copy")):
            print(
                f"{args.door} {name}: median step {statistics.median(wall[variant]):.3f} s, "
                f"CPU {statistics.median(cpu[variant]):.3f} s ({len(wall[variant])} steps)"
            )
        ratio = statistics.median(wall[True]) / statistics.median(wall[False])
        cpu_ratio = statistics.median(cpu[True]) / statistics.median(cpu[False])
        print(f"{args.door} in place / flat copy: step {ratio:.3f}x, CPU {cpu_ratio:.3f}x")
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--door", choices=["fully_shard", "FullyShardedDataParallel"])
    parser.add_argument("--config", default="comm")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--port", type=int, default=29544)
    mp.spawn(_worker, args=(parser.parse_args(),), nprocs=2)


if __name__ == "__main__":
    main()
