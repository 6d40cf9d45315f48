"""Checkpoints for training loops: ``save`` and ``load`` on ``torch.distributed.checkpoint``.

::

    fullshard.checkpoint.save("ckpt/latest", model, optim, step=step)
    ...
    step = fullshard.checkpoint.load("ckpt/latest", model, optim)["step"]

A checkpoint is a folder: DCP's files (each rank writes its own shards; model and optimizer
state as SHARDED state dicts, so it loads at any world size and sharding strategy) and
``fullshard.json``, the metadata: step, world size, strategies, every state dict key with its
shape and dtype, which optimizer states exist, the JSON-serialisable extras, and every
file's size and SHA-256 (checked by ``load``, see [Note: checkpoint digests]).

[Note: atomic checkpoints]
``save`` writes into ``.<name>.partial-<token>`` beside ``path``; ``fullshard.json`` is
written last, after every rank's files. Only then does rank 0 swap it in: ``path`` is renamed
to ``.<name>.previous``, the partial folder to ``path``, and the previous one is removed. A
crash at any point leaves a complete checkpoint: ``path`` itself, or between the two renames
``.<name>.previous``, which ``load`` falls back to. Leftover partial folders are removed by
the next successful save.

Loading runs no pickled code: tensors and DCP's non-tensor items are read with
``torch.load(weights_only=True)`` (DCP's default planner would unpickle arbitrary objects),
and DCP's ``.metadata`` file, a pickle, through an unpickler that only builds DCP's metadata
classes, ``torch.Size``, dtypes and paths. Every data file the metadata names must lie
inside the checkpoint folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ._checkpoint_folder import FORMAT, METADATA_FILE, read_metadata, read_metadata_of
from ._checkpoint_folder import previous as _previous
from ._checkpoint_folder import resolve as _resolve
from ._comm.collectives import CollectiveError, lost_a_peer, named
from ._engine.unit import units_in
from ._safe_dcp import SafeLoadPlanner, SafeReader
from .api import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType
from .fully_sharded_data_parallel import FullyShardedDataParallel

__all__ = ["CheckpointCorruptedError", "CheckpointMismatchError", "load", "read_metadata", "save"]

logger = logging.getLogger(__name__)

_VERSION = 1


class CheckpointMismatchError(ValueError):
    """The checkpoint was saved from a model with other parameters or shapes."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _uses_fully_shard(model: nn.Module) -> bool:
    """Whether ``model`` was sharded by ``fully_shard`` (FSDP2): torch's state-dict API reads
    and loads it natively (DTensor parameters and optimizer states under the plain model's
    names), where a ``FullyShardedDataParallel`` model goes through FSDP1's methods."""
    units = units_in(model)
    fsdp2 = [unit for unit in units if unit.settings.sharding.mesh is not None]
    if fsdp2 and len(fsdp2) != len(units):
        raise ValueError(
            f"{type(model).__name__} holds both FullyShardedDataParallel and fully_shard "
            "units; fullshard.checkpoint saves one kind per model. Shard it with one API"
        )
    return bool(fsdp2)


def _states(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The model's (and optimizer's) sharded state dicts, keyed by the plain model's names."""
    if _uses_fully_shard(model):
        from torch.distributed.checkpoint import state_dict as torch_state_dict

        state: dict[str, Any] = {"model": torch_state_dict.get_model_state_dict(model)}
        if optim is not None:
            state["optim"] = torch_state_dict.get_optimizer_state_dict(model, optim)
        return state
    with _sharded(model):
        state = {"model": model.state_dict()}
        if optim is not None:
            state["optim"] = FullyShardedDataParallel.optim_state_dict(model, optim)
    return state


def _sharded(model: nn.Module) -> Any:
    return FullyShardedDataParallel.state_dict_type(
        model,
        StateDictType.SHARDED_STATE_DICT,
        ShardedStateDictConfig(),
        ShardedOptimStateDictConfig(offload_to_cpu=False),
    )


def _describe(state: Any) -> dict[str, Any]:
    """Each tensor key of a (model) state dict: its full shape and dtype."""
    described = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            shape = list(value.shape)  # a DTensor's shape is the full one
            described[key] = {"shape": shape, "dtype": str(value.dtype).removeprefix("torch.")}
    return described


def _split_extra(extra: dict[str, Any]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    values: dict[str, Any] = {}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in extra.items():
        if isinstance(value, torch.Tensor):
            tensors[name] = value.detach()
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"checkpoint.save: extra value '{name}' ({type(value).__name__}) is neither a "
                "tensor nor JSON-serialisable; pass numbers, strings, lists, dicts or tensors"
            ) from error
        values[name] = value
    return values, tensors


def save(
    path: str | os.PathLike[str],
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    **extra: Any,
) -> None:
    """Save ``model`` (FSDP-wrapped) and ``optim`` to the folder ``path``, atomically (see
    [Note: atomic checkpoints]). ``extra`` values (e.g. ``step=...``) must be the same on
    every rank: tensors are saved with the state, other values (JSON-serialisable) in the
    metadata. Collective: call it on every rank with the same ``path`` (on a file system
    every rank sees)."""
    path = Path(path)
    values, tensors = _split_extra(extra)
    try:
        _save(path, model, optim, values, tensors)
    except CollectiveError:
        raise
    except (RuntimeError, CheckpointException) as error:
        if not (dist.is_initialized() and lost_a_peer(error)):
            raise  # a local mistake: its own message says what is wrong
        raise CollectiveError(
            f"fullshard: checkpoint.save({str(path)!r}) failed on rank {_rank()}: another rank "
            "died or stopped taking part while saving. The previous checkpoint there, if any, "
            f"is intact. (Underlying error: {str(error).strip()[:2000]})"
        ) from error


def _save(
    path: Path,
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    values: dict[str, Any],
    tensors: dict[str, torch.Tensor],
) -> None:
    token = [uuid.uuid4().hex[:12]]
    if dist.is_initialized():
        with named("the broadcast of the checkpoint's partial folder name"):
            dist.broadcast_object_list(token, src=0)
    partial = path.parent / f".{path.name}.partial-{token[0]}"
    state = _states(model, optim)
    if tensors:
        state["extra"] = tensors
    metadata = _metadata(model, optim, state, values)

    def make_folder() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)

    _rank0_then_every_rank(f"creating {path.parent}", make_folder)
    dcp.save(state, checkpoint_id=partial)
    metadata["files"] = _digests_of_written_files(partial)

    def commit() -> None:
        _write_json(partial / METADATA_FILE, metadata)
        _commit(partial, path)

    _rank0_then_every_rank(f"writing {METADATA_FILE} and swapping the checkpoint in", commit)


def _rank0_then_every_rank(step: str, action: Callable[[], None]) -> None:
    """Run ``action`` on rank 0 (a file operation of the save's), then agree on how it
    went: where it failed (a full disk, permissions), every rank raises its error. With a
    barrier the others learned only that rank 0 was gone, or, where rank 0's caller caught
    the error and went on, waited for the group's timeout."""
    if not dist.is_initialized():
        action()
        return
    problem: list[Any] = [""]
    failure: OSError | None = None
    if _rank() == 0:
        try:
            action()
        except OSError as error:
            problem[0], failure = f"{type(error).__name__}: {error}", error
    with named("the exchange of how rank 0's step of fullshard.checkpoint went"):
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise OSError(
            f"fullshard: checkpoint.save failed on rank 0 while {step}: {problem[0]}. The "
            "previous checkpoint there, if any, is intact"
        ) from failure


# [Note: checkpoint digests]
# DCP's files carry no checksum: a flipped bit in a .distcp file loads without complaint (a
# weight of -0.0037 came back as -1.27e36). After writing, each rank hashes the files it
# wrote (DCP names them __<rank>_<n>.distcp; rank 0 also writes .metadata) and rank 0 records
# every file's size and SHA-256 in fullshard.json. `load` checks them before reading, the
# files split across the ranks, and raises CheckpointCorruptedError naming each bad file.


class CheckpointCorruptedError(ValueError):
    """A checkpoint file's size or SHA-256 differs from what the save recorded."""


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _digests_of_written_files(folder: Path) -> dict[str, dict[str, Any]]:
    """{file name: {"bytes", "sha256"}} of every file of the DCP save in ``folder``."""
    rank = _rank()
    mine = sorted(folder.glob(f"__{rank}_*.distcp"))
    if rank == 0:
        mine.append(folder / ".metadata")
    digests = {f.name: {"bytes": f.stat().st_size, "sha256": _sha256(f)} for f in mine}
    if not dist.is_initialized():
        return digests
    everyone: list[Any] = [None] * dist.get_world_size()
    with named("the exchange of checkpoint file digests"):
        dist.all_gather_object(everyone, digests)
    return {name: entry for part in everyone for name, entry in part.items()}


def _verify_files(folder: Path, files: dict[str, dict[str, Any]]) -> None:
    """Check the recorded sizes and digests, each rank a share of the files; raise on every
    rank naming every bad file."""
    rank = _rank()
    world = dist.get_world_size() if dist.is_initialized() else 1
    problems = []
    for index, (name, expected) in enumerate(sorted(files.items())):
        if index % world != rank:
            continue
        file = folder / name
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != expected["bytes"]:
            problems.append(f"{name} has {file.stat().st_size} bytes, {expected['bytes']} saved")
        elif _sha256(file) != expected["sha256"]:
            problems.append(f"{name}'s contents changed since the save (SHA-256 differs)")
    if dist.is_initialized():
        everyone: list[Any] = [None] * world
        with named("the exchange of checkpoint verification results"):
            dist.all_gather_object(everyone, problems)
        problems = [p for part in everyone for p in part]
    if problems:
        raise CheckpointCorruptedError(
            f"checkpoint {folder} is damaged: {'; '.join(sorted(problems))}. Load an earlier "
            "checkpoint, or pass verify=False to load it anyway"
        )


def _metadata(
    model: nn.Module,
    optim: torch.optim.Optimizer | None,
    state: dict[str, Any],
    values: dict[str, Any],
) -> dict[str, Any]:
    units = units_in(model)
    optim_states = None
    if optim is not None:
        optim_states = {fqn: sorted(s) for fqn, s in state["optim"]["state"].items()}
    return {
        "format": FORMAT,
        "version": _VERSION,
        "step": values.get("step"),
        "world_size": dist.get_world_size() if dist.is_initialized() else 1,
        "api": "fully_shard" if _uses_fully_shard(model) else "FullyShardedDataParallel",
        "sharding_strategies": sorted({unit.settings.sharding.strategy.name for unit in units}),
        "use_orig_params": bool(units) and units[0].settings.use_orig_params,
        "model": _describe(state["model"]),
        "optimizer": type(optim).__name__ if optim is not None else None,
        "optimizer_states": optim_states,
        "extra": values,
        "extra_tensors": _describe(state.get("extra", {})),
        "torch_version": torch.__version__,
    }


def _write_json(file: Path, value: dict[str, Any]) -> None:
    with open(file, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_dir(file.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(partial: Path, path: Path) -> None:
    """Swap the complete ``partial`` folder in as ``path`` (rank 0)."""
    previous = _previous(path)
    if path.exists():
        if previous.exists():  # `path` is complete, so the older one can go
            shutil.rmtree(previous)
        os.rename(path, previous)
    os.rename(partial, path)
    _fsync_dir(path.parent)
    shutil.rmtree(previous, ignore_errors=True)
    for stale in path.parent.glob(f".{path.name}.partial-*"):
        shutil.rmtree(stale, ignore_errors=True)


# -- loading -----------------------------------------------------------------------------------


def _agreed_checkpoint(path: Path) -> tuple[Path, dict[str, Any]]:
    """The checkpoint folder at ``path`` and its metadata, agreed by every rank: each rank
    resolves ``path`` on its own file system (it may be a host's own mount), so a rank that
    cannot see it, or a save swapping the folders in between two ranks' looks (one rank
    finds ``path``, another its previous checkpoint), would otherwise raise on that rank
    alone while the others wait in the load's collectives, or load two different
    checkpoints. Every rank raises the same error instead."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        folder = _resolve(path)
        return folder, read_metadata_of(folder)
    folder, choice, problem, missing = path, "", "", False
    metadata: dict[str, Any] = {}
    try:
        folder = _resolve(path)
        metadata = read_metadata_of(folder)
        choice = "current" if folder == path else "previous"
    except (OSError, ValueError) as error:
        problem, missing = f"{type(error).__name__}: {error}", isinstance(error, FileNotFoundError)
    views: list[Any] = [None] * dist.get_world_size()
    with named("the exchange of the checkpoint folder each rank found"):
        dist.all_gather_object(views, (choice, problem, missing))
    problems = [f"rank {rank}: {p}" for rank, (_, p, _) in enumerate(views) if p]
    if problems:
        error_type = FileNotFoundError if all(m for _, p, m in views if p) else ValueError
        raise error_type(f"cannot load the checkpoint at {path}: {'; '.join(problems)}")
    if len({c for c, _, _ in views}) > 1:
        found = "; ".join(f"rank {rank}: {c}" for rank, (c, _, _) in enumerate(views))
        raise ValueError(
            f"the ranks found different checkpoints at {path} ({found}): a save was swapping "
            "it in while they looked. Load again once the save has finished"
        )
    return folder, metadata


def _check_model(folder: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise naming every key whose presence or shape differs."""
    missing = [key for key in current if key not in saved]
    unexpected = [key for key in saved if key not in current]
    changed = [
        f"{key} (checkpoint {tuple(saved[key]['shape'])}, model {tuple(current[key]['shape'])})"
        for key in current
        if key in saved and saved[key]["shape"] != current[key]["shape"]
    ]
    if not (missing or unexpected or changed):
        return
    parts = []
    if missing:
        parts.append(f"not in the checkpoint: {', '.join(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {', '.join(unexpected)}")
    if changed:
        parts.append(f"shapes differ: {', '.join(changed)}")
    raise CheckpointMismatchError(
        f"checkpoint {folder} was saved from another model.\n  " + "\n  ".join(parts)
    )


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (what DCP loads into): one step with zero
    gradients and zero learning rates, which leaves the parameters unchanged. The loaded
    state replaces it whole."""
    if all(param in optim.state for group in optim.param_groups for param in group["params"]):
        return
    filled = []
    for group in optim.param_groups:
        for param in group["params"]:
            if param.requires_grad and param.grad is None:
                param.grad = torch.zeros_like(param)
                filled.append(param)
    lrs = []
    for group in optim.param_groups:
        lr = group.get("lr")
        lrs.append(lr)
        if lr is not None:
            group["lr"] = torch.tensor(0.0) if isinstance(lr, torch.Tensor) else 0.0
    try:
        optim.step()
    finally:
        for group, lr in zip(optim.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr
        for param in filled:
            param.grad = None


def _optim_template(
    folder: Path, model: nn.Module, optim: torch.optim.Optimizer, saved: dict[str, list[str]] | None
) -> dict[str, Any]:
    """The SHARDED optimizer state dict DCP loads into: the states the checkpoint has."""
    if saved is None:
        raise ValueError(f"checkpoint {folder} holds no optimizer state (saved without optim)")
    _init_optim_state(optim)
    template = _states(model, optim)["optim"]
    absent = [fqn for fqn in saved if fqn not in template["state"]]
    if absent:
        raise CheckpointMismatchError(
            f"checkpoint {folder} has optimizer state for {', '.join(absent)}, which the "
            "optimizer does not hold; build it over the same parameters as when saving"
        )
    template["state"] = {
        fqn: {key: value for key, value in states.items() if key in saved[fqn]}
        for fqn, states in template["state"].items()
        if fqn in saved
    }
    return template


def _load_states(
    model: nn.Module, optim: torch.optim.Optimizer | None, state: dict[str, Any]
) -> None:
    """Give ``model`` and ``optim`` the state dicts DCP filled (``_states``' layout)."""
    if _uses_fully_shard(model):
        from torch.distributed.checkpoint import state_dict as torch_state_dict

        torch_state_dict.set_model_state_dict(model, state["model"])
        if optim is not None:
            torch_state_dict.set_optimizer_state_dict(model, optim, state["optim"])
        return
    with _sharded(model):
        model.load_state_dict(state["model"])
        if optim is not None:
            loadable = FullyShardedDataParallel.optim_state_dict_to_load(
                model, optim, state["optim"]
            )
            optim.load_state_dict(loadable)


def load(
    path: str | os.PathLike[str],
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    *,
    verify: bool = True,
) -> dict[str, Any]:
    """Load a checkpoint ``save`` wrote into ``model`` (and ``optim``), at any world size and
    sharding strategy; returns the extras given to ``save`` (e.g. ``["step"]``). Raises
    ``CheckpointMismatchError`` naming every parameter whose name or shape differs, and
    (with ``verify``) ``CheckpointCorruptedError`` naming every file whose size or SHA-256
    differs from the save's record (see [Note: checkpoint digests]).
    Collective: call it on every rank."""
    folder, metadata = _agreed_checkpoint(Path(path))
    if verify and metadata.get("files"):
        _verify_files(folder, metadata["files"])
    model_state = _states(model, None)["model"]
    _check_model(folder, metadata["model"], _describe(model_state))
    state: dict[str, Any] = {"model": model_state}
    if optim is not None:
        state["optim"] = _optim_template(folder, model, optim, metadata["optimizer_states"])
    extra_tensors = {
        name: torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
        for name, spec in metadata["extra_tensors"].items()
    }
    if extra_tensors:
        state["extra"] = extra_tensors
    dcp.load(state, storage_reader=SafeReader(folder), planner=SafeLoadPlanner())
    _load_states(model, optim, state)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if metadata["world_size"] != world_size:
        logger.info(
            "checkpoint %s was saved on %d ranks, loaded on %d (resharded)",
            folder,
            metadata["world_size"],
            world_size,
        )
    return {**metadata["extra"], **state.get("extra", {})}
