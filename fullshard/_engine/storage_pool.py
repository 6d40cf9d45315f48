"""Reusing a freed unsharded buffer's memory on the CPU (see [Note: reusing unsharded memory]).

[Note: reusing unsharded memory]
A unit's unsharded buffer is a storage that resharding frees (``resize_(0)``) and the next
unshard grows again: autograd's saved views keep pointing at the same storage, so it must be
that storage that comes back. On CUDA, torch's caching allocator hands the freed block to
the next unshard. The CPU has no such cache: glibc serves every block over 32 MiB with a
fresh ``mmap`` and unmaps it on free, so each unshard of a large unit faults in and zeroes
its pages again (a 50 MiB unit: about 12,800 page faults, some 10-15 ms per unshard on the
benchmark host, two unshards per unit per step; see docs/benchmarks.md).

``StoragePool`` keeps the memory instead. ``free`` moves a storage's memory into a kept,
otherwise unused storage (``_swap_data_ptr_``: the freed storage's object stays, with 0
bytes, as ``resize_(0)`` leaves it); ``fill`` moves kept memory of the same size into the
storage a unit unshards. What is kept and taken:

- a unit's unsharded flat buffer, freed at reshard and filled at unshard, and the tensors
  an all-gather extension's hooks built (``extensions.py``: the gathered inputs, the
  unsharded tensor), likewise;
- a unit's flat gradient, freed once its reduction is done
  (``_PendingReduction.recycle_input``) and drawn where autograd's backward builds it from
  the parameters' gradients (``_SplitLeaf`` for the flat layout, ``_Unflatten`` for
  ``fully_shard``'s; not one that backward leaves unwritten, [Note: gradients reduced
  where autograd left them] in left_grads.py: fresh memory, so the pool's block stays for
  the next unshard).

Two blocks per size are kept at most (``BLOCKS_PER_SIZE``): in backward, a unit's
post-backward frees its buffer and its gradient, and the next unit takes both (its
prefetched all-gather, its gradient), so beyond what ``resize_(0)`` would hold the pool
holds at most two blocks of a size, for the time between one unit's post-backward and the
next unit's gradient. In forward it holds at most one (a unit reshards before the next
unshards without forward prefetch; with it, the unit before). Everything kept is given
back at the end of the backward (``clear``), or of a root's forward that no backward
follows: the optimizer step and the time between steps see the memory they saw before.
(After ``summon_full_params`` or a state dict outside a step, the blocks stay until then
too.) Small blocks are kept as well (malloc's heap would reuse them without faulting): one
path for every size, which every test exercises.
"""

from __future__ import annotations

import torch

__all__: list[str] = []

BLOCKS_PER_SIZE = 2
"""A unit's unsharded buffer and its flat gradient (see the note)."""


class StoragePool:
    """Freed CPU storages' memory, at most ``BLOCKS_PER_SIZE`` blocks per size, until
    ``clear``."""

    def __init__(self) -> None:
        self._kept: dict[int, list[torch.UntypedStorage]] = {}
        """nbytes -> storages that hold nothing but kept memory (at most
        ``BLOCKS_PER_SIZE``)."""

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give ``storage`` ``nbytes`` of memory: if it is freed, kept memory of that size if
        any, else fresh (its contents are undefined either way)."""
        if storage.nbytes() != 0:
            if storage.nbytes() != nbytes:
                storage.resize_(nbytes)
            return
        kept = self._kept.get(nbytes) if storage.device.type == "cpu" else None
        if not kept:
            storage.resize_(nbytes)
        else:
            storage._swap_data_ptr_(kept.pop())  # type: ignore[attr-defined]

    def free(self, storage: torch.UntypedStorage) -> None:
        """Free ``storage``'s memory (it has 0 bytes after), keeping the memory for a next
        ``fill`` of that size unless ``BLOCKS_PER_SIZE`` are kept already."""
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        kept = self._kept.setdefault(nbytes, [])
        if storage.device.type != "cpu" or len(kept) == BLOCKS_PER_SIZE:
            storage.resize_(0)
            return
        block = torch.UntypedStorage(0, device=storage.device)
        block._swap_data_ptr_(storage)  # type: ignore[attr-defined]
        kept.append(block)

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A new 1-D tensor of ``numel`` elements in kept memory of its size if any (contents
        undefined), for a buffer as large as an unsharded one (a unit's flat gradient)."""
        storage = torch.UntypedStorage(0, device=device)
        self.fill(storage, numel * dtype.itemsize)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,), (1,))

    def kept_bytes(self) -> int:
        return sum(nbytes * len(kept) for nbytes, kept in self._kept.items())

    def clear(self) -> None:
        """Give the kept memory back to the allocator."""
        self._kept.clear()


POOL = StoragePool()
"""The process's pool: units of every model share it, as they would CUDA's cache."""
