"""Block ids, the free list and reference counts of one paged KV pool.

Pure Python, no torch: the allocator only hands out integers. The tensors those integers index live in
`kv_pool.KVPool`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

NULL_BLOCK = 0
"""Block 0 is never handed out. Padding in a block table points at it, so every gather reads valid memory
(its contents are kept at zero)."""


class BlockPool:
    """A fixed set of `num_blocks` blocks of `block_size` tokens, shared by reference count.

    The free list is an ordered dict used as an ordered set: `allocate` pops from the front and `free`
    appends at the back, both O(1), and a specific block can also leave it in O(1) (which a plain deque
    cannot do). A block is free exactly when its reference count is 0.

    Thread safety: `_lock` guards `_free` and `_refcounts` together, so concurrent caches on one pool never
    receive the same block and never double-free one. Each public method takes it once; no method calls
    back into user code while holding it.
    """

    def __init__(self, num_blocks: int, block_size: int = 16):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the reserved null block), got {num_blocks!r}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self._refcounts = [0] * num_blocks  # holders of each block; the null block stays at 0 forever
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))

    @property
    def capacity(self) -> int:
        """Blocks that can ever be allocated (all but the null block)."""
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def can_allocate(self, n: int) -> bool:
        """Whether `n` blocks are free right now (another thread may take them before you do)."""
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks with reference count 1, or return None (taking nothing) if fewer are free."""
        with self._lock:
            if n > len(self._free):
                return None
            block_ids = [self._free.popitem(last=False)[0] for _ in range(n)]
            for block_id in block_ids:
                self._refcounts[block_id] = 1
            return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each (already held) block: sharing instead of copying."""
        with self._lock:
            for block_id in block_ids:
                self._check_held(block_id)
                self._refcounts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one holder from each block; blocks left with none go back to the free list.

        Callers pass a sequence's blocks in reverse order, so its tail blocks join the free list first and
        are reused first, while its prefix blocks stay untouched longest.
        """
        with self._lock:
            for block_id in block_ids:
                self._check_held(block_id)
                self._refcounts[block_id] -= 1
                if self._refcounts[block_id] == 0:
                    self._free[block_id] = None

    def refcount(self, block_id: int) -> int:
        return self._refcounts[block_id]

    def _check_held(self, block_id: int) -> None:
        if block_id == NULL_BLOCK or self._refcounts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is not allocated (double free or foreign block id)")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, used={self.num_used})"
        )
