"""One layer's part of a forward: its new keys and values into the pool, and what its attention then reads.

`store_layer` writes the new tokens through the step's slot index (`cache.step.StepIndex`) and hands
attention one of three things: for ``paged_sdpa``, a read plan over the pool (`PagedAttentionInputs`, no
copy); for any other attention, dense ``[B, heads, kv_length, dim]`` K/V gathered through the block tables
(padding reads the all-zero null block); for a grad-enabled forward on an empty cache, the new K/V
themselves, so that gradients flow as with `DynamicCache`.
"""

from __future__ import annotations

import torch

from ..attention.block_attention import PAGED_INPUTS, PagedAttentionInputs
from ..pool.locks import SharedExclusiveLock
from .step import StepIndex


def store_layer(
    keys: torch.Tensor,
    values: torch.Tensor,
    key_states: torch.Tensor,
    value_states: torch.Tensor,
    index: StepIndex,
    offset: int,
    window: int | None,
    lock: SharedExclusiveLock,
    attention_kwargs: dict | None,
    needs_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Write a layer's new K/V into its storage and return what ``cache.update`` returns.

    Args:
        keys, values: the layer's flat ``[slots, heads, dim]`` storage.
        key_states, value_states: ``[B, heads, q, dim]`` the step's new keys and values.
        offset: the first position the layer attends to (its window's, before this step).
        attention_kwargs: the dict transformers hands the attention function, when attention reads from the
            pool (``paged_sdpa``): the read plan goes there and the new K/V are returned unused.
        needs_grad: gradients flow through the new K/V (an empty cache only).
    """
    with lock.shared():  # another thread's step may grow the pool's tensors in place
        write_new_tokens(keys, key_states, index)
        write_new_tokens(values, value_states, index)
        if needs_grad:
            return key_states, value_states  # an empty cache returns the new K/V itself, as DynamicCache
        heads = keys.shape[1]
        if attention_kwargs is not None:
            attention_kwargs[PAGED_INPUTS] = PagedAttentionInputs(
                keys.view(-1, keys.shape[-1]), values.view(-1, values.shape[-1]), heads,
                index.row_keys(offset, heads), index.queries(), window, lock,
                (key_states, value_states) if index.new_from_states else None,
                index.decode_keys(offset, heads, window),
            )
            return key_states, value_states
        rows = index.read_rows(offset, heads)  # [B, H, kv], keys and values alike
        dense = gather(keys, rows), gather(values, rows)  # copies: safe once the lock is let go
    if index.new_from_states:  # a sliding window stores only the step's last tokens: new K/V as given
        return torch.cat([dense[0], key_states], dim=2), torch.cat([dense[1], value_states], dim=2)
    return dense


def write_new_tokens(storage: torch.Tensor, new: torch.Tensor, index: StepIndex) -> None:
    """Store a layer's new keys (or values) ``[B, H, q, D]`` into its flat ``[slots, H, D]`` storage."""
    batch_size, _, query_length, _ = new.shape
    new = new.transpose(1, 2).reshape(batch_size * query_length, *storage.shape[1:])  # [B * q, H, D]
    if index.write_rows is not None:
        new = new.index_select(0, index.write_rows)  # [N, H, D] real tokens only
    storage.index_copy_(0, index.write_slots, new.detach())  # the pool never joins an autograd graph


def gather(storage: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense ``[B, H, kv_length, D]`` K or V: rows `rows` ``[B, H, kv_length]`` of the flat ``[slots * H, D]``."""
    dim = storage.shape[-1]
    return storage.view(-1, dim).index_select(0, rows.reshape(-1)).view(*rows.shape, dim)  # [B, H, kv, D]
