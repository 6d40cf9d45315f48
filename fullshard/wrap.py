"""Auto-wrap policies: which submodules become their own FSDP unit.

Same public API and semantics as ``torch.distributed.fsdp.wrap``. The engine calls one entry
point, ``resolve_policy(policy)._run_policy(root, ignored_modules, root_kwargs)``, and gets
back ``{target_module: constructor_kwargs}`` in post-order (children before parents), so it
can wrap bottom-up without re-walking the tree.

Two kinds of policy exist, as in torch:

- ``_Policy`` objects (``ModuleWrapPolicy``, ``CustomPolicy``) look at each module on its own.
  They may name the root module as a target (torch does too); the engine wraps the root
  itself anyway and drops it from the targets.
- Legacy callables ``fn(module, recurse, nonwrapped_numel) -> bool`` (``always_wrap_policy``,
  ``functools.partial(size_based_auto_wrap_policy, min_num_params=...)``, ...) are run with
  torch's recursive algorithm, see [Note: legacy recursive policy]. The root is never a
  target there.
"""

from __future__ import annotations

import contextlib
import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "resolve_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

_LegacyPolicyFn = Callable[..., bool]
"""``fn(module=..., recurse=..., nonwrapped_numel=...) -> bool``, called with keywords."""


# ---------------------------------------------------------------------------
# Validation and traversal helpers
# ---------------------------------------------------------------------------


def _as_class_tuple(classes: object, arg_name: str) -> tuple[type, ...]:
    """Return ``classes`` as a tuple for ``isinstance``, or raise a TypeError that says how
    to fix the argument (``arg_name`` names it in the message)."""
    if isinstance(classes, type):
        raise TypeError(
            f"{arg_name} must be an iterable of module classes, but got the class "
            f"{classes.__qualname__} itself; wrap it in a set: {{{classes.__qualname__}}}"
        )
    if isinstance(classes, (str, bytes)) or not isinstance(classes, Iterable):
        raise TypeError(
            f"{arg_name} must be an iterable of module classes such as {{nn.Linear}}, "
            f"but got {classes!r} of type {type(classes).__qualname__}"
        )
    result = tuple(classes)
    for entry in result:
        if not isinstance(entry, type):
            kind = "an instance, not a class" if isinstance(entry, nn.Module) else "not a class"
            raise TypeError(
                f"{arg_name} must contain classes, but it contains {entry!r} of type "
                f"{type(entry).__qualname__} ({kind}); pass the class object itself, "
                f"e.g. {{{type(entry).__qualname__}}} or {{nn.TransformerEncoderLayer}}"
            )
    return result


def _named_modules_post_order(
    root_module: nn.Module, ignored_modules: set[nn.Module]
) -> list[tuple[str, nn.Module]]:
    """``(fqn, module)`` for every module under ``root_module`` (root last, fqn ``""``),
    children before parents in registration order. A module reachable by several paths is
    listed once, under its first path. Ignored modules are skipped with their subtrees (torch's
    FSDP expands ``ignored_modules`` to whole subtrees before running the policy, so this
    gives the same answer whether or not the caller expanded them)."""
    result: list[tuple[str, nn.Module]] = []
    if root_module in ignored_modules:
        return result
    visited: set[nn.Module] = {root_module}

    def visit(module: nn.Module, fqn: str) -> None:
        for name, child in module.named_children():
            if child in visited or child in ignored_modules:
                continue
            visited.add(child)
            visit(child, f"{fqn}.{name}" if fqn else name)
        result.append((fqn, module))

    visit(root_module, "")
    return result


# ---------------------------------------------------------------------------
# Policy objects
# ---------------------------------------------------------------------------


class _Policy(ABC):
    """A rule choosing the modules of a tree to wrap, and the kwargs to wrap each with."""

    @abstractmethod
    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """Map each target module under ``root_module`` to its constructor kwargs.

        The kwargs are a shallow copy of ``root_kwargs`` with any per-module overrides
        applied, so changing one module's dict never changes another's. Iteration order is
        post-order (children before parents). Subtrees of ``ignored_modules`` are skipped.
        The root may appear as a target for ``ModuleWrapPolicy`` and ``CustomPolicy``, as in
        torch; callers that wrap the root themselves should drop it.
        """


class ModuleWrapPolicy(_Policy):
    """Wrap every module that is an instance of one of ``module_classes``, with the root's
    kwargs.

    As in torch, the root module is a target too when it is an instance of one of the
    classes (torch's FSDP then skips it, since it wraps the root itself).

    Example::

        >>> policy = ModuleWrapPolicy({nn.TransformerEncoderLayer})
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        # dict.fromkeys: deduplicate while keeping the caller's order for a stable repr.
        classes = _as_class_tuple(module_classes, "ModuleWrapPolicy(module_classes)")
        self._module_classes: tuple[type, ...] = tuple(dict.fromkeys(classes))

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """See ``_Policy._run_policy``."""
        return {
            module: copy.copy(root_kwargs)
            for _, module in _named_modules_post_order(root_module, ignored_modules)
            if isinstance(module, self._module_classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        """Act as a legacy callable policy: always descend, wrap instances of the classes."""
        return recurse or isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        names = ", ".join(cls.__qualname__ for cls in self._module_classes)
        return f"{type(self).__name__}({{{names}}})"


class CustomPolicy(_Policy):
    """Wrap the modules that ``lambda_fn`` picks, optionally with per-module kwargs.

    ``lambda_fn(module)`` returns:

    - ``False`` or ``{}``: do not wrap ``module``;
    - ``True``: wrap it with the root's kwargs;
    - a non-empty dict: wrap it with the root's kwargs updated by the dict.

    It is called on every non-ignored module, the root included (as in torch, the root may
    therefore be a target).

    Example::

        >>> def lambda_fn(module: nn.Module) -> bool | dict[str, Any]:
        ...     if module is model.lm_head:
        ...         return {"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}
        ...     return isinstance(module, TransformerBlock)
        >>> policy = CustomPolicy(lambda_fn)
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError(
                "CustomPolicy(lambda_fn) needs a callable mapping a module to True/False or "
                f"a kwargs dict, but got {lambda_fn!r} of type {type(lambda_fn).__qualname__}"
            )
        self._lambda_fn = lambda_fn

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """See ``_Policy._run_policy``."""
        targets: dict[nn.Module, dict[str, Any]] = {}
        for fqn, module in _named_modules_post_order(root_module, ignored_modules):
            decision = self._lambda_fn(module)
            if not isinstance(decision, (bool, dict)):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy must return True/False or a kwargs "
                    f"dict, but for module {fqn or '<root>'} ({type(module).__qualname__}) it "
                    f"returned {decision!r} of type {type(decision).__qualname__}"
                )
            if not decision:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(decision, dict):
                kwargs.update(decision)
            targets[module] = kwargs
        return targets

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._lambda_fn!r})"


# [Note: legacy recursive policy]
# A legacy policy is asked two questions per module, exactly as torch's `_recursive_wrap`
# asks them, in this order:
#   1. fn(module, recurse=True, nonwrapped_numel=N): descend into the children? N is the
#      numel of the module's parameters, minus ignored ones, each counted once.
#   2. after the children: fn(module, recurse=False, nonwrapped_numel=R): wrap this module?
#      R is the numel of those parameters that no target below the module holds.
# A module that is not descended into is not wrapped either. The root is only asked
# question 1 (torch passes only_wrap_children=True).
# One deliberate difference: torch computes R as N minus the sum of what each child subtree
# reported wrapped, so a parameter held by two wrapped units below the module (e.g. two tied
# Linears) is subtracted twice and R can even go negative. Here R subtracts the union, so
# each parameter counts once. A module reachable by two paths is asked about once, and
# what its subtree holds counts under both parents, as torch's second walk of it would.
# Without parameters shared between units below one module, the answers are identical.


class _RecursiveWalk:
    """One run of a legacy policy over a module tree; see [Note: legacy recursive policy]."""

    def __init__(self, policy_fn: _LegacyPolicyFn, ignored_modules: set[nn.Module]) -> None:
        self.policy_fn = policy_fn
        # Subtrees of ignored modules are skipped, and their parameters never counted.
        self.ignored_modules = ignored_modules
        self.ignored_params: set[nn.Parameter] = {
            p for m in ignored_modules for p in m.parameters()
        }
        # Per walked module: the parameters held by targets in its subtree (itself included).
        # Doubles as the visited set, so a module under two parents is walked once.
        self.held_below: dict[nn.Module, set[nn.Parameter]] = {}
        # Chosen targets, in post-order.
        self.targets: list[nn.Module] = []

    def run(self, root_module: nn.Module) -> list[nn.Module]:
        """Walk ``root_module`` (descended into, never a target) and return the targets."""
        assert not self.held_below, "a _RecursiveWalk runs once"
        if root_module not in self.ignored_modules:
            self._visit(root_module, is_root=True)
        return self.targets

    def _held_by_subtree(self, module: nn.Module) -> set[nn.Parameter]:
        if module not in self.held_below:
            self.held_below[module] = self._visit(module, is_root=False)
        return self.held_below[module]

    def _visit(self, module: nn.Module, is_root: bool) -> set[nn.Parameter]:
        params = {p for p in module.parameters() if p not in self.ignored_params}
        if not self._ask(module, recurse=True, numel=_numel(params)):
            return set()
        held: set[nn.Parameter] = set()
        for child in module.children():
            if child not in self.ignored_modules:
                held |= self._held_by_subtree(child)
        if is_root:
            return held
        if self._ask(module, recurse=False, numel=_numel(params - held)):
            self.targets.append(module)
            return params
        return held

    def _ask(self, module: nn.Module, recurse: bool, numel: int) -> bool:
        return bool(self.policy_fn(module=module, recurse=recurse, nonwrapped_numel=numel))


def _numel(params: Iterable[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


class _CallablePolicy(_Policy):
    """Adapter running a legacy ``fn(module, recurse, nonwrapped_numel)`` policy with torch's
    recursive algorithm; the root is never a target."""

    def __init__(self, policy_fn: _LegacyPolicyFn) -> None:
        self._policy_fn = policy_fn

    def _run_policy(
        self,
        root_module: nn.Module,
        ignored_modules: set[nn.Module],
        root_kwargs: dict[str, Any],
    ) -> dict[nn.Module, dict[str, Any]]:
        """See ``_Policy._run_policy`` and [Note: legacy recursive policy]."""
        walk = _RecursiveWalk(self._policy_fn, ignored_modules)
        return {module: copy.copy(root_kwargs) for module in walk.run(root_module)}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._policy_fn!r})"


def resolve_policy(policy: _Policy | _LegacyPolicyFn | None) -> _Policy | None:
    """Normalize an ``auto_wrap_policy`` argument: ``None`` stays ``None``, a ``_Policy`` is
    returned as is, and a legacy callable (``always_wrap_policy``, a ``functools.partial`` of
    ``size_based_auto_wrap_policy``, ...) is adapted to a ``_Policy``."""
    if policy is None or isinstance(policy, _Policy):
        return policy
    if isinstance(policy, type):
        raise TypeError(
            f"auto_wrap_policy got the class {policy.__qualname__}; to wrap every instance of "
            f"it, pass ModuleWrapPolicy({{{policy.__qualname__}}})"
        )
    if not callable(policy):
        hint = ""
        if isinstance(policy, (set, frozenset, list, tuple)):
            hint = "; to wrap instances of some classes, pass ModuleWrapPolicy({...})"
        raise TypeError(
            "auto_wrap_policy must be None, a ModuleWrapPolicy/CustomPolicy, or a callable "
            f"fn(module, recurse, nonwrapped_numel) -> bool, but got {policy!r} of type "
            f"{type(policy).__qualname__}{hint}"
        )
    return _CallablePolicy(policy)


# ---------------------------------------------------------------------------
# Legacy callable policies
# ---------------------------------------------------------------------------


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Descend everywhere and wrap every submodule (the root is wrapped by the caller)."""
    return True


def lambda_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    lambda_fn: Callable[[nn.Module], bool],
) -> bool:
    """Descend everywhere; wrap a module when ``lambda_fn(module)`` is true.

    Use as ``functools.partial(lambda_auto_wrap_policy, lambda_fn=...)``.
    """
    return recurse or bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Descend everywhere; wrap instances of the classes in ``transformer_layer_cls``.

    Use as ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})``.
    Parameters shared across layers (e.g. tied embeddings) must end up in one unit, so keep
    them outside the wrapped layer classes.
    """
    classes = _as_class_tuple(transformer_layer_cls, "transformer_layer_cls")
    return recurse or isinstance(module, classes)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameter numel is not yet
    managed by a wrapped descendant.

    Worked example with ``min_num_params=100``: ``Sequential(Linear(10, 10), Linear(2, 2))``
    as a child of the root has 110 + 6 = 116 numel, so it is descended into; the first
    Linear (110) is wrapped, the second (6) is not; the Sequential's remainder is 6 < 100,
    so it is not wrapped and its 6 numel go to the parent's unit.

    Args:
        module: the module asked about.
        recurse: ``True`` asks whether to descend into the children, ``False`` whether to
            wrap ``module``.
        nonwrapped_numel: parameter numel of ``module`` not yet managed by a wrapped unit.
        min_num_params: threshold on ``nonwrapped_numel`` (numel, despite the name).
        force_leaf_modules: classes never descended into (their children are never wrapped);
            defaults to ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``
            (``{nn.MultiheadAttention}``).
        exclude_wrap_modules: classes never wrapped themselves; defaults to
            ``size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES``
            (``{nn.ModuleList, nn.ModuleDict}``).
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        leaf_classes = _as_class_tuple(force_leaf_modules, "force_leaf_modules")
        return is_large and not isinstance(module, leaf_classes)
    excluded_classes = _as_class_tuple(exclude_wrap_modules, "exclude_wrap_modules")
    return is_large and not isinstance(module, excluded_classes)


# Defaults as attributes of the function, as torch has them, so users can read and extend them.
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------
# Manual wrapping: enable_wrap / wrap
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _WrapConfig:
    """What ``wrap()`` does inside one ``enable_wrap`` context."""

    wrapper_cls: Callable[..., nn.Module]
    """Called as ``wrapper_cls(module, **kwargs)``."""
    wrapper_kwargs: dict[str, Any]
    """Defaults for every ``wrap()`` in the context; ``wrap()``'s own kwargs win."""


class _WrapContext:
    """Process-wide state of ``enable_wrap``: one context at a time, visible from every
    thread, as torch's ``_ConfigAutoWrap`` (a ContextVar would hide it from worker threads
    that build submodules)."""

    def __init__(self) -> None:
        self.config: _WrapConfig | None = None

    def enter(self, config: _WrapConfig) -> None:
        """Start a context; nesting is not supported, as in torch."""
        if self.config is not None:
            raise NotImplementedError(
                "enable_wrap() contexts cannot be nested: already inside one with "
                f"wrapper_cls={self.config.wrapper_cls!r}; exit it first, or pass per-module "
                "kwargs to wrap(module, **overrides) instead"
            )
        self.config = config

    def exit(self) -> None:
        """End the current context."""
        assert self.config is not None, "exit() without a matching enter()"
        self.config = None


_WRAP_CONTEXT = _WrapContext()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make ``wrap()`` wrap modules with ``wrapper_cls(module, **wrapper_kwargs)``.

    Useful to shard large layers while the model is built, so the full model never has to
    fit in memory at once::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_kwargs):
            self.l1 = wrap(nn.Linear(5, 5))
    """
    if not callable(wrapper_cls):
        raise TypeError(
            "enable_wrap(wrapper_cls=...) needs a class or callable taking (module, **kwargs), "
            f"but got {wrapper_cls!r} of type {type(wrapper_cls).__qualname__}"
        )
    _WRAP_CONTEXT.enter(_WrapConfig(wrapper_cls, dict(wrapper_kwargs)))
    try:
        yield
    finally:
        _WRAP_CONTEXT.exit()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Inside ``enable_wrap(wrapper_cls=X, **kw)`` return ``X(module, **{**kw, **overrides})``;
    outside it return ``module`` unchanged, so models build with or without a wrapper."""
    config = _WRAP_CONTEXT.config
    if config is None:
        return module
    return config.wrapper_cls(module, **{**config.wrapper_kwargs, **wrap_overrides})
