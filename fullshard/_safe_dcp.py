"""Reading a DCP checkpoint without running pickled code (see ``fullshard.checkpoint``):
DCP's ``.metadata`` pickle through an unpickler that only builds DCP's metadata classes,
``torch.Size``, dtypes and paths, its data files checked to lie inside the checkpoint
folder, and DCP's non-tensor items loaded with ``torch.load(weights_only=True)``."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

__all__: list[str] = []


METADATA_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "BytesStorageMetadata",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
"""What DCP's metadata pickle may name (what torch 2.4-2.13 write), besides torch dtypes."""


class MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which a DCP checkpoint's metadata "
            "never holds; refusing to load it (it could run code)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader, with the metadata unpickled safely and its data files checked to
    lie inside the checkpoint folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        folder = Path(self.path)
        with open(folder / ".metadata", "rb") as handle:
            try:
                metadata = MetadataUnpickler(handle).load()
            except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as error:
                raise ValueError(
                    f"checkpoint {folder}: unreadable DCP metadata: {error}"
                ) from error
        if not isinstance(metadata, Metadata):
            raise ValueError(f"checkpoint {folder}: .metadata holds {type(metadata).__name__}")
        root = folder.resolve()
        for info in (metadata.storage_data or {}).values():
            relative = getattr(info, "relative_path", None)
            if relative is None or not (root / relative).resolve().is_relative_to(root):
                raise ValueError(
                    f"checkpoint {folder}: its metadata points at {relative!r}, outside the "
                    "checkpoint folder; refusing to read it"
                )
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor items are unpickled with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
