"""Bytes of the tensors a piece of torch code allocates and frees, seen op by op."""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class NewTensorBytes(TorchDispatchMode):
    """Under this mode, ``peak`` is the most bytes that tensors the ops allocated held at
    once: each op's output whose storage is not one of ``existing`` (nor a view of one)
    counts from its creation until the Python tensor is collected, which for temporaries is
    when their storage is freed."""

    def __init__(self, existing: Iterable[torch.Tensor]) -> None:
        super().__init__()
        self._existing = {t.untyped_storage().data_ptr() for t in existing}
        self._new: set[int] = set()
        self.live = 0
        self.peak = 0

    def _freed(self, nbytes: int, pointer: int) -> None:
        self.live -= nbytes
        self._new.discard(pointer)  # an address the allocator may hand out again

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            pointer = tensor.untyped_storage().data_ptr()
            if pointer in self._existing or pointer in self._new:
                continue
            nbytes = tensor.untyped_storage().nbytes()
            self._new.add(pointer)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(tensor, self._freed, nbytes, pointer)
        return out
