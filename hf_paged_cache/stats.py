"""`CacheStats`: the memory one `PagedCache` holds, in blocks, tokens and bytes."""

from __future__ import annotations

from dataclasses import dataclass

from .block_table import BlockTables
from .kv_pool import KVPool


@dataclass(frozen=True)
class CacheStats:
    """Memory held by one `PagedCache` (blocks shared between its rows are counted once)."""

    blocks_in_use: int
    tokens_stored: int  # real tokens over all rows (a shared prefix counts once per row)
    bytes_reserved: int  # blocks_in_use x bytes per block
    bytes_used: int  # bytes of the block slots that hold a token
    pool_bytes: int  # K/V tensors allocated for the whole (shared) pool so far
    utilization: float  # bytes_used / bytes_reserved (1.0 for an empty cache)
    prefix_hits: int  # pool-wide: full blocks found by prefix lookups
    prefix_misses: int  # pool-wide: full blocks looked up and not found
    prefix_evictions: int  # pool-wide: cached blocks given up to make room
    pool_blocks: int  # the (shared) pool's current size in blocks, the null block included
    pool_max_blocks: int | None  # its cap: pool_blocks for a fixed pool, None for an elastic one
    pool_grows: int  # times the (elastic) pool has grown

    @classmethod
    def of(cls, tables: BlockTables, pool: KVPool) -> CacheStats:
        """What the rows of `tables` hold in `pool` right now."""
        filled = tables.unique_blocks()
        per_block = pool.bytes_per_block
        reserved = len(filled) * per_block
        used = sum(filled.values()) * per_block // pool.block_size
        prefix = pool.blocks.prefix_stats()
        return cls(
            blocks_in_use=len(filled),
            tokens_stored=sum(tables.num_tokens),
            bytes_reserved=reserved,
            bytes_used=used,
            pool_bytes=pool.storage_bytes(),
            utilization=used / reserved if reserved else 1.0,
            prefix_hits=prefix.hits,
            prefix_misses=prefix.misses,
            prefix_evictions=prefix.evictions,
            pool_blocks=pool.num_blocks,
            pool_max_blocks=pool.max_blocks,
            pool_grows=pool.grow_count,
        )
