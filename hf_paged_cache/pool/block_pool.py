"""Block ids, the free list and reference counts of one paged KV pool.

Pure Python, no torch: the allocator only hands out integers. The tensors those integers index live in
`kv_pool.KVPool`. A pool is fixed-size, capped (grows up to `max_blocks`) or elastic (grows without a cap).
Which blocks can be found again by prefix is kept by a `PrefixIndex` (`prefix_index`, whose `hash_block`,
`block_keys` and `PrefixCacheStats` this module re-exports).

**Free blocks.** Ids never handed out are dealt from a counter (in increasing order), and only recycled
blocks are kept in the free list, so a pool costs O(blocks ever used) memory, not O(num_blocks): a large
cap costs nothing until it is used. `allocate` deals never-used ids first, then recycled ones in the
free list's order (`FreeBlocks`: blocks holding nothing findable, then cached blocks never reused, then
reused ones, each least recently freed first), but for a block a growing row asks for (``prefer``: the one
after its last), taken out of turn when it may be; taking, freeing and a prefix hit on a free block are all
O(1). A block is free exactly when its reference count is 0.

**Counts.** `capacity` is the most blocks that can be held at once: ``max_blocks - 1`` for a fixed or
capped pool, ``num_blocks - 1`` (the current size; it grows) for an elastic one. `num_used` is the blocks
held now and ``num_free = capacity - num_used`` (for a capped pool, this includes the room left to grow).
`can_allocate(n)` is ``n <= num_free``, always True for an elastic pool.

Prefix caching: a full block can be registered under `hash_block` of its tokens. A registered block that nobody
holds stays in the free list with its contents and its key, so `BlockPool.match_prefix` can take it back
(`lookup_prefix`, `hold_cached`); it loses both only when `allocate` hands it out again (an eviction). A block
taken back that way is *reused*: freed again, it is evicted after the cached blocks nobody reused (up to half the
capacity of such blocks, see `FreeBlocks`), so a prefix many requests share outlives a burst of one-off prompts.
A holder about to change a registered block in place unregisters it first (`forget`, undone by `remember`).

Thread safety: `BlockPool._lock` guards the id space, the free list, the reference counts, the prefix index and
the counters together, so concurrent caches on one pool never receive the same block, never double-free one and
never see a half-updated index. Each public method takes it once; none calls user code while holding it
(`on_grow` runs between two holds, and the growth is decided again after it; listeners of `add_free_listener`,
which a batcher waiting for room sleeps on, after `free` lets it go).
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Iterable, Sequence

from .free_blocks import FreeBlocks
from .listeners import Listeners
from .prefix_index import IndexEntry, PrefixCacheStats, PrefixIndex, block_keys, hash_block

__all__ = [
    "FIXED", "NULL_BLOCK", "BlockPool", "PrefixCacheStats", "as_count", "block_keys", "hash_block",
]

NULL_BLOCK = 0
"""Block 0 is never handed out. Padding in a block table points at it, so every gather reads valid memory
(its contents are kept at zero)."""


def as_count(name: str, value: object, minimum: int, hint: str = "") -> int:
    """`value` as a Python int >= `minimum`: ints and anything with ``__index__`` (numpy integers), never bools.

    Raises `ValueError` naming `name` otherwise (a bool, a float, a string, or a number below `minimum`).
    """
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in ("bool", "torch.bool"):
        raise ValueError(f"{name} must be an integer, got the boolean {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer (an int, or an integer type such as numpy.int64), got {value!r} of type "
            f"{type(value).__name__}"
        ) from None
    if number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{hint}, got {number}")
    return number


class _SameAsNumBlocks:
    """Default of `max_blocks`: the pool is fixed at its `num_blocks`."""

    def __repr__(self) -> str:
        return "num_blocks"


FIXED = _SameAsNumBlocks()
"""`max_blocks=FIXED` (the default) caps a pool at the `num_blocks` it starts with: it never grows."""


FOLLOW = -1
"""In `BlockPool.allocate`'s ``prefer``: the block after the one taken just before."""


class BlockPool:
    """Block ids ``0 .. num_blocks - 1`` of `block_size` tokens each, shared by reference count.

    **Size.** `num_blocks` is the current size of the id space (block 0, the null block, included): the K/V
    tensors of a `KVPool` hold at least that many blocks. `max_blocks` caps it:

    - fixed (the default, ``max_blocks=num_blocks``): the pool never grows; `allocate` returns None when
      fewer than `n` blocks are free (which `BlockTables` turns into `PoolExhaustedError`);
    - capped (``max_blocks > num_blocks``): `allocate` grows the id space up to `max_blocks`;
    - elastic (``max_blocks=None``): `allocate` always succeeds, growing the id space as needed.

    `allocate` grows only when the free blocks (including free blocks that still hold prefix-cached
    contents, which it evicts rather than grow, in `FreeBlocks` order) cannot supply `n`, and then
    geometrically, to ``max(num_blocks + shortfall, 2 x num_blocks)`` (capped), so growth is amortized. Ids
    never move: a block id stays valid (and keeps its contents in `KVPool`) across growth.
    `on_grow(new_num_blocks)`, if given, is called before the id space grows, outside the lock: `KVPool` grows
    its tensors there, so storage is always at least as large as the id space. If it raises, the pool does
    not grow and `allocate` raises that error (having taken nothing). `grow_count` counts growths.

    Free blocks, counts, prefix caching and thread safety: see the module docstring.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        max_blocks: int | None | _SameAsNumBlocks = FIXED,
        on_grow: Callable[[int], None] | None = None,
    ):
        """
        Args:
            num_blocks: the size to start with, block 0 included (an int >= 2, or a numpy integer).
            block_size: tokens per block (an int >= 1).
            max_blocks: the cap on `num_blocks`: by default `num_blocks` itself (a fixed pool), an int >=
                `num_blocks` (a capped pool) or None (an elastic pool, no cap).
            on_grow: called with the new `num_blocks` before the pool grows (see the class docstring).
        """
        self.block_size = as_count("block_size", block_size, 1)
        num_blocks = as_count("num_blocks", num_blocks, 2, " (block 0 is the reserved null block)")
        if max_blocks is FIXED:
            max_blocks = num_blocks
        elif max_blocks is not None:
            max_blocks = as_count("max_blocks", max_blocks, num_blocks, " (num_blocks, the size to start with)")
        self._num_blocks = num_blocks
        self._max_blocks: int | None = max_blocks
        self._on_grow = on_grow
        self._lock = threading.Lock()
        # Holders of each block ever handed out; its length is the next never-used id. The null block stays 0.
        self._refcounts = [0]
        self._free = FreeBlocks()  # recycled blocks (refcount 0), in eviction order
        self._index = PrefixIndex()  # registered full blocks by key, and the prefix hit counters
        self._grows = 0
        self._free_listeners = Listeners()  # called when blocks are freed

    @property
    def num_blocks(self) -> int:
        """Current size of the id space (the null block included); it only grows."""
        return self._num_blocks

    @property
    def max_blocks(self) -> int | None:
        """The cap on `num_blocks`, or None for an elastic pool."""
        return self._max_blocks

    @property
    def grow_count(self) -> int:
        """How many times the id space grew."""
        return self._grows

    @property
    def capacity(self) -> int:
        """Most blocks that can be held at once: the cap (minus the null block), or the current size if elastic."""
        limit = self._max_blocks if self._max_blocks is not None else self._num_blocks
        return limit - 1

    @property
    def num_free(self) -> int:
        """``capacity - num_used``: blocks `allocate` can hand out now (growing a capped pool if need be)."""
        with self._lock:
            return self.capacity - self._num_used()

    @property
    def num_used(self) -> int:
        """Blocks held by someone (reference count >= 1)."""
        with self._lock:
            return self._num_used()

    def can_allocate(self, n: int) -> bool:
        """Whether `allocate(n)` would succeed now (another thread may take the blocks before you do).

        Always True for an elastic pool (it grows; whether the device has the memory is another matter).
        """
        return self._max_blocks is None or n <= self.num_free

    def allocate(self, n: int, prefer: Sequence[int | None] = ()) -> list[int] | None:
        """Take `n` free blocks with reference count 1, or return None (taking nothing) if the cap forbids.

        Block ``i`` is ``prefer[i]`` (`FOLLOW`: the block after block ``i - 1``) when that block is free and may be
        taken out of turn (the next never-used id, or a recycled block `FreeBlocks.take_unprotected` gives); the
        others are never-used ids first (in increasing order), then recycled blocks in the free list's order
        (evicting their prefix-cached contents). If those are too few, the id space grows (see the class
        docstring); an error raised by `on_grow` propagates, with nothing taken and the pool not grown.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []  # most decode steps: every row's new token fits its last block
        while True:
            with self._lock:
                shortfall = n - self._num_free_now()
                if shortfall <= 0:
                    return self._take(n, prefer)
                target = self._growth_target(shortfall)
                if target is None:
                    return None
                if self._on_grow is None:
                    self._grow_to(target)
                    return self._take(n, prefer)
            self._on_grow(target)  # outside the lock: it may wait for readers of the storage
            with self._lock:
                self._grow_to(target)  # then try again: another thread may have taken blocks meanwhile

    def _num_used(self) -> int:
        return len(self._refcounts) - 1 - len(self._free)

    def _num_free_now(self) -> int:
        """Free blocks within the current id space: never-used ids plus recycled ones."""
        return self._num_blocks - len(self._refcounts) + len(self._free)

    def _growth_target(self, shortfall: int) -> int | None:
        """The size to grow to for `shortfall` more blocks, or None if the cap does not allow it."""
        size = self._num_blocks
        if self._max_blocks is not None and size + shortfall > self._max_blocks:
            return None
        target = max(size + shortfall, 2 * size)
        return target if self._max_blocks is None else min(target, self._max_blocks)

    def _grow_to(self, target: int) -> None:
        if target > self._num_blocks:
            self._num_blocks = target
            self._grows += 1

    def _take(self, n: int, prefer: Sequence[int | None] = ()) -> list[int]:
        """Hand out `n` blocks (the caller checked there are enough): each preferred one where it may be taken out
        of turn (see `allocate`), else never-used ones first, then the free list's."""
        block_ids: list[int] = []
        for i in range(n):
            wanted = prefer[i] if i < len(prefer) else None
            if wanted == FOLLOW:
                wanted = block_ids[-1] + 1 if block_ids else None
            fresh = len(self._refcounts)  # the next never-used id
            if wanted is not None and 0 < wanted < fresh and self._free.take_unprotected(wanted):
                block_id = wanted  # a recycled block, out of turn
            elif fresh < self._num_blocks:
                block_id = fresh  # also when it is the one wanted
                self._refcounts.append(0)
            else:
                block_id = self._free.pop()
            self._refcounts[block_id] = 1
            self._index.evict(block_id)  # its old contents, if findable, are about to be overwritten
            block_ids.append(block_id)
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
        freed = False
        with self._lock:
            for block_id in block_ids:
                self._check_held(block_id)
                self._refcounts[block_id] -= 1
                if self._refcounts[block_id] == 0:
                    self._free.add(block_id, self._index.reuse_of(block_id), self.capacity // 2)
                    freed = True
        if freed:
            self._free_listeners.call()

    def add_free_listener(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` whenever blocks go back to the free list; returns a function that removes it.

        A bound method is held weakly (it goes away with its object), anything else strongly. It runs on the
        freeing thread, outside the pool's lock: keep it short (waking a thread, say).
        """
        return self._free_listeners.add(callback)

    def refcount(self, block_id: int) -> int:
        """Holders of `block_id` (0 when free); `IndexError` outside ``0 .. num_blocks - 1``."""
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block {block_id} is outside this pool of {self._num_blocks} blocks")
        refcounts = self._refcounts
        return refcounts[block_id] if block_id < len(refcounts) else 0

    def register(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> None:
        """Make a held, full block findable by `block_hash` (first registration of a key wins)."""
        with self._lock:
            self._check_held(block_id)
            self._index.register(block_id, block_hash, tokens)

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's contents are findable by prefix (so they must not be overwritten in place)."""
        return self._index.is_cached(block_id)

    def lookup(self, block_hash: bytes, tokens: Sequence[int]) -> tuple[int, bytes] | None:
        """``(block, key)`` if a block is registered under `block_hash` with exactly `tokens`, else None.

        Takes no hold (see `hold_cached`): `lookup_prefix` for one key computed elsewhere.
        """
        with self._lock:
            block_id = self._index.find(block_hash, tuple(tokens))
        return (block_id, block_hash) if block_id is not None else None

    def forget(self, block_id: int) -> IndexEntry | None:
        """Make a held block no longer findable by prefix, before its contents change in place. Returns what the
        index knew of it (None if it was not findable), for `remember` if the change does not happen."""
        with self._lock:
            self._check_held(block_id)
            return self._index.take_out(block_id)

    def remember(self, block_id: int, entry: IndexEntry) -> None:
        """Make a held block findable again as `forget` found it (its contents unchanged since)."""
        with self._lock:
            self._check_held(block_id)
            self._index.put_back(block_id, entry)

    def lookup_prefix(self, tokens: Sequence[int], max_blocks: int, root: bytes = b"") -> list[tuple[int, bytes] | None]:
        """For each of the first `max_blocks` full blocks of `tokens`: ``(block, key)`` if cached, else None.

        Takes no hold (see `hold_cached`); the chain goes on past a miss, since a sliding-window group needs
        only its last blocks. `root` is the key the chain starts from (what the registering caches chained
        from: it stands for the model that computed the blocks).
        """
        size = self.block_size
        found: list[tuple[int, bytes] | None] = []
        parent = root
        with self._lock:
            for start in range(0, min(len(tokens) // size, max_blocks) * size, size):
                chunk = tuple(tokens[start : start + size])
                parent = hash_block(parent, chunk)
                block_id = self._index.find(parent, chunk)
                found.append((block_id, parent) if block_id is not None else None)
        return found

    def hold_cached(self, blocks: Sequence[tuple[int, bytes]], looked_up: int = 0) -> bool:
        """Take a hold on each ``(block, key)`` from `lookup_prefix` if all still hold those contents; all or none.

        Blocks nobody held come back from the free list; the caller must `free` them eventually. `looked_up`
        is how many blocks the caller looked for (for `prefix_stats`: the rest count as misses).
        """
        with self._lock:
            if not all(self._index.holds(block_id, key) for block_id, key in blocks):
                return False  # evicted since the lookup
            for block_id, _ in blocks:
                if self._refcounts[block_id] == 0:
                    self._free.remove(block_id)
                self._refcounts[block_id] += 1
            self._index.taken_back([block_id for block_id, _ in blocks], looked_up)
            return True

    def match_prefix(self, tokens: Sequence[int], max_blocks: int, root: bytes = b"") -> list[int]:
        """Take a hold on the cached blocks that spell the longest prefix of `tokens` (at most `max_blocks`).

        Each returned block is held once more by the caller, who must `free` it eventually.
        """
        while True:
            found = self.lookup_prefix(tokens, max_blocks, root)
            run = next((i for i, hit in enumerate(found) if hit is None), len(found))
            if self.hold_cached(found[:run], looked_up=len(found)):
                return [block_id for block_id, _ in found[:run]]

    def cached_keys(self, limit: int) -> list[bytes]:
        """The keys of the (at most) `limit` blocks most recently made findable by prefix, oldest first."""
        with self._lock:
            return self._index.recent_keys(limit)

    def prefix_stats(self) -> PrefixCacheStats:
        return self._index.stats()

    def _check_held(self, block_id: int) -> None:
        if not NULL_BLOCK < block_id < len(self._refcounts) or self._refcounts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is not allocated (double free or foreign block id)")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, max_blocks={self.max_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, used={self.num_used}, grown={self.grow_count}x)"
        )
