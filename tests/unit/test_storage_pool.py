"""``StoragePool``: a freed storage's memory comes back to the next unshard of that size."""

from __future__ import annotations

import torch

from fullshard._engine.storage_pool import StoragePool


def _freed(numel: int) -> tuple[torch.Tensor, torch.UntypedStorage]:
    tensor = torch.empty(numel)
    storage = tensor.untyped_storage()
    storage.resize_(0)
    return tensor, storage


def test_freed_memory_fills_the_next_storage_of_its_size() -> None:
    """``free`` keeps the memory (the storage is left with 0 bytes), ``fill`` hands that
    memory to another storage of the same size, whose views then read it."""
    pool = StoragePool()
    first = torch.arange(6.0)
    view = first[2:4]
    address = first.data_ptr()
    pool.free(first.untyped_storage())
    assert first.untyped_storage().nbytes() == 0 and pool.kept_bytes() == 24
    second, storage = _freed(6)
    pool.fill(storage, 24)
    assert second.data_ptr() == address and pool.kept_bytes() == 0
    torch.testing.assert_close(second, torch.arange(6.0))  # the same bytes, not a copy
    pool.fill(first.untyped_storage(), 24)  # nothing kept: fresh memory
    first.copy_(torch.full((6,), 7.0))
    torch.testing.assert_close(view, torch.full((2,), 7.0))  # old views see the new memory


def test_one_block_per_size_kept_until_clear() -> None:
    """A second block of a kept size is freed, not kept; ``clear`` gives every block back."""
    pool = StoragePool()
    for numel in (6, 6, 10):
        pool.free(torch.empty(numel).untyped_storage())
    assert pool.kept_bytes() == 24 + 40
    pool.clear()
    assert pool.kept_bytes() == 0
    _, storage = _freed(6)
    pool.fill(storage, 24)
    assert storage.nbytes() == 24


def test_fill_leaves_an_allocated_storage_of_that_size_alone() -> None:
    """Filling a storage that already holds the bytes keeps its memory and contents."""
    pool = StoragePool()
    pool.free(torch.empty(4).untyped_storage())
    tensor = torch.ones(4)
    address = tensor.data_ptr()
    pool.fill(tensor.untyped_storage(), 16)
    assert tensor.data_ptr() == address and pool.kept_bytes() == 16
    torch.testing.assert_close(tensor, torch.ones(4))
