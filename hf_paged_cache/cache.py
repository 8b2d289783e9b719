"""`PagedCache`: a `transformers.Cache` whose keys and values live in blocks of a shared `KVPool`."""

from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from .block_table import BlockTables, slots_for_positions
from .kv_pool import KVPool

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class CacheStats:
    """Memory held by one `PagedCache` (blocks shared between its rows are counted once)."""

    blocks_in_use: int
    tokens_stored: int  # real tokens over all rows (a shared prefix counts once per row)
    bytes_reserved: int  # blocks_in_use x bytes per block
    bytes_used: int  # bytes of the block slots that hold a token
    pool_bytes: int  # K/V tensors allocated for the whole (shared) pool so far
    utilization: float  # bytes_used / bytes_reserved (1.0 for an empty cache)
    prefix_hits: int  # pool-wide: full blocks found by prefix lookups
    prefix_misses: int  # pool-wide: full blocks looked up and not found
    prefix_evictions: int  # pool-wide: cached blocks given up to make room


@dataclass
class _StepIndex:
    """Where one forward's tokens go and where every position is read from, on one device."""

    write_slots: torch.Tensor  # [N] pool slot of each stored new token
    write_rows: torch.Tensor | None  # [N] index into the flattened [B * q] new tokens; None = all of them
    read_slots: torch.Tensor  # [B, L + q] pool slot of every position (padding -> null block)
    _rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # read_rows, per (offset, heads)

    def read_rows(self, offset: int, num_heads: int) -> torch.Tensor:
        """``[B, H, kv_length]`` rows of the flat ``[slots * H, D]`` storage for positions ``offset:``.

        Head-major (row ``slot * H + head``), so the gather yields the contiguous per-head layout that
        `DynamicCache` holds and SDPA reads fastest. Computed once per step for all layers alike.
        """
        rows = self._rows.get((offset, num_heads))
        if rows is None:
            slots = self.read_slots[:, offset:]  # [B, kv]
            heads = torch.arange(num_heads, device=slots.device)  # [H]
            rows = self._rows[(offset, num_heads)] = slots.unsqueeze(1) * num_heads + heads.view(1, -1, 1)
        return rows


@dataclass
class _Step:
    """The plan of the forward in progress, made once by its first layer and used by all of them."""

    batch_size: int
    query_length: int
    past_length: int
    all_real: bool  # no padding among the new tokens
    index: dict[torch.device, _StepIndex] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.past_length + self.query_length


class PagedLayer(CacheLayerMixin):
    """One layer's view of a `PagedCache`: its length and attention window; the data lives in the pool."""

    is_compileable = False
    is_croppable = True

    def __init__(self, cache: PagedCache, layer_idx: int, sliding_window: int | None = None):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.sliding_window = sliding_window
        self.length = 0  # logical positions seen, padding included (as `DynamicLayer.get_seq_length`)

    @property
    def is_sliding(self) -> bool:
        return self.sliding_window is not None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._cache.pool.layer(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self._cache.update(key_states, value_states, self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the K/V `update` returns next: the whole past, or the last window."""
        offset = self.window_offset()
        return self.length - offset + query_length, offset

    def window_offset(self) -> int:
        """First position this layer attends to (0 for full attention), as `DynamicSlidingWindowLayer`."""
        if self.sliding_window is None:
            return 0
        return max(self.length - self.sliding_window + 1, 0)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0


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
        text_config = config.get_text_config(decoder=True)
        if getattr(config, "is_encoder_decoder", False):
            raise NotImplementedError(
                f"PagedCache supports decoder-only models; {config.model_type!r} is an encoder-decoder model"
            )
        layer_types, layer_kwargs = get_layer_types_and_kwargs(text_config)
        unsupported = sorted(set(layer_types) - set(SUPPORTED_LAYER_TYPES))
        if unsupported:
            raise NotImplementedError(
                f"PagedCache supports attention layers of types {SUPPORTED_LAYER_TYPES}; model type "
                f"{config.model_type!r} has layers of type {unsupported}"
            )

        if pool is None:
            dtype = _model_dtype(model, text_config)
            pool = KVPool.for_config(
                config, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, dtype=dtype
            )
        elif num_blocks is not None or max_memory is not None:
            raise ValueError("pass either pool= or a size (num_blocks= / max_memory=), not both")
        if pool.layout.num_layers != len(layer_types):
            raise ValueError(
                f"the pool was built for {pool.layout.num_layers} layers but {config.model_type!r} has "
                f"{len(layer_types)}: is it a pool for another model?"
            )
        self.pool = pool
        self._source = config_or_model  # what fork() builds its twin from
        layers = [
            PagedLayer(self, idx, kwargs.get("sliding_window"))
            for idx, kwargs in enumerate(layer_kwargs)
        ]
        super().__init__(layers=layers)
        self.block_tables = BlockTables(pool.blocks)
        self.is_real = torch.zeros(0, 0, dtype=torch.bool)  # [B, L] False where a position is padding
        self._step: _Step | None = None
        self._pending_mask: torch.Tensor | None = None  # [B, q] the next forward's new-token padding mask
        self._pending_ids: torch.Tensor | None = None  # [B, q] the next forward's token ids, if known
        # A cache dropped without `release()` still gives its blocks back when it is garbage collected.
        self._finalizer = weakref.finalize(self, BlockTables.release, self.block_tables)
        self._hook = _attach_padding_hook(model, self) if model is not None else None

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
        index = self._step_index(step, key_states.device)
        offset = layer.window_offset()

        for new, storage in ((key_states, keys), (value_states, values)):
            new = new.transpose(1, 2).reshape(batch_size * query_length, *storage.shape[1:])  # [B * q, H, D]
            if index.write_rows is not None:
                new = new.index_select(0, index.write_rows)  # [N, H, D] real tokens only
            storage.index_copy_(0, index.write_slots, new)
        layer.length = step.length

        rows = index.read_rows(offset, keys.shape[1])  # [B, H, kv_length], shared by keys and values
        return _gather(keys, rows), _gather(values, rows)

    def _begin_step(self, layer: PagedLayer, batch_size: int, query_length: int, device: torch.device) -> _Step:
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
        new_real, new_ids = self._take_pending_inputs(batch_size, query_length)  # [B, q] each, or None
        new_tokens = new_real.sum(dim=1).tolist() if new_real is not None else [query_length] * batch_size
        token_ids = None
        if new_ids is not None:
            rows_ids = new_ids.tolist()
            token_ids = rows_ids if new_real is None else [
                [t for t, real in zip(ids, mask) if real] for ids, mask in zip(rows_ids, new_real.tolist())
            ]
        pairs = self.block_tables.append(new_tokens, token_ids)  # raises PoolExhaustedError, changing nothing
        self.pool.copy_blocks(pairs)
        self.block_tables.finish_copy_on_write(pairs)

        all_real = new_real is None
        if all_real:
            new_real = torch.ones(batch_size, query_length, dtype=torch.bool, device=device)
        self.is_real = torch.cat([self.is_real.to(device), new_real.to(device)], dim=1)  # [B, L + q]
        self._step = _Step(batch_size, query_length, past_length, all_real)
        return self._step

    def _step_index(self, step: _Step, device: torch.device) -> _StepIndex:
        index = step.index.get(device)
        if index is None:
            is_real = self.is_real.to(device)  # [B, L + q]
            table = self.block_tables.as_tensor(device)  # [B, max_blocks]
            read_slots = slots_for_positions(table, is_real, self.pool.block_size)  # [B, L + q]
            new_real = is_real[:, step.past_length :]  # [B, q]
            if step.all_real:
                write_slots, write_rows = read_slots[:, step.past_length :].reshape(-1), None
            else:
                write_slots = read_slots[:, step.past_length :][new_real]  # [N]
                write_rows = new_real.reshape(-1).nonzero().squeeze(1)  # [N]
            index = step.index[device] = _StepIndex(write_slots, write_rows, read_slots)
        return index

    def _take_pending_inputs(
        self, batch_size: int, query_length: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        mask, self._pending_mask = self._pending_mask, None
        ids, self._pending_ids = self._pending_ids, None
        if mask is not None and (mask.shape != (batch_size, query_length) or bool(mask.all())):
            mask = None
        if ids is not None and ids.shape != (batch_size, query_length):
            ids = None
        return mask, ids

    def observe_inputs(
        self, input_ids: torch.Tensor | None, attention_mask: torch.Tensor | None, query_length: int
    ) -> None:
        """Tell the cache the next forward's token ids and which of its `query_length` tokens are padding.

        Called by the forward pre-hook installed when the cache is built from a model; call it yourself
        before each forward if you built the cache from a config. `attention_mask` is the usual 2D
        ``[B, past + q]`` mask; anything else means "no padding" (padding is then stored, which changes
        memory, never results). Token ids let full blocks be found again by prefix (`reuse_prefix`).
        """
        self._pending_mask = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            if attention_mask.shape[1] >= query_length:
                self._pending_mask = attention_mask[:, attention_mask.shape[1] - query_length :].bool()
        self._pending_ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else None

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
        self._pending_mask = self._pending_ids = None
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
        tables = twin.block_tables
        tables.tables = [list(t) for t in self.block_tables.tables]
        tables.num_tokens = list(self.block_tables.num_tokens)
        tables.token_ids = [None if t is None else list(t) for t in self.block_tables.token_ids]
        tables.hashes = [list(h) for h in self.block_tables.hashes]
        self.pool.blocks.incref(b for t in tables.tables for b in t)
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
        size = self.pool.block_size
        max_blocks = (len(rows[0]) - 1) // size
        matches = [self.pool.blocks.match_prefix(tokens, max_blocks) for tokens in rows]
        keep = min(len(m) for m in matches)
        self.pool.blocks.free(b for m in matches for b in reversed(m[keep:]))
        length = keep * size
        self.block_tables.add_rows(len(rows))
        for row, (tokens, blocks) in enumerate(zip(rows, matches)):
            self.block_tables.adopt_prefix(row, blocks[:keep], tokens[:length])
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
        filled = self.block_tables.unique_blocks()
        per_block = self.pool.bytes_per_block
        reserved = len(filled) * per_block
        used = sum(filled.values()) * per_block // self.pool.block_size
        prefix = self.pool.blocks.prefix_stats()
        return CacheStats(
            blocks_in_use=len(filled),
            tokens_stored=sum(self.block_tables.num_tokens),
            bytes_reserved=reserved,
            bytes_used=used,
            pool_bytes=self.pool.storage_bytes(),
            utilization=used / reserved if reserved else 1.0,
            prefix_hits=prefix.hits,
            prefix_misses=prefix.misses,
            prefix_evictions=prefix.evictions,
        )

    def __repr__(self) -> str:
        return (
            f"PagedCache(rows={self.batch_size}, length={self.get_seq_length()}, "
            f"blocks={len(self.block_tables.unique_blocks())}, pool={self.pool!r})"
        )


def _gather(storage: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Dense ``[B, H, kv_length, D]`` K or V: rows `rows` ``[B, H, kv_length]`` of the flat ``[slots * H, D]``."""
    dim = storage.shape[-1]
    return storage.view(-1, dim).index_select(0, rows.reshape(-1)).view(*rows.shape, dim)  # [B, H, kv, D]


def _model_dtype(model: PreTrainedModel | None, text_config: PreTrainedConfig) -> torch.dtype:
    if model is not None:
        return model.dtype
    dtype = getattr(text_config, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def _attach_padding_hook(model: PreTrainedModel, cache: PagedCache) -> torch.utils.hooks.RemovableHandle:
    """Install a forward pre-hook that shows `cache` each forward's attention mask.

    The hook holds the cache weakly and acts only on forwards that were given this cache, so any number of
    caches can watch one model (from any number of threads) without seeing each other's masks.
    """
    names = list(inspect.signature(model.forward).parameters)
    cache_ref = weakref.ref(cache)

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        target = cache_ref()
        if target is None or kwargs is None:
            # torch registers a kwargs hook in two steps; a forward running in another thread meanwhile
            # calls it without kwargs. That forward is not this cache's (it is being built or released).
            return
        bound = dict(zip(names, args)) | kwargs
        if (bound.get("cache") if bound.get("cache") is not None else bound.get("past_key_values")) is not target:
            return
        if bound.get("use_cache") is False:
            # the model would still write into the cache while the caller re-feeds the whole sequence
            # (generate(use_cache=False) does), silently stacking duplicate positions
            raise ValueError("a PagedCache was passed with use_cache=False; pass use_cache=True or no cache")
        inputs = bound.get("input_ids")
        if inputs is None:
            inputs = bound.get("inputs_embeds")
        if inputs is None:
            target.observe_inputs(None, None, 0)
            return
        target.observe_inputs(bound.get("input_ids"), bound.get("attention_mask"), inputs.shape[1])

    return model.register_forward_pre_hook(hook, with_kwargs=True)
