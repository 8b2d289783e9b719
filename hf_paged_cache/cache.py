"""`PagedCache`: a `transformers.Cache` whose keys and values live in blocks of a shared `KVPool`."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig, PreTrainedModel

from .block_table import BlockTables
from .inputs import PendingInputs, attach_input_hook
from .kv_pool import KVPool
from .layer import PagedLayer, attention_windows
from .stats import CacheStats
from .step import Step, build_index, gather, plan_step, write_new_tokens


class PagedCache(Cache):
    """A KV cache stored in fixed-size blocks of a shared pool, usable wherever transformers takes a `Cache`.

    Each row of the batch owns a block table; blocks are allocated as tokens arrive and shared (by reference
    count) between rows and caches. ``update`` writes the new tokens into their slots and returns ordinary
    dense ``[B, heads, kv_length, dim]`` K/V gathered through the block tables, with padding positions read
    from the all-zero null block, so any attention implementation gives the same result as with
    `DynamicCache`.

    Args:
        config_or_model: the model (preferred) or its config. Given the model, the cache watches each
            forward's ``attention_mask`` through a forward pre-hook, so padding tokens take no blocks; given
            only a config, padding is stored like any token (results are the same, memory is not).
        block_size: tokens per block (ignored when `pool` is given).
        num_blocks: size of a new pool in blocks (block 0 is reserved).
        max_memory: size of a new pool as a byte budget: an int or a string like ``"512MiB"``.
        pool: an existing `KVPool` to share with other caches.

    Use ``with PagedCache(model) as cache:`` or call `release()` to give the blocks back.
    """

    def __init__(
        self,
        config_or_model: PreTrainedConfig | PreTrainedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        pool: KVPool | None = None,
    ):
        model = config_or_model if isinstance(config_or_model, PreTrainedModel) else None
        config = model.config if model is not None else config_or_model
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"PagedCache needs a transformers model or config, got {type(config_or_model).__name__}"
            )
        windows = attention_windows(config)  # raises NotImplementedError for unsupported models

        if pool is None:
            dtype = _model_dtype(model, config)
            pool = KVPool.for_config(
                config, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, dtype=dtype
            )
        elif num_blocks is not None or max_memory is not None:
            raise ValueError("pass either pool= or a size (num_blocks= / max_memory=), not both")
        if pool.layout.num_layers != len(windows):
            raise ValueError(
                f"the pool was built for {pool.layout.num_layers} layers but {config.model_type!r} has "
                f"{len(windows)}: is it a pool for another model?"
            )
        self.pool = pool
        self._source = config_or_model  # what fork() builds its twin from
        super().__init__(layers=[PagedLayer(self, idx, window) for idx, window in enumerate(windows)])
        self.block_tables = BlockTables(pool.blocks)
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)  # [B, L] False where a position is padding
        self._step: Step | None = None
        self._pending = PendingInputs()
        # A cache dropped without `release()` still gives its blocks back when it is garbage collected.
        self._finalizer = weakref.finalize(self, BlockTables.release, self.block_tables)
        self._hook = attach_input_hook(model, self) if model is not None else None

    # ------------------------------------------------------------------ the forward path

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store this forward's keys/values of layer `layer_idx` and return the dense K/V to attend to.

        Args:
            key_states: ``[B, heads, q, key_dim]`` new keys.
            value_states: ``[B, heads, q, value_dim]`` new values.
        Returns:
            keys ``[B, heads, kv_length, key_dim]`` and values ``[B, heads, kv_length, value_dim]`` covering
            the positions given by `get_mask_sizes` (zeros at padding positions, which the mask hides).
        """
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"layer_idx {layer_idx} is outside this cache's {len(self.layers)} layers")
        if key_states.ndim != 4:
            raise ValueError(f"expected key states shaped [batch, heads, seq, dim], got {tuple(key_states.shape)}")
        layer = self.layers[layer_idx]
        batch_size, _, query_length, _ = key_states.shape
        keys, values = self.pool.layer(layer_idx, key_states, value_states)
        layer.is_initialized = True
        step = self._step
        if step is None or layer.length == step.length:
            step = self._begin_step(layer, batch_size, query_length, key_states.device)
        elif layer.length != step.past_length:
            raise RuntimeError(
                f"layer {layer_idx} has seen {layer.length} positions but the forward in progress runs from "
                f"{step.past_length}: an earlier forward was interrupted; call crop() or reset() first"
            )
        if (batch_size, query_length) != (step.batch_size, step.query_length):
            raise ValueError(
                f"layer {layer_idx} got {batch_size} rows x {query_length} tokens but this forward began with "
                f"{step.batch_size} x {step.query_length}"
            )
        index = build_index(step, self.block_tables, self.is_real, self.pool.block_size, key_states.device)
        offset = layer.window_offset()  # before this step's tokens count, as `get_mask_sizes` saw it
        write_new_tokens(keys, key_states, index)
        write_new_tokens(values, value_states, index)
        layer.length = step.length

        rows = index.read_rows(offset, keys.shape[1])  # [B, H, kv_length], keys and values alike
        return gather(keys, rows), gather(values, rows)

    def _begin_step(self, layer: PagedLayer, batch_size: int, query_length: int, device: torch.device) -> Step:
        """Plan a new forward: check the batch, take blocks for its real tokens (all or nothing)."""
        past_length = layer.length
        rows = self.block_tables.batch_size
        if rows == 0 and past_length == 0:
            self.block_tables.add_rows(batch_size)
            self.is_real = torch.zeros(batch_size, 0, dtype=torch.bool, device=device)
        elif rows and batch_size != rows and batch_size % rows == 0:
            # generate() expands input_ids (num_return_sequences, num_beams) but not a cache passed to it:
            # k x B rows fed to a cache of B rows means each row repeated k times, sharing its blocks.
            self.batch_repeat_interleave(batch_size // rows)
        elif batch_size != rows:
            raise ValueError(
                f"this cache holds {rows} sequences but the forward has batch size {batch_size}; call "
                "batch_select_indices() or batch_repeat_interleave() to change the batch, or reset() it"
            )
        new_real, new_ids = self._pending.take(batch_size, query_length)  # [B, q] each, or None
        step = plan_step(self.block_tables, self.pool, past_length, query_length, new_real, new_ids)
        if new_real is None:
            new_real = torch.ones(batch_size, query_length, dtype=torch.bool, device=device)
        self.is_real = torch.cat([self.is_real.to(device), new_real.to(device)], dim=1)  # [B, L + q]
        self._step = step
        return step

    def observe_inputs(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, query_length: int
    ) -> None:
        """Tell the cache the next forward's token ids and which of its `query_length` tokens are padding.

        Called by the forward pre-hook installed when the cache is built from a model; call it yourself
        before each forward if you built the cache from a config. `attention_mask` is the usual 2D
        ``[B, past + q]`` mask; anything else means "no padding" (padding is then stored, which changes
        memory, never results). Token ids let full blocks be found again by prefix (`reuse_prefix`).
        """
        self._pending.observe(input_ids, attention_mask, query_length)

    # ------------------------------------------------------------------ the Cache contract

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (a negative count, as `DynamicCache.crop`)."""
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of positions to remove, as with DynamicCache"
            )
        length = self.get_seq_length()
        remove = min(-tokens_to_remove, length)
        if remove == 0:
            return
        removed = self.is_real[:, length - remove :].sum(dim=1).tolist()  # real tokens per row
        self.block_tables.truncate(removed)
        self.is_real = self.is_real[:, : length - remove]
        for layer in self.layers:
            layer.length = min(layer.length, length - remove)
        self._step = None

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes old row ``beam_idx[i]``, sharing its blocks (no K/V is copied)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place, sharing blocks instead of copying them."""
        self._select_rows(torch.arange(self.block_tables.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows `indices` (their blocks are shared or freed, never copied)."""
        self._select_rows(indices)

    def _select_rows(self, indices: torch.Tensor | list[int]) -> None:
        rows = torch.as_tensor(indices, dtype=torch.long).cpu()
        if rows.numel() and (rows.min() < 0 or rows.max() >= self.block_tables.batch_size):
            raise IndexError(f"row indices {rows.tolist()} out of range for {self.block_tables.batch_size} rows")
        self.block_tables.select(rows.tolist())
        self.is_real = self.is_real[rows.to(self.is_real.device)]
        self._step = None

    def reset(self) -> None:
        """Give every block back to the pool and empty the cache; it stays usable."""
        self.block_tables.release()
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)
        self._step = None
        self._pending.clear()
        for layer in self.layers:
            layer.reset()

    def release(self) -> None:
        """`reset()` and detach from the model: the cache keeps no blocks and no hook."""
        self.reset()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def fork(self) -> PagedCache:
        """A new cache on the same pool holding the same sequences, sharing every block (copy-on-write).

        Prefill a long system prompt once, then fork it for each request instead of `copy.deepcopy`: the
        fork costs no K/V copy, and each side copies at most its partly filled last block when it writes.
        """
        twin = PagedCache(self._source, pool=self.pool)
        self.block_tables.copy_to(twin.block_tables)
        twin.is_real = self.is_real.clone()
        for mine, theirs in zip(twin.layers, self.layers):
            mine.length, mine.is_initialized = theirs.length, theirs.is_initialized
        return twin

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(cache)` (the usual way to reuse a prefilled cache) forks instead of copying the pool."""
        return self.fork()

    def reuse_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Fill this empty cache with the longest prefix of `input_ids` already cached in the pool.

        Full blocks that earlier caches on this pool wrote (and registered by their token ids) are shared,
        not recomputed; `generate(input_ids, cache=cache)` then computes only the remaining tokens.
        Rows must not be padded. Returns the number of positions reused (a multiple of `block_size`, the
        same for every row, always leaving at least one token to compute).

        Args:
            input_ids: ``[B, S]`` token ids.
            attention_mask: ``[B, S]``, optional; if given it must be all ones (no padding).
        """
        if self.block_tables.batch_size or self.get_seq_length():
            raise ValueError("reuse_prefix() needs an empty cache; call reset() first")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("reuse_prefix() needs unpadded rows: a padded prompt's blocks are not position-aligned")
        rows = input_ids.tolist()
        length = self.block_tables.adopt_longest_prefix(rows)
        self.is_real = torch.ones(len(rows), length, dtype=torch.bool, device=input_ids.device)
        for layer in self.layers:
            layer.length = length
        return length

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # ------------------------------------------------------------------ accounting

    @property
    def batch_size(self) -> int:
        return self.block_tables.batch_size

    def stats(self) -> CacheStats:
        """Blocks, tokens and bytes this cache holds right now."""
        return CacheStats.of(self.block_tables, self.pool)

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self.batch_size}, length={self.get_seq_length()}, "
            f"blocks={len(self.block_tables.unique_blocks())}, pool={self.pool!r})"
        )


def _model_dtype(model: PreTrainedModel | None, config: PreTrainedConfig) -> torch.dtype:
    if model is not None:
        return model.dtype
    dtype = getattr(config.get_text_config(decoder=True), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32

