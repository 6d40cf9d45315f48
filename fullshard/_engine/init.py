"""Construction helpers: devices (``device_id``, the compute device, moving CPU states),
ignored modules and states, meta-device materialisation, and ``sync_module_states``
(broadcasting rank 0's parameters and buffers).

Each works on the modules one unit manages (its subtree, minus nested units and ignored
modules), so auto-wrapped units materialise and synchronise their own modules as they are
built, and nothing is done twice.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._comm import collectives as comm
from .._comm.groups import ShardingGroups

__all__: list[str] = []

_CPU = torch.device("cpu")

# [Note: devices]
# As in torch's FSDP: the compute device is where the unit's parameters are when they are on
# an accelerator; for a CPU module it is `device_id` when given, else the current CUDA device.
# One difference: where CUDA is missing, or the unit's process group is gloo only (which
# communicates CPU tensors), a CPU module computes on the CPU, so CPU training with gloo needs
# no `device_id` even on a machine with GPUs. `device_id` moves only states that are on the
# CPU, so a module on another GPU than `device_id` is an error rather than a silent copy. A
# CPU module whose compute device is a GPU stays on the CPU (with torch's warning) until the
# user moves it; each unit's forward checks its shard is on its compute device, and the
# root's forward moves the inputs there.


def default_compute_device(group: Any) -> torch.device:
    """The compute device of a CPU module without ``device_id`` (see [Note: devices])."""
    if not torch.cuda.is_available() or _backend(group) == "gloo":
        return _CPU
    return torch.device("cuda", torch.cuda.current_device())


def _backend(group: Any) -> str | None:
    try:
        return str(dist.get_backend(group))
    except (RuntimeError, ValueError, TypeError, AttributeError):  # not a registered group
        return None


def device_from_device_id(
    device_id: int | str | torch.device | None, rank: int
) -> torch.device | None:
    """``device_id`` as a device with an explicit index (an int names a CUDA device)."""
    if device_id is None:
        return None
    if isinstance(device_id, bool) or not isinstance(device_id, (int, str, torch.device)):
        raise TypeError(
            f"device_id must be an int, a str or a torch.device, got {device_id!r} on rank {rank}"
        )
    device = (
        torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"device_id={device_id!r} names a CUDA device on rank {rank}, but CUDA is not "
            "available here; pass device_id=torch.device('cpu') (or leave it out) to run on the "
            "CPU"
        )
    if device.type == "cuda" and device.index is None:
        current = torch.cuda.current_device()
        warnings.warn(
            f"FSDP got the argument `device_id` {device_id} on rank {rank}, which does not have "
            f"an explicit index. FSDP will use the current device {current}. If this is "
            "incorrect, please explicitly call `torch.cuda.set_device()` before FSDP "
            "initialization or pass in the explicit device index as the `device_id` argument.",
            stacklevel=4,
        )
        device = torch.device("cuda", current)
    return device


def check_single_device(
    named_params: list[tuple[str, nn.Parameter]], device_id: torch.device | None, where: str
) -> None:
    """The managed parameters are on one device, or on the CPU and one device with
    ``device_id`` given (the CPU ones are then moved)."""
    devices = {param.device for _, param in named_params}
    if len(devices) <= 1:
        return
    placement = ", ".join(f"{name}: {param.device}" for name, param in named_params)
    if len(devices) == 2 and _CPU in devices:
        if device_id is None:
            raise RuntimeError(
                f"{where} has parameters on the CPU and on {(devices - {_CPU}).pop()} "
                f"({placement}). To support a module with both CPU and GPU params, please pass "
                "in device_id argument."
            )
        return
    raise RuntimeError(
        f"FSDP only supports single device modules but got params on {devices} in {where} "
        f"({placement}); move the module to one device first"
    )


def move_cpu_states(
    modules: list[nn.Module], ignored_params: set[nn.Parameter], device: torch.device
) -> None:
    """Move the managed modules' own CPU parameters and buffers to ``device`` (in place, like
    ``nn.Module.to``). States on another accelerator stay, so the compute device check can
    report them."""
    with torch.no_grad():
        for module in modules:
            for param in module._parameters.values():
                if param is None or param in ignored_params or param.device != _CPU:
                    continue
                param.data = param.data.to(device)
                if param.grad is not None:
                    param.grad.data = param.grad.data.to(device)
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device == _CPU:
                    module._buffers[name] = buffer.to(device)


def warn_cpu_init() -> None:
    warnings.warn(
        "The passed-in `module` is on CPU and will thus have FSDP's sharding initialization run "
        "on CPU, which may be slower than on GPU. We recommend passing in the `device_id` "
        "argument for FSDP to move `module` to GPU for the sharding initialization. `module` "
        "must also be on GPU device to work with the `sync_module_states=True` flag since that "
        "requires GPU communication.",
        stacklevel=4,
    )


def compute_device(
    param_device: torch.device | None,
    device_id: torch.device | None,
    default: torch.device,
    rank: int,
) -> torch.device:
    """The unit's compute device (see [Note: devices]).

    ``param_device`` is where the first managed parameter is (None without parameters),
    after ``device_id`` moved CPU states; ``default`` is :func:`default_compute_device`. With
    CUDA as the default, a CUDA ``device_id`` must be the current device, as in torch.
    """
    if param_device is not None and param_device.type not in ("cpu", "meta"):
        device = param_device
    elif device_id is not None and (device_id.type != "cuda" or default.type != "cuda"):
        device = device_id
    else:
        device = default  # the current CUDA device: device_id must name it
    if device_id is not None and device != device_id:
        raise ValueError(
            f"Inconsistent compute device and `device_id` on rank {rank}: {device} vs "
            f"{device_id}. Move the module to {device_id} (or leave it on the CPU) before "
            "wrapping, or pass the device_id it is on"
        )
    return device


def check_on_compute_device(
    shard_device: torch.device, compute: torch.device, offload_params: bool, label: str
) -> None:
    """At the root's forward: every unit's parameters are where training expects them."""
    if offload_params:
        if shard_device != _CPU:
            raise RuntimeError(
                "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
                f"{shard_device}. Make sure to not move the module from CPU when offloading "
                f"parameters. (FSDP unit '{label}'.)"
            )
    elif shard_device != compute:
        hint = (
            "; to train on the CPU instead, construct FSDP with device_id=torch.device('cpu')"
            if shard_device == _CPU
            else ""
        )
        raise RuntimeError(
            f"An FSDP-managed module unexpectedly has parameters on {shard_device}. Make sure to "
            f"move the module to {compute} before training. (FSDP unit '{label}'{hint}.)"
        )


def resolve_ignored(
    ignored_modules: Iterable[Any] | None, ignored_states: Iterable[Any] | None
) -> tuple[tuple[nn.Module, ...], tuple[nn.Parameter, ...]]:
    """Validate ``ignored_modules`` / ``ignored_states``: (modules, parameters) to ignore."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time. Please "
            "just pass ignored_states."
        )
    if ignored_modules is not None:
        modules = list(ignored_modules)
        if not all(isinstance(m, nn.Module) for m in modules):
            raise ValueError(
                f"ignored_modules expects nn.Module list elements but got types "
                f"{_sorted_types(modules)}: pass parameters in ignored_states instead"
            )
        return tuple(modules), ()
    if ignored_states is None:
        return (), ()
    states = list(ignored_states)
    if all(isinstance(s, nn.Parameter) for s in states):
        return (), tuple(states)
    if all(isinstance(s, nn.Module) for s in states):
        return tuple(states), ()
    raise ValueError(
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        f"{_sorted_types(states)}: pass either modules or parameters"
    )


def _sorted_types(objects: list[Any]) -> list[type]:
    """The distinct types, in torch's order (by repr), as torch's error texts list them."""
    return sorted({type(o) for o in objects}, key=repr)


def warn_if_root_ignored(module: nn.Module, ignored: Iterable[nn.Module]) -> None:
    if any(m is module for m in ignored):
        warnings.warn(
            "Trying to ignore the top-level module passed into the FSDP constructor itself "
            "will result in all parameters being ignored and is not well-supported: "
            f"{type(module).__name__}",
            stacklevel=4,
        )


def expand_ignored(root: nn.Module, ignored: Iterable[nn.Module]) -> set[nn.Module]:
    """Every module in the subtrees of the ``ignored`` modules that lie under ``root``."""
    inside = set(root.modules())
    return {m for top in ignored if top in inside for m in top.modules()}


def materialize(
    modules: list[nn.Module],
    ignored_params: set[nn.Parameter],
    param_init_fn: Callable[[nn.Module], None] | None,
    device: torch.device,
) -> None:
    """Materialise managed modules that have meta-device parameters or buffers.

    With ``param_init_fn`` it is called on each such module; otherwise the module is moved
    with ``to_empty(device=..., recurse=False)`` and re-initialised by its own
    ``reset_parameters()``, as torch's FSDP does.
    """
    on_meta = [
        m
        for m in modules
        if any(p.is_meta for p in m.parameters(recurse=False) if p not in ignored_params)
        or any(b.is_meta for b in m.buffers(recurse=False))
    ]
    if not on_meta:
        return
    if param_init_fn is not None:
        if not callable(param_init_fn):
            raise ValueError(
                f"Expected {param_init_fn} to be callable but got {type(param_init_fn)}"
            )
        for module in on_meta:
            param_init_fn(module)
        return
    for module in on_meta:
        module.to_empty(device=device, recurse=False)
        reset = getattr(module, "reset_parameters", None)
        if reset is None:
            if any(True for _ in module.parameters(recurse=False)):
                raise ValueError(
                    f"{type(module).__name__} was on the meta device and has no "
                    "`reset_parameters()`, so FSDP cannot initialise its parameters. Please "
                    "ensure that your module of type "
                    f"{type(module)} implements a `reset_parameters()` method, or pass "
                    "param_init_fn"
                )
            continue
        try:
            with torch.no_grad():
                reset()
        except BaseException as e:
            raise ValueError(
                "Unable to call `reset_parameters()` for module on meta device with error "
                f"{e}. Please ensure that your module of type {type(module)} implements a "
                "`reset_parameters()` method."
            ) from e


def sync_module_states(tensors: list[torch.Tensor], groups: ShardingGroups) -> None:
    """Broadcast ``tensors`` from the first rank of each group, in place (coalesced)."""
    if not tensors:
        return
    for group in (groups.shard, groups.replicate):
        if group is None or dist.get_world_size(group) == 1:
            continue
        if dist.get_backend(group) == "nccl" and any(t.device.type == "cpu" for t in tensors):
            raise ValueError(
                "The module has CPU parameters or buffers when `sync_module_states=True`, which "
                "requires them to be on GPU. Please specify the `device_id` argument or move "
                "the module to GPU before passing it to FSDP."
            )
        src = dist.get_global_rank(group, 0)
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for tensor in tensors:
            by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
        for same_kind in by_kind.values():
            flat = torch.cat([t.detach().reshape(-1) for t in same_kind])
            with comm.named("sync_module_states' broadcast from rank 0", group):
                dist.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                for tensor, synced in zip(
                    same_kind, torch.split(flat, [t.numel() for t in same_kind])
                ):
                    tensor.copy_(synced.view_as(tensor))
