"""Block ids, the free list and reference counts of one paged KV pool.

Pure Python, no torch: the allocator only hands out integers. The tensors those integers index live in
`kv_pool.KVPool`. A pool is fixed-size, capped (grows up to `max_blocks`) or elastic (grows without a cap).
"""

from __future__ import annotations

import hashlib
import operator
import threading
import weakref
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

from .free_blocks import FreeBlocks, Reuse

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


def block_keys(tokens: Sequence[int], block_size: int, root: bytes = b"") -> Iterator[bytes]:
    """The chained keys (`hash_block`, from `root`) of every full block of `tokens`, in order."""
    parent = root
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        parent = hash_block(parent, tokens[start : start + block_size])
        yield parent


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int  # full blocks found by prefix and held (`hold_cached`)
    misses: int  # full blocks looked up and not found
    evictions: int  # cached blocks whose contents were given up to make room
    cached_blocks: int  # blocks currently findable by their prefix (held or free)


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

    **Free blocks.** Ids never handed out are dealt from a counter (in increasing order), and only recycled
    blocks are kept in the free list, so a pool costs O(blocks ever used) memory, not O(num_blocks): a large
    cap costs nothing until it is used. `allocate` deals never-used ids first, then recycled ones in the
    free list's order (`FreeBlocks`: blocks holding nothing findable, then cached blocks never reused, then
    reused ones, each least recently freed first); taking, freeing and a prefix hit on a free block are all
    O(1). A block is free exactly when its reference count is 0.

    **Counts.** `capacity` is the most blocks that can be held at once: ``max_blocks - 1`` for a fixed or
    capped pool, ``num_blocks - 1`` (the current size; it grows) for an elastic one. `num_used` is the blocks
    held now and ``num_free = capacity - num_used`` (for a capped pool, this includes the room left to grow).
    `can_allocate(n)` is ``n <= num_free``, always True for an elastic pool.

    Prefix caching: a full block can be registered under `hash_block` of its tokens. A registered block
    that nobody holds stays in the free list with its contents and its key, so `match_prefix` can take it
    back (`lookup_prefix`, `hold_cached`); it loses both only when `allocate` hands it out again (an
    eviction). A block taken back that way is *reused*: freed again, it is evicted after the cached blocks
    nobody reused (up to half the capacity of such blocks, see `FreeBlocks`), so a prefix many requests share
    outlives a burst of one-off prompts.

    Thread safety: `_lock` guards the id space, the free list, the reference counts, the prefix index and the
    counters together, so concurrent caches on one pool never receive the same block, never double-free one
    and never see a half-updated index. Each public method takes it once; none calls user code while
    holding it (`on_grow` runs between two holds, and the growth is decided again after it; listeners of
    `add_free_listener`, which a batcher waiting for room sleeps on, after `free` lets it go).
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
        self._by_hash: dict[bytes, int] = {}  # prefix key -> the block holding those tokens
        self._cached: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (its key, its tokens)
        self._reused: set[int] = set()  # cached blocks taken back by a prefix hit since they were cached
        self._hits = self._misses = self._evictions = 0
        self._grows = 0
        self._listeners: list[weakref.WeakMethod | Callable[[], None]] = []  # called when blocks are freed

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

    def allocate(self, n: int) -> list[int] | None:
        """Take `n` free blocks with reference count 1, or return None (taking nothing) if the cap forbids.

        Never-used ids come first (in increasing order), then recycled blocks in the free list's order
        (`FreeBlocks`; evicting their prefix-cached contents). If those are too few, the id space grows (see the class
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
                    return self._take(n)
                target = self._growth_target(shortfall)
                if target is None:
                    return None
                if self._on_grow is None:
                    self._grow_to(target)
                    return self._take(n)
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

    def _take(self, n: int) -> list[int]:
        """Hand out `n` blocks (the caller checked there are enough), never-used ones first."""
        start = len(self._refcounts)
        fresh = min(n, self._num_blocks - start)
        block_ids = list(range(start, start + fresh))
        self._refcounts.extend([1] * fresh)
        for _ in range(n - fresh):
            block_id = self._free.pop()
            block_ids.append(block_id)
            self._refcounts[block_id] = 1
            if block_id in self._cached:  # its old contents are about to be overwritten
                del self._by_hash[self._cached.pop(block_id)[0]]
                self._reused.discard(block_id)
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
        freed = False
        with self._lock:
            for block_id in block_ids:
                self._check_held(block_id)
                self._refcounts[block_id] -= 1
                if self._refcounts[block_id] == 0:
                    self._free.add(block_id, self._reuse_of(block_id), self.capacity // 2)
                    freed = True
            listeners = list(self._listeners) if freed else []
        for listener in listeners:
            callback = listener() if isinstance(listener, weakref.WeakMethod) else listener
            if callback is not None:
                callback()

    def add_free_listener(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback()` whenever blocks go back to the free list; returns a function that removes it.

        A bound method is held weakly (it goes away with its object), anything else strongly. It runs on the
        freeing thread, outside the pool's lock: keep it short (waking a thread, say).
        """
        entry = weakref.WeakMethod(callback) if hasattr(callback, "__self__") else callback

        def remove() -> None:
            with self._lock:
                if entry in self._listeners:
                    self._listeners.remove(entry)

        with self._lock:
            self._listeners = [e for e in self._listeners if not (isinstance(e, weakref.WeakMethod) and e() is None)]
            self._listeners.append(entry)
        return remove

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
            if block_hash not in self._by_hash and block_id not in self._cached:
                self._by_hash[block_hash] = block_id
                self._cached[block_id] = (block_hash, tuple(tokens))

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's contents are findable by prefix (so they must not be overwritten in place)."""
        return block_id in self._cached

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
                block_id = self._by_hash.get(parent)
                hit = block_id is not None and self._cached[block_id][1] == chunk
                found.append((block_id, parent) if hit else None)
        return found

    def hold_cached(self, blocks: Sequence[tuple[int, bytes]], looked_up: int = 0) -> bool:
        """Take a hold on each ``(block, key)`` from `lookup_prefix` if all still hold those contents; all or none.

        Blocks nobody held come back from the free list; the caller must `free` them eventually. `looked_up`
        is how many blocks the caller looked for (for `prefix_stats`: the rest count as misses).
        """
        with self._lock:
            if any(self._by_hash.get(key) != block_id for block_id, key in blocks):
                return False  # evicted since the lookup
            for block_id, _ in blocks:
                if self._refcounts[block_id] == 0:
                    self._free.remove(block_id)
                self._refcounts[block_id] += 1
                self._reused.add(block_id)
            self._hits += len(blocks)
            self._misses += max(looked_up - len(blocks), 0)
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
            keys = list(self._by_hash)  # registration order: an evicted key registered again moves last
        return keys[-limit:] if limit > 0 else []

    def prefix_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self._hits, self._misses, self._evictions, len(self._cached))

    def _reuse_of(self, block_id: int) -> Reuse:
        """The free-list segment of a block just freed (see `FreeBlocks`)."""
        if block_id in self._reused:
            return Reuse.REUSED
        return Reuse.CACHED if block_id in self._cached else Reuse.EMPTY

    def _check_held(self, block_id: int) -> None:
        if not NULL_BLOCK < block_id < len(self._refcounts) or self._refcounts[block_id] < 1:
            raise RuntimeError(f"block {block_id} is not allocated (double free or foreign block id)")

    def __repr__(self) -> str:
        return (
            f"BlockPool(num_blocks={self.num_blocks}, max_blocks={self.max_blocks}, block_size={self.block_size}, "
            f"free={self.num_free}, used={self.num_used}, grown={self.grow_count}x)"
        )
