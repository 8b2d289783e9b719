"""One layer's part of a forward: its new keys and values into the pool, and what its attention then reads.

`store_layer` writes the new tokens through the forward's slot index (`cache.forward.SlotIndex`) and hands
attention one of three things: for ``paged_sdpa``, the reads over the pool (`PagedAttentionInputs`, no
copy); for any other attention, dense ``[B, heads, kv_length, dim]`` K/V gathered through the block tables
(padding reads the all-zero null block); for a grad-enabled forward on an empty cache, the new K/V
themselves, so that gradients flow as with `DynamicCache`. `dense_layer` gathers a layer's stored K/V the
same way for readers (`PagedLayer.keys`).
"""

from __future__ import annotations

import torch

from ..attention.reads import PAGED_INPUTS, PagedAttentionInputs, by_row
from ..pool.kv_format import StoredStates
from ..pool.kv_pool import KVPool
from ..pool.locks import SharedExclusiveLock
from .block_table import RowsView, slots_for_positions
from .forward import SlotIndex


def store_layer(
    keys: StoredStates,
    values: StoredStates,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    index: SlotIndex,
    offset: int,
    window: int | None,
    lock: SharedExclusiveLock,
    attention_kwargs: dict | None,
    needs_grad: bool,
    batch_invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a layer's new K/V into its storage and return what ``cache.update`` returns.

    Args:
        keys, values: the layer's stored keys and values (``[heads, slots, dim]``, in the pool's format).
        key_states, value_states: ``[B, heads, q, dim]`` the forward's new keys and values.
        offset: the first position the layer attends to (its window's, before this forward).
        attention_kwargs: the dict transformers hands the attention function, when attention reads from the
            pool (``paged_sdpa``): the reads go there and the new K/V are returned unused.
        needs_grad: gradients flow through the new K/V (an empty cache only).
        batch_invariant: the reads are per row, for attention that computes each query as if alone.
    """
    with lock.shared():  # another thread's forward may grow the pool's tensors in place
        write_new_tokens(keys, key_states, index)
        write_new_tokens(values, value_states, index)
        if needs_grad:
            return key_states, value_states  # an empty cache returns the new K/V itself, as DynamicCache
        if attention_kwargs is not None:
            decode_reads = None if batch_invariant else index.decode_reads(
                offset, window, views=keys.plain is not None and values.plain is not None
            )
            per_row = decode_reads is None  # else a decode forward's rows attend in groups: no per-row index is made
            attention_kwargs[PAGED_INPUTS] = PagedAttentionInputs(
                keys, values, keys.num_heads, index.row_keys(offset) if per_row else None,
                index.queries() if per_row else None, window, lock,
                (key_states, value_states) if index.new_from_states else None, decode_reads, batch_invariant,
            )
            return key_states, value_states
        slots = index.read_slots_from(offset)  # [B * kv], keys and values alike
        batch_size = key_states.shape[0]
        dense = gather(keys, slots, batch_size), gather(values, slots, batch_size)  # copies: safe once the lock is let go
    if index.new_from_states:  # a sliding window stores only the forward's last tokens: new K/V as given
        return torch.cat([dense[0], key_states], dim=2), torch.cat([dense[1], value_states], dim=2)
    return dense


def write_new_tokens(storage: StoredStates, new: torch.Tensor, index: SlotIndex) -> None:
    """Store a layer's new keys (or values) ``[B, H, q, D]`` into its ``[H, slots, D]`` storage."""
    batch_size, heads, query_length, dim = new.shape
    # [H, B * q, D] (at batch 1 a view, taken with one op: this runs twice per layer and forward)
    new = new[0] if batch_size == 1 else new.transpose(0, 1).reshape(heads, batch_size * query_length, dim)
    if index.write_rows is not None:
        new = new.index_select(1, index.write_rows)  # [H, N, D] real tokens only
    storage.write(index.write_slots, new)


def gather(storage: StoredStates, slots: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Dense ``[B, H, kv, D]`` K or V at `slots` ``[B * kv]`` (row after row), contiguous as `DynamicCache` holds
    them, so that any attention implementation takes them."""
    return by_row(storage.gather(slots), batch_size).contiguous()


def dense_layer(
    pool: KVPool, layer_idx: int, rows: RowsView, is_real: torch.Tensor, offset: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer `layer_idx`'s keys and values from position `offset` on, as dense ``[B, H, L - offset, D]`` copies.

    Args:
        rows: the block tables of the layer's group, as the caller reads them (the last committed forward's).
        is_real: ``[B, L]`` False where a position is padding (it reads the null block's zeros).
    Raises:
        ValueError: the layer has stored nothing yet.
    """
    keys, values = pool.stored(layer_idx)
    device = keys.data.device
    table = rows.as_tensor(device)  # [B, max_blocks]
    slots = slots_for_positions(table, is_real.to(device), pool.block_size)  # [B, L]
    slots = slots[:, offset:].reshape(-1)  # [B * (L - offset)]
    with pool.storage_lock.shared():
        return gather(keys, slots, is_real.shape[0]), gather(values, slots, is_real.shape[0])
