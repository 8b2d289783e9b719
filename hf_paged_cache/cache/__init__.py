"""`PagedCache` (the `transformers.Cache` contract), its rows, each forward's layout and lifecycle, block tables and
stats."""

from .cross_attention import PagedCrossAttentionCache
from .encoder_decoder import PagedEncoderDecoderCache
from .paged_cache import PagedCache
from .stats import CacheStats, GroupStats

__all__ = ["CacheStats", "GroupStats", "PagedCache", "PagedCrossAttentionCache", "PagedEncoderDecoderCache"]
