"""`IndexerAccess`: how a `PagedCache` keeps the DSA indexer keys of indexed-attention layers.

DeepSeek-V3.2's and GLM-5's lightning indexer scores every earlier token by its own key (``[index_head_dim]``, one
head) to pick the keys each query attends to; the layer hands the cache its new tokens' indexer keys
(``cache.update_indexer``, after the layer's ``update``) and reads back every position's. They live in the same
blocks as the layer's keys and values, written through the forward's slot index.
"""

from __future__ import annotations

import torch

from ..pool.kv_pool import KVPool
from .forward_lifecycle import ForwardLifecycle
from .layer_io import gather, write_new_tokens


class IndexerAccess:
    """The indexer-key part of `PagedCache`'s `Cache` contract (a mixin: the cache holds the rows)."""

    pool: KVPool
    lifecycle: ForwardLifecycle

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """Store this forward's indexer keys of layer `layer_idx` and return every position's.

        Args:
            indexer_key_states: ``[B, q, index_dim]`` the new tokens' indexer keys.
        Returns:
            ``[B, kv_length, index_dim]``: every position's, as `DynamicIndexedLayer.update_indexer` returns them
            (padding positions read zeros, which the indexer's mask hides).
        """
        forward = self.lifecycle.forward
        indexed = self.pool.layout.indexer_dims
        if forward is None or not indexed or not indexed[layer_idx]:
            raise ValueError(
                f"update_indexer() on layer {layer_idx}: only an indexed-attention layer keeps indexer keys, "
                "during its forward, after its update()"
            )
        stored = self.pool.storage.stored_indexer(layer_idx)
        index = self.lifecycle.index(self.pool.group_of[layer_idx], indexer_key_states.device)
        batch_size = indexer_key_states.shape[0]
        with self.pool.storage_lock.shared():  # another thread's forward may grow the pool's tensors in place
            write_new_tokens(stored, indexer_key_states.unsqueeze(1), index)  # [B, 1, q, D]
            return gather(stored, index.read_slots_from(0), batch_size).squeeze(1)  # [B, kv, D]
