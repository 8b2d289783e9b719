"""What a replica tells the router of its pool: which prompt prefixes it holds, in bounded space.

A replica's prefix cache finds a block by its key, a hash chained from the replica's root (the key that stands
for its model object) over every token up to the block's end (`hash_block`). The replica publishes its root,
its block size and the first `KEY_BYTES` bytes of the keys of its `limit` most recently cached blocks; the
router chains a prompt's blocks from that root and counts how many leading blocks the replica holds. The
summary is a hint: a block may be evicted after it was published (the request then computes it), and a
truncated key may collide (one in 2^64 per comparison; the replica then simply misses).

The size is bounded by `limit`: ``limit x KEY_BYTES`` bytes (32 KiB at the default 4,096) every publishing
period, whatever the pool holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ...cache.inputs import prefix_root
from ...engine.batcher import ContinuousBatcher
from ...pool.block_pool import block_keys

KEY_BYTES = 8  # of each 16-byte block key
DEFAULT_LIMIT = 4096  # keys per summary


@dataclass(frozen=True)
class PrefixSummary:
    """A replica's cached prefix blocks (the most recent `limit`) and its load, as the router reads them."""

    root: bytes  # the replica's prefix root: its keys chain from it
    block_size: int
    keys: frozenset[bytes]  # the first KEY_BYTES of each cached block's key
    in_flight: int  # requests running, prefilling or waiting

    @classmethod
    def of(cls, batcher: ContinuousBatcher, limit: int = DEFAULT_LIMIT) -> PrefixSummary:
        """The summary of `batcher`'s pool (its first layer group: the blocks every prefix hit needs)."""
        blocks = batcher.pool.groups[0]
        keys = frozenset(key[:KEY_BYTES] for key in blocks.cached_keys(limit))
        stats = batcher.stats()
        return cls(prefix_root(batcher.model), blocks.block_size, keys, stats.waiting + stats.prefilling + stats.running)

    def cached_blocks(self, prompt: Sequence[int]) -> int:
        """How many leading full blocks of `prompt` this replica holds, by its summary.

        Only blocks before the prompt's last token count: the batcher computes at least one token of a prompt.
        """
        held = 0
        for key in prompt_block_keys(prompt, self.block_size, self.root):
            if key[:KEY_BYTES] not in self.keys:
                break
            held += 1
        return held


def prompt_block_keys(prompt: Sequence[int], block_size: int, root: bytes) -> Iterator[bytes]:
    """The chained keys (`block_keys`, from `root`) of the prompt's full blocks before its last token, in order."""
    return block_keys(prompt[:-1], block_size, root)
