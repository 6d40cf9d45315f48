"""The opt-in switch: torch's FSDP names resolve to fullshard's, for stacks that import torch's
FSDP themselves (accelerate, transformers' Trainer, Lightning, torchtitan, TRL).

    import fullshard
    fullshard.install()             # in Python, before the stack builds its model

    FULLSHARD_INSTALL=1 accelerate launch train.py   # or torchrun ...: every process

This is the one module of fullshard that imports torch's FSDP, and only to replace names.

[Note: the install switch]
``install()`` points every public name of ``torch.distributed.fsdp`` that fullshard defines
(FSDP1's ``FullyShardedDataParallel`` and its config types, FSDP2's ``fully_shard``,
``FSDPModule`` and policies, the wrap policies, ``ShardedGradScaler``) at fullshard's, in
the package and in the submodules stacks import them from (``.api``,
``.fully_sharded_data_parallel``, ``.wrap``, ``.sharded_grad_scaler``, ``._fully_shard``
and its modules, and the old path ``torch.distributed._composable.fsdp``). Modules imported
later find fullshard's names there; modules loaded later still are swapped right after they
execute (an import hook). A module that bound torch's names before the switch keeps them,
so the switch belongs before the stack is imported: ``FULLSHARD_INSTALL=1`` runs it at
interpreter start, through the ``fullshard-install.pth`` file the package installs into
site-packages, in every process (launchers pass the environment to their workers), and
registers only the hook there: torch is imported by whoever needs it, not by the switch.
While ``torch._dynamo`` is still importing (it imports torch's FSDP, and fullshard's hooks
need it), the swap waits for the next import.

``isinstance(m, torch's FSDPModule)`` holds for fullshard's modules too: with the switch on,
the class ``fully_shard`` gives a module also derives from torch's ``FSDPModule`` (after
fullshard's own, whose methods come first), so code that bound torch's class early still
recognises them. torch's own config objects are accepted by both front doors anyway
([Note: torch's configuration objects] in ``api``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

__all__ = ["TESTED_TORCH", "install", "installed"]

logger = logging.getLogger(__name__)

TESTED_TORCH = ((2, 13),)
"""The torch releases (major, minor) fullshard's switch is tested with."""

ENV_VAR = "FULLSHARD_INSTALL"

_FSDP = "torch.distributed.fsdp"
_FSDP2_NAMES = [
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]
_FSDP1_NAMES = [
    "BackwardPrefetch",
    "CPUOffload",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
]
_HOMES: dict[str, list[str]] = {
    _FSDP: _FSDP1_NAMES + _FSDP2_NAMES,
    f"{_FSDP}.api": _FSDP1_NAMES,
    f"{_FSDP}.fully_sharded_data_parallel": _FSDP1_NAMES,
    f"{_FSDP}.sharded_grad_scaler": ["ShardedGradScaler"],
    f"{_FSDP}.wrap": [],  # every name of fullshard.wrap.__all__
    f"{_FSDP}._fully_shard": _FSDP2_NAMES,
    f"{_FSDP}._fully_shard._fully_shard": _FSDP2_NAMES,
    f"{_FSDP}._fully_shard._fsdp_api": _FSDP2_NAMES,
    "torch.distributed._composable.fsdp": _FSDP2_NAMES,
    "torch.distributed._composable.fsdp.fully_shard": _FSDP2_NAMES,
}
"""torch's modules whose names the switch replaces, and the names (those they define)."""

_STATE: dict[str, Any] = {
    "installed": False,
    "pending_log": False,  # started by FULLSHARD_INSTALL: check torch's version at the swap
    "deferred": False,  # a swap waits for torch._dynamo to finish importing
}


def installed() -> bool:
    """Whether the switch is on in this process."""
    return bool(_STATE["installed"])


def install() -> None:
    """Make torch's FSDP names resolve to fullshard's (see [Note: the install switch]).
    Idempotent; logs once per process; warns if torch's release is not one fullshard's
    switch is tested with."""
    if not _STATE["installed"]:
        _STATE["installed"] = True
        _check_torch_version()
        logger.info("fullshard serves torch.distributed.fsdp in this process (pid %d)", os.getpid())
        if not any(isinstance(finder, _SwapOnImport) for finder in sys.meta_path):
            sys.meta_path.insert(0, _SwapOnImport())
    _swap_loaded()


def install_at_startup() -> None:
    """``FULLSHARD_INSTALL=1`` at interpreter start: the import hook only (torch is not
    imported here); the swap runs when torch's FSDP is imported."""
    if _STATE["installed"]:
        return
    _STATE["installed"] = True
    _STATE["pending_log"] = True
    sys.meta_path.insert(0, _SwapOnImport())


def _check_torch_version() -> None:
    import torch

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release not in TESTED_TORCH:
        tested = ", ".join(f"{major}.{minor}" for major, minor in TESTED_TORCH)
        warnings.warn(
            f"fullshard.install(): torch {torch.__version__} is not a release fullshard's "
            f"switch is tested with ({tested}); torch's FSDP modules may have moved names",
            stacklevel=3,
        )


def _importing(name: str) -> bool:
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _swap_loaded(just_loaded: str | None = None) -> None:
    """Replace the names in every home module already imported; not while ``torch._dynamo``
    (fullshard's modules need it) or torch's FSDP package is still importing, except the
    module ``just_loaded``, whose code has run: the next import retries."""
    if _importing("torch._dynamo") or (just_loaded != _FSDP and _importing(_FSDP)):
        _STATE["deferred"] = True
        return
    _STATE["deferred"] = False
    if _STATE["pending_log"]:
        _STATE["pending_log"] = False
        _check_torch_version()
        logger.info("fullshard serves torch.distributed.fsdp in this process (pid %d)", os.getpid())
    from ._fsdp2.state import TorchFSDPModule  # not at start-up: it imports torch

    ours = _fullshard_names()
    for home, names in _HOMES.items():
        module = sys.modules.get(home)
        if module is None:
            continue
        original = vars(module).get("FSDPModule")
        if original is not None and original is not ours["FSDPModule"]:
            TorchFSDPModule.cls = original
        for name in ours["__wrap__"] if home.endswith(".wrap") else names:
            if hasattr(module, name):
                setattr(module, name, ours[name])


def _fullshard_names() -> dict[str, Any]:
    """fullshard's object for each name the switch replaces (``__wrap__``: wrap's names)."""
    from . import _fsdp2, api, fully_sharded_data_parallel, sharded_grad_scaler, wrap

    ours: dict[str, Any] = {"__wrap__": list(wrap.__all__)}
    for source in (api, _fsdp2, fully_sharded_data_parallel, sharded_grad_scaler, wrap):
        ours.update((name, getattr(source, name)) for name in source.__all__)
    return ours


class _SwapAfterExec(importlib.abc.Loader):
    """torch's own loader of a home module, with the swap run after it."""

    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _swap_loaded(module.__name__)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, is_package...
        return getattr(self._loader, name)


class _SwapOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loaders of the home modules; at every other import, retries a swap that
    waited for ``torch._dynamo``."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _HOMES:
            if _STATE["deferred"]:
                _swap_loaded()
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _SwapAfterExec(spec.loader)
        return spec
