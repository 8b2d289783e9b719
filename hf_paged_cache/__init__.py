"""A paged KV cache for Hugging Face transformers: `PagedCache` drops into `model.generate`."""

from .attention import (
    ATTENTION_NAME,
    BMM_ATTENTION_NAME,
    paged_sdpa_attention,
    register_paged_attention,
    set_paged_attention,
)
from .cache import CacheStats, GroupStats, PagedCache, PagedCrossAttentionCache, PagedEncoderDecoderCache
from .compiled import CompiledForward
from .engine import BatcherStats, ContinuousBatcher, RequestHandle, generate_many
from .errors import BatcherClosed, KVMemoryError, PoolExhaustedError, QueueFullError, RequestCancelled
from .pool import BlockPool, KVLayout, KVPool, LayerGroup, LayerShape, bytes_per_block, parse_memory

register_paged_attention()

__all__ = [
    "ATTENTION_NAME",
    "BMM_ATTENTION_NAME",
    "BatcherClosed",
    "BatcherStats",
    "BlockPool",
    "CacheStats",
    "CompiledForward",
    "ContinuousBatcher",
    "GroupStats",
    "KVLayout",
    "KVMemoryError",
    "KVPool",
    "LayerGroup",
    "LayerShape",
    "PagedCache",
    "PagedCrossAttentionCache",
    "PagedEncoderDecoderCache",
    "PoolExhaustedError",
    "QueueFullError",
    "RequestCancelled",
    "RequestHandle",
    "bytes_per_block",
    "generate_many",
    "paged_sdpa_attention",
    "parse_memory",
    "register_paged_attention",
    "set_paged_attention",
]

__version__ = "0.1.0"
