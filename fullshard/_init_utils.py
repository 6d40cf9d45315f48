"""Construction helpers: ignored modules and states, meta-device materialisation, and
``sync_module_states`` (broadcasting rank 0's parameters and buffers).

Each works on the modules one unit manages (its subtree, minus nested units and ignored
modules), so auto-wrapped units materialise and synchronise their own modules as they are
built, and nothing is done twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._process_groups import ShardingGroups

__all__: list[str] = []


def resolve_ignored(
    ignored_modules: Iterable[Any] | None, ignored_states: Iterable[Any] | None
) -> tuple[tuple[nn.Module, ...], tuple[nn.Parameter, ...]]:
    """Validate ``ignored_modules`` / ``ignored_states``: (modules, parameters) to ignore."""
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both `ignored_modules` and `ignored_states` at the same time. Please "
            "just pass `ignored_states`."
        )
    if ignored_modules is not None:
        modules = list(ignored_modules)
        bad = {type(m).__name__ for m in modules if not isinstance(m, nn.Module)}
        if bad:
            raise TypeError(f"ignored_modules expects nn.Module list elements but got types {bad}")
        return tuple(modules), ()
    if ignored_states is None:
        return (), ()
    states = list(ignored_states)
    if all(isinstance(s, nn.Parameter) for s in states):
        return (), tuple(states)
    if all(isinstance(s, nn.Module) for s in states):
        return tuple(states), ()
    types = {type(s).__name__ for s in states}
    raise ValueError(
        "ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        f"{types}"
    )


def check_not_fsdp(modules: Iterable[nn.Module], fsdp_cls: type) -> None:
    for module in modules:
        if isinstance(module, fsdp_cls):
            raise ValueError(
                "`ignored_modules` should not include FSDP modules: pass the module it wraps"
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
            dist.broadcast(flat, src=src, group=group)
            with torch.no_grad():
                for tensor, synced in zip(
                    same_kind, torch.split(flat, [t.numel() for t in same_kind])
                ):
                    tensor.copy_(synced.view_as(tensor))
