"""``StoragePool``: a freed storage's memory comes back to the next unshard of that size."""

from __future__ import annotations

import pytest
import torch

from fullshard._engine.storage_pool import BLOCKS_PER_SIZE, StoragePool


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


def test_blocks_per_size_kept_until_clear() -> None:
    """A block beyond ``BLOCKS_PER_SIZE`` of its size is freed, not kept; ``clear`` gives
    every block back."""
    pool = StoragePool()
    for numel in [6] * (BLOCKS_PER_SIZE + 1) + [10]:
        pool.free(torch.empty(numel).untyped_storage())
    assert pool.kept_bytes() == 24 * BLOCKS_PER_SIZE + 40
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


def test_flat_layout_gradient_is_written_into_kept_memory() -> None:
    """The FSDP1 layout's views of a leaf (``_SplitLeaf``) backpropagate into one flat
    gradient in memory the pool kept: the values ``torch.split``'s backward gives, zeros for
    a piece that got no gradient."""
    from fullshard._engine.flat_segment import _SplitLeaf
    from fullshard._engine.left_grads import FlatLeftGrads
    from fullshard._engine.storage_pool import POOL

    POOL.clear()
    leaf = torch.zeros(7, requires_grad=True)
    freed = torch.empty(7)
    address = freed.data_ptr()
    POOL.free(freed.untyped_storage())
    a, b, c = _SplitLeaf.apply(leaf, FlatLeftGrads([3, 2, 2]), [3, 2, 2])
    assert a._base is leaf and torch.equal(b, leaf[3:5])  # views, as split gives
    (a.sum() + 2 * c.sum()).backward()
    assert leaf.grad is not None and leaf.grad.data_ptr() == address
    torch.testing.assert_close(leaf.grad, torch.tensor([1.0, 1, 1, 0, 0, 2, 2]))
    assert POOL.kept_bytes() == 0


def test_flat_layout_gradient_stays_differentiable_with_create_graph() -> None:
    """With ``create_graph=True`` the gradient through ``_SplitLeaf`` is itself differentiable
    (a second derivative, as through ``torch.split``)."""
    from fullshard._engine.flat_segment import _SplitLeaf
    from fullshard._engine.left_grads import FlatLeftGrads

    leaf = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    a, b = _SplitLeaf.apply(leaf, FlatLeftGrads([1, 2]), [1, 2])
    (grad,) = torch.autograd.grad((a**3).sum() + (b**2).sum(), leaf, create_graph=True)
    torch.testing.assert_close(grad, torch.tensor([3.0, 4.0, 6.0]))
    (second,) = torch.autograd.grad(grad.sum(), leaf)
    torch.testing.assert_close(second, torch.tensor([6.0, 2.0, 2.0]))


@pytest.mark.parametrize("reads_places", [True, False])
def test_a_gradient_left_where_autograd_put_it_is_read_there_or_written(
    reads_places: bool,
) -> None:
    """Where the reduction can read places, backward returns the flat gradient unwritten
    (fresh memory, not the pool's) and ``take`` gives where each piece's gradient lies;
    where it cannot, ``take`` writes them into the flat gradient (zeros where none came)."""
    from fullshard._engine.flat_segment import _SplitLeaf
    from fullshard._engine.left_grads import FlatLeftGrads
    from fullshard._engine.storage_pool import POOL

    POOL.clear()
    left = FlatLeftGrads([3, 2, 2])
    left.reads_places = True
    leaf = torch.zeros(7, requires_grad=True)
    a, _, c = _SplitLeaf.apply(leaf, left, [3, 2, 2])
    (a.sum() + 2 * c.sum()).backward()
    assert leaf.grad is not None
    places = left.take(leaf.grad, reads_places)
    if reads_places:
        assert places is not None
        assert [(start, data.tolist()) for start, data in places] == [
            (0, [1.0, 1.0, 1.0]),
            (5, [2.0, 2.0]),
        ]
    else:
        assert places is None
        torch.testing.assert_close(leaf.grad, torch.tensor([1.0, 1, 1, 0, 0, 2, 2]))
    assert left.take(leaf.grad, reads_places) is None  # taken once
