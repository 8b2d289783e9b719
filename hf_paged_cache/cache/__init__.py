"""`PagedCache` (the `transformers.Cache` contract), its rows, each forward's layout and lifecycle, block tables and
stats."""

from .paged_cache import PagedCache
from .stats import CacheStats, GroupStats

__all__ = ["CacheStats", "GroupStats", "PagedCache"]
