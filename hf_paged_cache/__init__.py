"""A paged KV cache for Hugging Face transformers: `PagedCache` drops into `model.generate`."""

from .attention import (
    ATTENTION_NAME,
    paged_sdpa_attention,
    register_paged_attention,
    set_paged_attention,
)
from .batcher import ContinuousBatcher, generate_many
from .block_pool import BlockPool
from .cache import CacheStats, PagedCache
from .request import RequestHandle
from .errors import KVMemoryError, PoolExhaustedError
from .kv_pool import KVPool
from .memory import KVLayout, LayerGroup, LayerShape, bytes_per_block, parse_memory
from .stats import GroupStats

register_paged_attention()

__all__ = [
    "ATTENTION_NAME",
    "BlockPool",
    "CacheStats",
    "ContinuousBatcher",
    "GroupStats",
    "KVLayout",
    "KVMemoryError",
    "KVPool",
    "LayerGroup",
    "LayerShape",
    "PagedCache",
    "PoolExhaustedError",
    "RequestHandle",
    "bytes_per_block",
    "generate_many",
    "paged_sdpa_attention",
    "parse_memory",
    "register_paged_attention",
    "set_paged_attention",
]

__version__ = "0.1.0"
