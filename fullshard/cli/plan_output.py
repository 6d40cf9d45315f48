"""``fullshard plan``'s result and its output: one rank's memory and traffic, as a table in
the names of its API and as a chart of memory per rank over world sizes (see ``plan``)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from ..memory import MemoryEstimate
from .plan_shapes import ModelShape, human_count

__all__ = ["HYBRID_STRATEGIES", "PlanResult", "format_plan", "human_bytes", "parse_bytes", "plot"]

HYBRID_STRATEGIES = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_HYBRID = HYBRID_STRATEGIES


@dataclass(frozen=True)
class PlanResult:
    """One rank's memory and traffic for one configuration."""

    shape: ModelShape
    world_size: int
    strategy: str
    shard_group_size: int
    param_dtype: str
    compute_dtype: str
    cpu_offload: bool
    batch: int
    seq_len: int
    memory: MemoryEstimate
    host_bytes: int
    """Model state kept in host memory with ``cpu_offload`` (params, grads, optimizer)."""
    comm_bytes_per_step: int
    device: str = "cuda"
    api: str = "fsdp1"
    """"fsdp1" (FullyShardedDataParallel) or "fsdp2" (fully_shard)."""
    notes: tuple[str, ...] = ()
    """What the reader should know about how these numbers were modelled."""
    post_forward_shards: int | None = None
    """fully_shard's ``reshard_after_forward=k``: the ranks parameters stay sharded over
    between forward and backward (None: True or False)."""
    tp: int = 1
    """Tensor-parallel ranks inside each data-parallel rank (``world_size / tp`` of those)."""
    tp_comm_bytes_per_step: int = 0
    """Bytes each rank sends per step for tensor parallelism (``comm_bytes_per_step`` is
    FSDP's, over the data-parallel ranks)."""

    @property
    def dp_size(self) -> int:
        """The data-parallel ranks ``fully_shard`` shards (and replicates) over."""
        return self.world_size // self.tp

    @property
    def device_total(self) -> int:
        return self.memory.total

    @property
    def reshard_after_forward(self) -> bool | int:
        """FSDP2's option: whether units free their parameters after forward, or the ranks
        they keep them sharded over until backward."""
        if self.post_forward_shards is not None:
            return self.post_forward_shards
        return self.strategy not in ("SHARD_GRAD_OP", "_HYBRID_SHARD_ZERO2")


def human_bytes(num: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num >= size:
            return f"{num / size:.2f} {unit}"
    return f"{int(num)} B"


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '1.5TiB', '4096' -> bytes (GB and GiB both mean 2**30 here)."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)i?B?\s*", text, flags=re.IGNORECASE)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 80GiB, 24GB, 512MiB)")
    power = " KMGT".index(match.group(2).upper() or " ")
    return int(float(match.group(1)) * 1024**power)


def _setup_line(plan: PlanResult) -> str:
    """The sharding, precision and offload, in the names of the plan's API."""
    replicas = plan.dp_size // plan.shard_group_size
    batch = f"batch {plan.batch} x {plan.seq_len} tokens per rank"
    if plan.api == "fsdp1":
        hybrid = ""
        if plan.strategy in _HYBRID:
            hybrid = f" (shard over {plan.shard_group_size}, replicate x{replicas})"
        return (
            f"setup: {plan.world_size} ranks, {plan.strategy}{hybrid}, params "
            f"{plan.param_dtype}, compute {plan.compute_dtype}, cpu offload "
            f"{'on' if plan.cpu_offload else 'off'}, {batch}"
        )
    mesh = f"1-D mesh ({plan.world_size},)"
    if plan.strategy in _HYBRID:
        mesh = f"2-D mesh (replicate {replicas}, shard {plan.shard_group_size})"
    if plan.tp > 1:
        dims = f"dp {plan.dp_size}"
        if plan.strategy in _HYBRID:
            dims = f"dp_replicate {replicas}, dp_shard {plan.shard_group_size}"
        mesh = (
            f"sub-mesh of the {'3' if plan.strategy in _HYBRID else '2'}-D mesh ({dims}, "
            f"tp {plan.tp}), after parallelize_module over tp {plan.tp}"
        )
    policy = "MixedPrecisionPolicy()"
    if plan.compute_dtype != plan.param_dtype:
        policy = f"MixedPrecisionPolicy(param_dtype={plan.compute_dtype})"
    offload = "CPUOffloadPolicy()" if plan.cpu_offload else "OffloadPolicy()"
    model = f"the {plan.strategy} memory model"
    if plan.post_forward_shards is not None:
        model += (
            f", plus each unit's parameters sharded over {plan.post_forward_shards} ranks from "
            "forward to backward"
        )
    return (
        f"setup: {plan.world_size} ranks, fully_shard(reshard_after_forward="
        f"{plan.reshard_after_forward}) on a {mesh} ({model}), "
        f"params {plan.param_dtype}, mp_policy={policy}, offload_policy={offload}, {batch}"
    )


def format_plan(plan: PlanResult, device_memory: int | None = None) -> str:
    shape, memory = plan.shape, plan.memory
    lines = [
        f"model: {shape.name}: {human_count(shape.params)} parameters, {shape.n_layers} blocks "
        f"of {human_count(shape.unit_numel)} (one FSDP unit each), root unit "
        f"{human_count(shape.root_numel)}{_per_tp_rank(plan)}",
        _setup_line(plan),
        "",
        "| per rank | bytes |",
        "|---|---|",
        f"| parameters (shard) | {human_bytes(memory.params)} |",
        f"| gradients (shard) | {human_bytes(memory.grads)} |",
        f"| optimizer state | {human_bytes(memory.optimizer)} |",
        f"| unsharded units (params and grads in flight) | {human_bytes(memory.unsharded)} |",
        f"| activations (estimate) | {human_bytes(memory.activations)} |",
    ]
    if memory.staging:
        lines.append(f"| shared-memory transport staging | {human_bytes(memory.staging)} |")
    lines += [
        f"| **{'host' if plan.device == 'cpu' else 'device'} total** | "
        f"**{human_bytes(memory.total)}** |",
    ]
    if plan.cpu_offload:
        lines.append(
            f"| host memory (offloaded params, grads, optimizer) | {human_bytes(plan.host_bytes)} |"
        )
    if plan.tp > 1:
        lines += [
            f"| sent per step, FSDP (ring estimate) | {human_bytes(plan.comm_bytes_per_step)} |",
            f"| sent per step, tensor parallel (ring estimate) | "
            f"{human_bytes(plan.tp_comm_bytes_per_step)} |",
        ]
    else:
        lines.append(f"| sent per step (ring estimate) | {human_bytes(plan.comm_bytes_per_step)} |")
    if device_memory is not None:
        verdict = "fits" if memory.total <= device_memory else "does NOT fit"
        lines += [
            "",
            f"{verdict} in {human_bytes(device_memory)} per device "
            f"({100 * memory.total / device_memory:.0f}% used)",
        ]
    if plan.notes:
        lines += ["", "notes:", *(f"- {note}" for note in plan.notes)]
    return "\n".join(lines)


def _per_tp_rank(plan: PlanResult) -> str:
    if plan.tp == 1:
        return ""
    block = human_count(plan.shape.unit_numel_per_tp_rank(plan.tp))
    root = human_count(plan.shape.root_numel_per_tp_rank(plan.tp))
    return f"; per tensor-parallel rank (tp {plan.tp}) {block} and {root}"


def _sharding_label(plan: PlanResult) -> str:
    if plan.api == "fsdp1":
        return plan.strategy
    return f"fully_shard(reshard_after_forward={plan.reshard_after_forward})"


def plot(plan_at: dict[int, PlanResult], path: str, device_memory: int | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(plan_at)
    parts = {
        "parameters": [plan_at[n].memory.params for n in sizes],
        "gradients": [plan_at[n].memory.grads for n in sizes],
        "optimizer": [plan_at[n].memory.optimizer for n in sizes],
        "unsharded units": [plan_at[n].memory.unsharded for n in sizes],
        "activations": [plan_at[n].memory.activations for n in sizes],
        "shared-memory staging": [plan_at[n].memory.staging for n in sizes],
    }
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [str(n) for n in sizes]
    bottom = [0.0] * len(sizes)
    for name, values in parts.items():
        gib = [v / 2**30 for v in values]
        ax.bar(labels, gib, bottom=bottom, label=name)
        bottom = [b + g for b, g in zip(bottom, gib)]
    if device_memory is not None:
        ax.axhline(device_memory / 2**30, color="black", linestyle="--", label="device memory")
    last = plan_at[sizes[-1]]
    ax.set_xlabel("ranks")
    ax.set_ylabel("GiB per rank")
    ax.set_title(
        f"{last.shape.name}: {_sharding_label(last)}, compute {last.compute_dtype}, "
        f"batch {last.batch}x{last.seq_len}"
    )
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
