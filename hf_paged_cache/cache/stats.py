"""`CacheStats`: the memory one `PagedCache` holds, in blocks, tokens and bytes, in total and per layer group."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..pool.block_pool import NULL_BLOCK
from ..pool.kv_pool import KVPool
from ..pool.state_slots import NULL_SLOT
from .block_table import RowsView


@dataclass(frozen=True)
class GroupStats:
    """Memory one cache holds in one layer group (blocks shared between its rows counted once)."""

    name: str  # "full attention" or "sliding window W"
    num_layers: int
    blocks_in_use: int
    max_blocks_per_row: int  # the most blocks one row holds
    bytes_per_block: int  # this group's layers only
    bytes_reserved: int  # blocks_in_use x bytes_per_block
    bytes_used: int  # bytes of the block slots that hold a token
    pool_blocks: int  # the group's (shared) block pool size, the null block included


@dataclass(frozen=True)
class CacheStats:
    """Memory held by one `PagedCache`: totals over its layer groups (`groups` has each one)."""

    blocks_in_use: int  # over all groups
    tokens_stored: int  # real tokens over all rows (a shared prefix counts once per row)
    bytes_reserved: int  # sum over groups of blocks in use x that group's bytes per block
    bytes_used: int  # bytes of the block slots that hold a token
    pool_bytes: int  # K/V tensors allocated for the whole (shared) pool so far
    utilization: float  # bytes_used / bytes_reserved (1.0 for an empty cache)
    prefix_hits: int  # pool-wide: full blocks found by prefix lookups
    prefix_misses: int  # pool-wide: full blocks looked up and not found
    prefix_evictions: int  # pool-wide: cached blocks given up to make room
    pool_blocks: int  # the (shared) pool's current size in blocks (its first group), the null block included
    pool_max_blocks: int | None  # its cap: pool_blocks for a fixed pool, None for an elastic one
    pool_grows: int  # times the (elastic) pool has grown, all groups together
    groups: tuple[GroupStats, ...] = ()
    # per-sequence conv / recurrent states (linear-attention, SSM and conv layers; 0 for other models)
    state_slots_in_use: int = 0  # distinct state slots the rows hold (shared slots counted once)
    bytes_per_state_slot: int = 0  # one sequence's states over every such layer (as written so far)
    state_snapshots: int = 0  # pool-wide: slots findable by prefix, each the states after a block boundary
    state_snapshot_hits: int = 0  # pool-wide: rows that started from a snapshot (`reuse_prefix`)
    # an encoder-decoder model's cross-attention keys and values (one copy a request, `PagedCrossAttentionCache`),
    # also in bytes_reserved and bytes_used (0 for other models)
    cross_attention_bytes: int = 0

    @classmethod
    def of(cls, groups: Sequence[RowsView], pool: KVPool, state_slots: Sequence[int] = ()) -> CacheStats:
        """What the rows of `groups` (one view per layer group of `pool`) and their `state_slots` hold.

        Bytes reserved and used count the blocks and the state slots together (a state slot is always full)."""
        per_group = []
        for g, (tables, layer_group) in enumerate(zip(groups, pool.layer_groups)):
            filled = tables.unique_blocks()
            per_block = pool.group_bytes_per_block(g)
            held = [sum(b != NULL_BLOCK for b in table) for table in tables.tables]
            per_group.append(
                GroupStats(
                    name=layer_group.name,
                    num_layers=len(layer_group.layers),
                    blocks_in_use=len(filled),
                    max_blocks_per_row=max(held, default=0),
                    bytes_per_block=per_block,
                    bytes_reserved=len(filled) * per_block,
                    bytes_used=sum(filled.values()) * per_block // pool.block_size,
                    pool_blocks=pool.groups[g].num_blocks,
                )
            )
        slots_in_use = len(set(state_slots) - {NULL_SLOT})
        per_slot = pool.states.bytes_per_slot()
        reserved = sum(g.bytes_reserved for g in per_group) + slots_in_use * per_slot
        used = sum(g.bytes_used for g in per_group) + slots_in_use * per_slot
        snapshots = pool.states.ids.prefix_stats()
        hits = misses = evictions = 0
        for blocks in pool.groups:
            prefix = blocks.prefix_stats()
            hits, misses, evictions = hits + prefix.hits, misses + prefix.misses, evictions + prefix.evictions
        return cls(
            blocks_in_use=sum(g.blocks_in_use for g in per_group),
            tokens_stored=sum(groups[0].num_tokens),
            bytes_reserved=reserved,
            bytes_used=used,
            pool_bytes=pool.storage_bytes(),
            utilization=used / reserved if reserved else 1.0,
            prefix_hits=hits,
            prefix_misses=misses,
            prefix_evictions=evictions,
            pool_blocks=pool.num_blocks,
            pool_max_blocks=pool.max_blocks,
            pool_grows=pool.grow_count,
            groups=tuple(per_group),
            state_slots_in_use=slots_in_use,
            bytes_per_state_slot=per_slot,
            state_snapshots=snapshots.cached_blocks,
            state_snapshot_hits=snapshots.hits,
        )
