"""`PagedLayer`: one layer's view of a `PagedCache`."""

from __future__ import annotations

import weakref
from typing import Any, Protocol

import torch
from transformers.cache_utils import CacheLayerMixin

from ..pool.kv_pool import KVPool
from .batch import PagedBatch


class LayerOwner(Protocol):
    """What a `PagedLayer` needs of the cache it belongs to (a `PagedCache`, which this module does not import)."""

    pool: KVPool
    batch: PagedBatch

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def dense_view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class PagedLayer(CacheLayerMixin):
    """One layer's view of a `PagedCache`: its length and attention window; the data lives in the pool.

    `keys` and `values` read like `DynamicLayer`'s: dense ``[batch, kv_heads, length, head_dim]`` tensors
    (the last ``sliding_window - 1`` positions on a sliding layer, as `DynamicSlidingWindowLayer` keeps),
    gathered from the pool on each access, padding positions reading zeros. They are copies: writing into
    them changes nothing. The layer holds its cache weakly, so the cache has no reference cycle and gives
    its blocks back as soon as it is dropped.
    """

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: LayerOwner, layer_idx: int, sliding_window: int | None = None):
        self._cache_ref = weakref.ref(cache)
        super().__init__()
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.length = 0  # logical positions seen, padding included (as `DynamicLayer.get_seq_length`)

    @property
    def _cache(self) -> LayerOwner:
        cache = self._cache_ref()
        if cache is None:
            raise ReferenceError("this PagedLayer's PagedCache no longer exists")
        return cache

    @property
    def keys(self) -> torch.Tensor | None:
        """Dense ``[batch, kv_heads, length, head_dim]`` keys (a copy), or None before the first forward."""
        return self._cache.dense_view(self.layer_idx)[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value: None) -> None:
        _refuse_assignment("keys", value)

    @property
    def values(self) -> torch.Tensor | None:
        """Dense ``[batch, kv_heads, length, head_dim]`` values (a copy), or None before the first forward."""
        return self._cache.dense_view(self.layer_idx)[1] if self.is_initialized else None

    @values.setter
    def values(self, value: None) -> None:
        _refuse_assignment("values", value)

    @property
    def record_past(self) -> bool:
        """Whether the cache keeps positions out of the window until the next crop (`activate_past_recording`)."""
        return self._cache.batch.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        self._cache.batch.record_past = value

    @property
    def indexer_position_ids(self) -> None:
        """None: a PagedCache keeps no positions beside a layer's indexer keys (Qwen4-Exp's indexer would)."""
        return None

    @indexer_position_ids.setter
    def indexer_position_ids(self, value: torch.Tensor | None) -> None:
        if value is not None:
            raise NotImplementedError(
                "this model keeps its indexer's position ids on the cache layer (indexer_position_ids), per row, "
                "which a PagedCache cannot keep in step with its rows: use the model's default cache"
            )

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache.pool.layer(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int, length: int | None = None) -> tuple[int, int]:
        """(kv_length, kv_offset) of the K/V `update` returns next: the whole past, or the last window.

        `length` is the positions stored before the next forward (default: what this layer has seen).
        """
        length = self.length if length is None else length
        offset = self.window_offset(length)
        return length - offset + query_length, offset

    def window_offset(self, length: int | None = None) -> int:
        """First position this layer attends to (0 for full attention), as `DynamicSlidingWindowLayer`, after
        `length` positions (default: what this layer has seen)."""
        if self.sliding_window is None:
            return 0
        length = self.length if length is None else length
        return max(length - self.sliding_window + 1, 0)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


def _refuse_assignment(name: str, value: object) -> None:
    if value is not None:  # CacheLayerMixin.__init__ sets both to None; nothing else may write them
        raise AttributeError(f"PagedLayer.{name} is a read-only view of the block pool; use PagedCache.update()")
