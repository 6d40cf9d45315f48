"""A checkpoint folder's names and its metadata file, without torch: ``fullshard train``'s
launcher reads them to refuse a bad ``--resume`` before any rank starts (see
`fullshard.checkpoint` for the format and [Note: atomic checkpoints])."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["FORMAT", "METADATA_FILE", "previous", "read_metadata", "read_metadata_of", "resolve"]

METADATA_FILE = "fullshard.json"
FORMAT = "fullshard-checkpoint"
"""``fullshard.json``'s ``format``."""


def previous(path: Path) -> Path:
    """Where the checkpoint at ``path`` is kept while a save swaps the new one in."""
    return path.parent / f".{path.name}.previous"


def resolve(path: Path) -> Path:
    """The complete checkpoint folder at ``path``, or its previous one if a save was
    interrupted between its two renames; raises if there is none."""
    if (path / METADATA_FILE).is_file():
        return path
    kept = previous(path)
    if (kept / METADATA_FILE).is_file():
        warnings.warn(
            f"checkpoint {path} is missing (a save was interrupted while swapping it in); "
            f"loading the previous complete one, {kept}",
            stacklevel=3,
        )
        return kept
    if path.exists():
        raise ValueError(
            f"{path} is not a complete fullshard checkpoint: it has no {METADATA_FILE} (a save "
            "that did not finish, or a folder written by something else)"
        )
    raise FileNotFoundError(f"no checkpoint at {path}")


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The metadata of the checkpoint at ``path`` (no process group needed)."""
    return read_metadata_of(resolve(Path(path)))


def read_metadata_of(folder: Path) -> dict[str, Any]:
    """The metadata in the checkpoint ``folder`` (already resolved), checked for its format."""
    try:
        with open(folder / METADATA_FILE, encoding="utf-8") as handle:
            metadata = json.load(handle)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"{folder / METADATA_FILE} is unreadable: {error}") from error
    found = metadata.get("format") if isinstance(metadata, dict) else type(metadata).__name__
    if found != FORMAT:
        raise ValueError(f"{folder} is not a fullshard checkpoint (format {found!r})")
    return metadata
