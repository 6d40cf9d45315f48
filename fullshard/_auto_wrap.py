"""Auto-wrapping: the wrap policy's target submodules become units of their own, bottom-up.

FSDP1's constructor runs it with an ``auto_wrap_policy``: each target is replaced in its
parents by a unit built with the policy's overrides; parameters shared with modules outside
a target stay with the enclosing unit.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from ._engine.names import clean_fqn
from ._engine.unit import unit_of
from .api import MixedPrecision
from .wrap import resolve_policy

__all__: list[str] = []


# Modules that read their children's parameters without calling the children's forward
# (nn.MultiheadAttention uses `self.out_proj.weight` directly). A unit made of such a child
# would never be unsharded, so auto-wrapping leaves these children to the enclosing unit.
_READS_CHILD_PARAMS_DIRECTLY: tuple[type[nn.Module], ...] = (nn.MultiheadAttention,)


def _post_order(root: nn.Module) -> list[nn.Module]:
    order: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        for child in module.children():
            visit(child)
        order.append(module)

    visit(root)
    return order


def auto_wrap(
    root: nn.Module,
    policy: Any,
    kwargs: dict[str, Any],
    mixed_precision: MixedPrecision | None,
    ignored: set[nn.Module],
    build: Callable[[nn.Module, dict[str, Any], set[nn.Parameter]], nn.Module],
) -> None:
    """Wrap the policy's target submodules of ``root`` bottom-up, in place,
    with ``build`` (the front door's unit constructor, leaving the excluded parameters to an
    ancestor).

    With mixed precision, every module of a class in ``_module_classes_to_ignore`` becomes a
    unit of its own too, so that it can run in full precision (as torch's FSDP does).
    """
    resolved = resolve_policy(policy)
    if resolved is None:
        return
    for name, submodule in root.named_modules():
        if unit_of(submodule) is not None:
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{clean_fqn(name)} in the {type(root).__qualname__} being wrapped. Wrap by hand "
                "or with the policy, not both: drop the inner FullyShardedDataParallel, or the "
                "auto_wrap_policy"
            )
    targets = resolved._run_policy(root, ignored, dict(kwargs))
    if mixed_precision is not None and mixed_precision._module_classes_to_ignore:
        ignored_classes = tuple(mixed_precision._module_classes_to_ignore)
        overridden = [
            m
            for m in root.modules()
            if m is not root and m not in ignored and isinstance(m, ignored_classes)
        ]
        if overridden:
            warnings.warn(
                "Both mixed precision and an auto_wrap_policy were specified to FSDP, where the "
                f"wrapped module has submodules of type:\n{ {type(m) for m in overridden} }\n"
                "These modules will be wrapped as separate FSDP instances with mixed precision "
                "disabled.",
                stacklevel=3,
            )
            extra = {id(m) for m in overridden}
            targets = {
                m: targets.get(m, dict(kwargs))
                for m in _post_order(root)
                if m in targets or id(m) in extra
            }
    param_owners: dict[int, list[nn.Module]] = {}
    parents: dict[int, list[tuple[nn.Module, str]]] = {}
    for submodule in root.modules():
        for param in submodule._parameters.values():
            if param is not None:
                param_owners.setdefault(id(param), []).append(submodule)
        for name, child in submodule._modules.items():
            if child is not None:
                parents.setdefault(id(child), []).append((submodule, name))
    leaf_only = {
        id(m)
        for container in root.modules()
        if isinstance(container, _READS_CHILD_PARAMS_DIRECTLY)
        for m in container.modules()
        if m is not container
    }
    for target, target_kwargs in targets.items():
        if target is root or unit_of(target) is not None or id(target) in leaf_only:
            continue
        subtree = {id(m) for m in target.modules()}
        excluded = {
            param
            for m in target.modules()
            for param in m._parameters.values()
            if param is not None
            and any(id(owner) not in subtree for owner in param_owners.get(id(param), []))
        }
        unit = build(target, {**kwargs, **target_kwargs}, excluded)
        for parent, name in parents.get(id(target), []):
            parent._modules[name] = unit
