"""`PagedEncoderDecoderCache`: the cache of an encoder-decoder model (T5, BART, mBART, Marian, Whisper) in pools.

transformers' encoder-decoder models take an `EncoderDecoderCache`: a self-attention cache for the decoder's
tokens and a cross-attention cache for the keys and values computed from the encoder's output. This one is an
`EncoderDecoderCache` whose decoder self-attention cache is a `PagedCache` (keys and values of the decoder's
tokens in blocks, as for a decoder-only model) and whose cross-attention cache is a `PagedCrossAttentionCache`
(one copy per request, in blocks of a pool of its own, read by every beam and sample of the request).
``PagedCache(model)`` builds one for an encoder-decoder model.

A continuous batcher drives it as it drives a `PagedCache`: each request prefills in a cache of its own
(`empty_like`), whose rows then join the running batch (`add_rows_from`: blocks and sources change hands), and
the decoder's step-by-step methods (`commit`, `settle`, `is_real`, `drop_leading_padding`) are its
self-attention cache's. Its next forward passes the cross-attention's `encoder_mask` as the encoder's attention
mask, since the rows' encoder inputs may differ in length.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers.cache_utils import Cache, EncoderDecoderCache

from ..pool.kv_pool import KVPool
from ..pool.memory import KVLayout
from .cross_attention import PagedCrossAttentionCache
from .stats import CacheStats


class PagedEncoderDecoderCache(EncoderDecoderCache):
    """An encoder-decoder model's cache: the decoder's self-attention in a `PagedCache`, the cross-attention in a
    `PagedCrossAttentionCache` (see the module docstring). ``PagedCache(model)`` builds it, with `PagedCache`'s
    arguments for the self-attention pool, but for `max_memory`, which it splits between the two pools; the
    cross-attention pool has the same block size and dtype, and grows as needed without a budget."""

    def __init__(self, decoder: Cache, cross: PagedCrossAttentionCache | None = None):
        """Around `decoder`, the decoder self-attention `PagedCache` of an encoder-decoder model (built by
        `PagedCache.for_decoder`; typed `Cache` here, as `paged_cache` imports this module), and `cross`, its
        cross-attention cache (default: an empty one on a new pool)."""
        if cross is None:
            # cross-attention heads and head size are the decoder self-attention's (T5, BART, Marian, Whisper); a
            # model whose differ is refused by the pool at the first forward, naming the shapes
            cross_pool = KVPool(KVLayout(layers=decoder.pool.layout.layers), num_blocks=2,
                                block_size=decoder.pool.block_size, dtype=decoder.pool.dtype, max_blocks=None)
            cross = PagedCrossAttentionCache(cross_pool)
        super().__init__(decoder, cross)

    @property
    def pool(self) -> KVPool:
        """The decoder self-attention's pool (the cross-attention's is ``cross_attention_cache.pool``)."""
        return self.self_attention_cache.pool

    # ------------------------------------------------------------------ what a continuous batcher calls

    keeps_states = False  # no conv / recurrent states: every decoder layer attends

    @property
    def batch_size(self) -> int:
        return self.self_attention_cache.batch_size

    @property
    def batch(self) -> Any:
        """The decoder self-attention's rows and block tables (`PagedBatch`), which the batcher's admission reads."""
        return self.self_attention_cache.batch

    @property
    def is_real(self) -> torch.Tensor:
        """``[B, L]`` the decoder self-attention's padding mask (False where a position is padding)."""
        return self.self_attention_cache.is_real

    def encoder_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """``[B, S]`` the encoder's attention mask for a forward on these rows (`PagedCrossAttentionCache`)."""
        return self.cross_attention_cache.encoder_mask(device)

    def empty_like(self) -> PagedEncoderDecoderCache:
        """A new empty cache on the same two pools, committing as this one does (its reads are made per read:
        a batcher's cache for one request)."""
        return PagedEncoderDecoderCache(self.self_attention_cache.empty_like(),
                                        PagedCrossAttentionCache(self.cross_attention_cache.pool))

    def add_rows_from(self, other: PagedEncoderDecoderCache) -> None:
        """Move `other`'s rows in after this one's, in both caches (no key or value copied); `other` is left empty."""
        self.self_attention_cache.add_rows_from(other.self_attention_cache)
        self.cross_attention_cache.add_rows_from(other.cross_attention_cache)
        self.is_updated = {layer: True for layer in self.cross_attention_cache.written}
        other.is_updated = {}

    def drop_leading_padding(self) -> int:
        return self.self_attention_cache.drop_leading_padding()

    def commit(self, keep: list[int] | None = None) -> None:
        """Keep the decoder's pending forward (``manual_commit``); the cross-attention's keys and values are
        written once, at a request's first forward, and go with `release` if that forward is not kept."""
        if keep is not None:
            raise NotImplementedError("an encoder-decoder model's cache takes no draft tokens")
        self.self_attention_cache.commit()

    def settle(self) -> None:
        self.self_attention_cache.settle()

    def reuse_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """0: a decoder's keys depend on the encoder's input too, which no prefix key covers."""
        return 0

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def stats(self) -> CacheStats:
        """The decoder self-attention cache's `CacheStats`, with the cross-attention's bytes counted in
        (`cross_attention_bytes`, and in `bytes_reserved`; `bytes_used` counts the encoder positions they hold)."""
        stats, cross_cache = self.self_attention_cache.stats(), self.cross_attention_cache
        cross = cross_cache.nbytes()
        per_position = cross_cache.pool.bytes_per_block // cross_cache.pool.block_size
        reserved = stats.bytes_reserved + cross
        used = stats.bytes_used + sum(cross_cache.lengths) * per_position
        return dataclasses.replace(stats, cross_attention_bytes=cross, bytes_reserved=reserved, bytes_used=used,
                                   utilization=used / reserved if reserved else 1.0)

    def fork(self) -> PagedEncoderDecoderCache:
        """A new cache on the same pools with the same rows, sharing every block of both (copy-on-write)."""
        twin = PagedEncoderDecoderCache(self.self_attention_cache.fork(), self.cross_attention_cache.fork())
        twin.is_updated = dict(self.is_updated)
        return twin

    def __deepcopy__(self, memo: dict) -> PagedEncoderDecoderCache:
        """`copy.deepcopy(cache)` (the usual way to reuse a prefilled cache) forks instead of copying the pools."""
        return self.fork()

    def __copy__(self) -> PagedEncoderDecoderCache:
        return self.fork()

    def release(self) -> None:
        """Give every block of both pools back (`EncoderDecoderCache.reset`: both caches, and `is_updated`)."""
        self.reset()

    def __enter__(self) -> PagedEncoderDecoderCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
