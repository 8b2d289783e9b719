"""Block ids, the free list and reference counts of one paged KV pool.

Pure Python, no torch: the allocator only hands out integers. The tensors those integers index live in
`kv_pool.KVPool`.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NULL_BLOCK = 0
"""Block 0 is never handed out. Padding in a block table points at it, so every gather reads valid memory
(its contents are kept at zero)."""


def hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a full block: a hash chained over the block's tokens and (through `parent`) all earlier ones.

    `blake2b` rather than `hash()`: Python salts `hash()` per process, so its keys would differ between
    runs and processes; blake2b's do not, and 128 bits make accidental collisions negligible (a hit is
    still confirmed by comparing tokens).
    """
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int  # full blocks found by `match_prefix`
    misses: int  # full blocks looked up and not found
    evictions: int  # cached blocks whose contents were given up to make room
    cached_blocks: int  # blocks currently findable by their prefix (held or free)


class BlockPool:
    """A fixed set of `num_blocks` blocks of `block_size` tokens, shared by reference count.

    The free list is an ordered dict used as an ordered set: `allocate` pops from the front and `free`
    appends at the back, both O(1), and a specific block can also leave it in O(1) (which a plain deque
    cannot do). A block is free exactly when its reference count is 0.

    Prefix caching: a full block can be registered under `hash_block` of its tokens. A registered block
    that nobody holds stays in the free list with its contents and its key, so `match_prefix` can take it
    back; it loses both only when `allocate` hands it out again (an eviction). The free list's order makes
    that least-recently-freed first.

    Thread safety: `_lock` guards the free list, the reference counts, the prefix index and the counters
    together, so concurrent caches on one pool never receive the same block, never double-free one and
    never see a half-updated index. Each public method takes it once; none calls user code while holding it.
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
        self._by_hash: dict[bytes, int] = {}  # prefix key -> the block holding those tokens
        self._cached: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (its key, its tokens)
        self._hits = self._misses = self._evictions = 0

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
                if block_id in self._cached:  # its old contents are about to be overwritten
                    del self._by_hash[self._cached.pop(block_id)[0]]
                    self._evictions += 1
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

    def register(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> None:
        """Make a held, full block findable by `block_hash` (first registration of a key wins)."""
        with self._lock:
            self._check_held(block_id)
            if block_hash not in self._by_hash and block_id not in self._cached:
                self._by_hash[block_hash] = block_id
                self._cached[block_id] = (block_hash, tuple(tokens))

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's contents are findable by prefix (so they must not be overwritten in place)."""
        return block_id in self._cached

    def match_prefix(self, tokens: Sequence[int], max_blocks: int) -> list[int]:
        """Take a hold on the cached blocks that spell the longest prefix of `tokens` (at most `max_blocks`).

        Blocks nobody held come back from the free list. Each returned block is held once more by the
        caller, who must `free` it eventually.
        """
        size = self.block_size
        with self._lock:
            matched, parent = [], b""
            for start in range(0, min(len(tokens) // size, max_blocks) * size, size):
                chunk = tuple(tokens[start : start + size])
                parent = hash_block(parent, chunk)
                block_id = self._by_hash.get(parent)
                if block_id is None or self._cached[block_id][1] != chunk:
                    break
                matched.append(block_id)
            for block_id in matched:
                if self._refcounts[block_id] == 0:
                    del self._free[block_id]
                self._refcounts[block_id] += 1
            self._hits += len(matched)
            self._misses += min(len(tokens) // size, max_blocks) - len(matched)
            return matched

    def prefix_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._hits, self._misses, self._evictions, len(self._cached))

    def _check_held(self, block_id: int) -> None:
        if block_id == NULL_BLOCK or self._refcounts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is not allocated (double free or foreign block id)")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, used={self.num_used})"
        )
