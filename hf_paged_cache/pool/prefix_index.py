"""The prefix index of a block pool: which full blocks can be found again by the tokens they hold.

Pure Python, no torch, no lock of its own: `BlockPool` calls it under the pool's lock, which guards the index
together with the reference counts and the free list.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from .free_blocks import Reuse


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
class IndexEntry:
    """What the index knew of one block: its key, its tokens, and whether a prefix hit reused it."""

    block_hash: bytes
    tokens: tuple[int, ...]
    reused: bool


@dataclass(frozen=True)
class PrefixCacheStats:
    hits: int  # full blocks found by prefix and held (`hold_cached`)
    misses: int  # full blocks looked up and not found
    evictions: int  # cached blocks whose contents were given up to make room
    cached_blocks: int  # blocks currently findable by their prefix (held or free)


class PrefixIndex:
    """Registered full blocks by key (`hash_block`), with the tokens each holds, and the hit counters.

    Two maps rather than one: a lookup goes from a key to its block (`by_hash`), an eviction from a block to
    its key (`cached`), and the tokens kept beside the key confirm a hit. A registered block keeps its entry
    while nobody holds it (it waits in the free list with its contents) and loses it only when the pool hands
    it out again (`evict`). A block taken back by a prefix hit is *reused* until then: the free list keeps
    such blocks longest (`reuse_of`, `FreeBlocks`).
    """

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}  # prefix key -> the block holding those tokens
        self.cached: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (its key, its tokens)
        self.reused: set[int] = set()  # cached blocks taken back by a prefix hit since they were cached
        self.hits = self.misses = self.evictions = 0

    def register(self, block_id: int, block_hash: bytes, tokens: Sequence[int]) -> None:
        """Make `block_id` findable by `block_hash` (first registration of a key, or of a block, wins)."""
        if block_hash not in self.by_hash and block_id not in self.cached:
            self.by_hash[block_hash] = block_id
            self.cached[block_id] = (block_hash, tuple(tokens))

    def is_cached(self, block_id: int) -> bool:
        """Whether the block's contents are findable by prefix."""
        return block_id in self.cached

    def find(self, block_hash: bytes, tokens: tuple[int, ...]) -> int | None:
        """The block registered under `block_hash` if it holds exactly `tokens`, else None."""
        block_id = self.by_hash.get(block_hash)
        return block_id if block_id is not None and self.cached[block_id][1] == tokens else None

    def holds(self, block_id: int, block_hash: bytes) -> bool:
        """Whether `block_id` is still the block registered under `block_hash` (not evicted since a `find`)."""
        return self.by_hash.get(block_hash) == block_id

    def taken_back(self, block_ids: Sequence[int], looked_up: int) -> None:
        """Count a prefix hit on `block_ids` (of `looked_up` blocks looked for) and mark them reused."""
        self.reused.update(block_ids)
        self.hits += len(block_ids)
        self.misses += max(looked_up - len(block_ids), 0)

    def evict(self, block_id: int) -> None:
        """Forget `block_id`'s contents (it is about to be overwritten), if it was findable."""
        if self.take_out(block_id) is not None:
            self.evictions += 1

    def take_out(self, block_id: int) -> IndexEntry | None:
        """Make `block_id` unfindable and return its entry (for `put_back`), or None if it was not findable."""
        if block_id not in self.cached:
            return None
        block_hash, tokens = self.cached.pop(block_id)
        del self.by_hash[block_hash]
        reused = block_id in self.reused
        self.reused.discard(block_id)
        return IndexEntry(block_hash, tokens, reused)

    def put_back(self, block_id: int, entry: IndexEntry) -> None:
        """Undo `take_out` (the block's contents did not change meanwhile), unless its key was registered since."""
        if entry.block_hash not in self.by_hash and block_id not in self.cached:
            self.by_hash[entry.block_hash] = block_id
            self.cached[block_id] = (entry.block_hash, entry.tokens)
            if entry.reused:
                self.reused.add(block_id)

    def reuse_of(self, block_id: int) -> Reuse:
        """The free-list segment of a block just freed (see `FreeBlocks`)."""
        if block_id in self.reused:
            return Reuse.REUSED
        return Reuse.CACHED if block_id in self.cached else Reuse.EMPTY

    def recent_keys(self, limit: int) -> list[bytes]:
        """The keys of the (at most) `limit` blocks most recently registered, oldest first."""
        keys = list(self.by_hash)  # registration order: an evicted key registered again moves last
        return keys[-limit:] if limit > 0 else []

    def stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.hits, self.misses, self.evictions, len(self.cached))
