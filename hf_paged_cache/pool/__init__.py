"""The shared memory of paged caches: block ids and their counts (no torch), per-layer storage, byte sizes, locks."""

from .block_pool import NULL_BLOCK, BlockPool, hash_block
from .kv_pool import KVPool
from .locks import SharedExclusiveLock
from .memory import KVLayout, LayerGroup, LayerShape, bytes_per_block, format_memory, parse_memory

__all__ = [
    "NULL_BLOCK",
    "BlockPool",
    "KVLayout",
    "KVPool",
    "LayerGroup",
    "LayerShape",
    "SharedExclusiveLock",
    "bytes_per_block",
    "format_memory",
    "hash_block",
    "parse_memory",
]
