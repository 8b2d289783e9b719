"""`PagedCache`: a `transformers.Cache` whose keys and values live in blocks of a shared `KVPool`."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig, PreTrainedModel
from transformers.cache_utils import DummyLayer

from ..kinds import LayerSpec, keeps_states, layer_kinds
from ..kinds.encoder_decoder import cross_attention_share, is_encoder_decoder
from ..pool.kv_pool import KVPool
from ..pool.memory import KVLayout, dense_attention_kinds, parse_memory
from .batch import PagedBatch
from .batch_invariance import make_batch_invariant
from .block_table import BlockTables, RowsView
from .cross_attention import PagedCrossAttentionCache
from .encoder_decoder import PagedEncoderDecoderCache
from .forward_control import ForwardControl
from .forward_lifecycle import ForwardLifecycle
from .indexer_access import IndexerAccess
from .inputs import install_input_hook, prefix_root, refuse_paged_attention
from .layer import PagedLayer
from .layer_io import dense_layer, store_layer
from .model_checks import check_model
from .sharing import BlockSharing
from .state_access import StateAccess
from .state_layer import PagedDummyLayer, PagedHybridLayer, PagedStateLayer
from .state_probe import state_bytes_per_sequence
from .stats import CacheStats


class PagedCache(BlockSharing, StateAccess, IndexerAccess, ForwardControl, Cache):
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
        kv_dtype: how a new pool stores keys and values: None (the default) as the model computes them;
            ``"int8"`` or ``"float8_e4m3fn"`` (8-bit elements with their scales per token and head, about
            0.28x of float32's bytes; `KVFormat`); ``"bfloat16"`` or ``"float16"`` (a plain cast). Reads give the
            model's dtype back, so attention computes as before, from rounded keys and values. A shared
            `pool` brings its own (`KVPool.kv_format`). `ValueError` for any other name.
        manual_commit: keep a forward's forward pending once it has run, until `commit()` keeps it or `settle()`
            drops it (a continuous batcher commits a forward only once every request in it has its token).
        max_sequences: for a model with conv / recurrent states, the sequences a new pool keeps states for
            (one slot each): by default as many as come (elastic), or 64 under `max_memory`, which holds the
            slots (their bytes measured by one forward of one token) and the blocks together.
        batch_invariant: each row's logits the same bits whatever else shares its forwards, prefill or decode
            (docs/determinism.md); switches the model for good (`make_batch_invariant`, which raises for a model
            the mode cannot run); close to the default mode's logits, not bitwise equal.

    A forward is all or nothing: it is kept once the whole forward has run (the model's LM head included,
    for a cache built from the model), and if it fails anywhere (an exception, `PoolExhaustedError`), its
    forward is rolled back at once, blocks and prefix registrations included, so the cache and the pool are
    exactly as they were before. (After a ``KeyboardInterrupt``, which no hook sees, the next forward or the
    next read on the same thread rolls it back.)

    Reads (`get_seq_length`, `stats`, `is_real`, `block_tables`, ``repr``, ``layers[i].keys``) are safe from
    any thread at any time: they see the cache as its last committed forward left it and change nothing.

    Use ``with PagedCache(model) as cache:`` or call `release()` to give the blocks back; a cache that is
    dropped gives them back at once.
    """

    def __new__(cls, config_or_model: object = None, *args: Any, **kwargs: Any) -> Any:
        """An encoder-decoder model's cache is a `PagedEncoderDecoderCache` (an `EncoderDecoderCache`, which such
        models require), whose decoder self-attention cache is a `PagedCache` (`for_decoder`)."""
        if cls is PagedCache and isinstance(config_or_model, PreTrainedModel) and is_encoder_decoder(config_or_model.config):
            return _encoder_decoder_cache(config_or_model, *args, **kwargs)
        return super().__new__(cls)

    @classmethod
    def for_decoder(cls, model: PreTrainedModel, **kwargs: Any) -> PagedCache:
        """The decoder self-attention cache of encoder-decoder `model` (`PagedEncoderDecoderCache` holds it)."""
        cache = object.__new__(cls)
        cache.__init__(model, **kwargs)
        return cache

    def __init__(
        self,
        config_or_model: PreTrainedConfig | PreTrainedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        pool: KVPool | None = None,
        manual_commit: bool = False,
        kv_dtype: str | torch.dtype | None = None,
        max_sequences: int | None = None,
        batch_invariant: bool = False,
    ):
        model = config_or_model if isinstance(config_or_model, PreTrainedModel) else None
        config = model.config if model is not None else config_or_model
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"PagedCache needs a transformers model or config, got {type(config_or_model).__name__}"
            )
        if model is None and is_encoder_decoder(config):
            raise ValueError(
                f"an encoder-decoder model's PagedCache ({config.model_type!r}) is built from the model "
                "(PagedCache(model)): it holds the cross-attention keys and values too"
            )
        specs = layer_kinds(config)  # raises NotImplementedError for unsupported models
        check_model(config, model, specs)
        windows = [spec.window for spec in specs]
        # layer kinds no paged attention can run
        self._dense_kinds = dense_attention_kinds(config, [spec.kind.name for spec in specs])
        self.pool = _pool_for(config, model, windows, pool, block_size, num_blocks, max_memory, kv_dtype, max_sequences)
        if batch_invariant:
            make_batch_invariant(model, specs, self.pool)  # raises for a config, or a model the mode cannot run
        self.batch_invariant = batch_invariant
        self._source = config_or_model  # what fork() builds its twin from
        super().__init__(layers=[_layer_for(self, idx, spec) for idx, spec in enumerate(specs)])
        # Blocks are keyed by prefix only for a model-built cache: the key's root stands for the model's weights.
        # An encoder-decoder's decoder keys depend on the encoder's input too, which no prefix key covers.
        keyed = model is not None and not is_encoder_decoder(config)
        # a batch-invariant cache's keys and values differ in their last bits: its blocks are found by its kind only
        self.batch = PagedBatch(self.pool, root=prefix_root(model) + b"invariant" * batch_invariant if keyed else None)
        self.lifecycle = ForwardLifecycle(self.batch, self.layers, manual_commit, model)
        # [B] after the running forward computed only the distinct rows of its batch: row i repeats computed row
        # rows[i] (`repeat_rows_after_forward`)
        self._rows_after_forward: torch.Tensor | None = None
        # A cache dropped without `release()` gives its blocks back at once (it is in no reference cycle).
        self._finalizer = weakref.finalize(self, _release_all, self.batch.groups)
        if model is not None:
            install_input_hook(model)

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
        keys, values = self.pool.layer(layer_idx, key_states, value_states)
        layer.is_initialized = True
        forward = self.lifecycle.enter(layer, key_states.shape[0], key_states.shape[2], key_states.device)
        needs_grad = _needs_grad(key_states, value_states, forward.past_length)
        attention_kwargs = kwargs.get("kwargs")  # the dict transformers also hands the attention function
        from_pool = forward.from_pool and isinstance(attention_kwargs, dict) and not needs_grad
        index = self.lifecycle.index(self.pool.group_of[layer_idx], key_states.device)
        result = store_layer(
            keys, values, key_states, value_states, index,
            layer.window_offset(),  # before this forward's tokens count, as `get_mask_sizes` saw it
            layer.sliding_window, self.pool.storage_lock, attention_kwargs if from_pool else None, needs_grad,
            self.batch_invariant,
        )
        self.lifecycle.leave(layer, forward)
        return result

    def observe_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        query_length: int,
        position_ids: torch.Tensor | None = None,
        attention: str | None = None,
        hooked: bool = False,
    ) -> None:
        """Tell the cache the next forward's token ids and which of its `query_length` tokens are padding.

        Called by the model's forward pre-hook when the cache is built from a model; call it yourself
        before each forward if you built the cache from a config. `attention_mask` is the usual 2D
        ``[B, past + q]`` mask; anything else means "no padding" (padding is then stored, which changes
        memory, never results). Token ids (with `position_ids` when the forward gets them) let full blocks
        be found again by prefix (`reuse_prefix`). When `attention` is ``"paged_sdpa"``, attention reads the
        keys and values straight from the pool (no dense copy). A forward left unfinished by a failed forward
        is rolled back. `hooked` (set by the model's pre-hook) means its forward hook will call `forward_ended`.
        """
        refuse_paged_attention(attention, self._dense_kinds)  # before anything changes
        self.lifecycle.drop_unfinished()
        self.lifecycle.pending.observe(input_ids, attention_mask, query_length, position_ids, attention, hooked)

    # ------------------------------------------------------------------ the Cache contract

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions the cache holds (padding included), as its last committed forward left them."""
        if layer_idx >= len(self.layers):
            return 0
        self.lifecycle.settle_failed_here()
        with self.batch.lock:
            return self.lifecycle.committed_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        self.lifecycle.settle_failed_here()
        with self.batch.lock:
            return self.layers[layer_idx].get_mask_sizes(query_length, self.lifecycle.committed_length())

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` positions (a negative count, as `DynamicCache.crop`).

        Sliding-window layers then keep only what their window needs, as `DynamicSlidingWindowLayer` does,
        even for ``crop(0)``. Positions they gave back cannot come back: removing so many that the window would
        need them raises `ValueError` (call `activate_past_recording()` before forwards you may crop).
        """
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of positions to remove, as with DynamicCache"
            )
        if tokens_to_remove:
            self.refuse_with_states("crop")
        self.lifecycle.drop_unfinished()
        with self.batch.lock:
            length = self.lifecycle.committed_length()
            remove = min(-tokens_to_remove, length)
            self.batch.truncate(length - remove)
            for layer in self.layers:
                layer.length = min(layer.length, length - remove)

    def activate_past_recording(self) -> None:
        """Keep the blocks sliding windows no longer need until the next `crop` (which can then go back).

        transformers calls this before forwards it may roll back (assisted decoding), as for `DynamicCache`.
        """
        self.batch.record_past = True

    def is_recording_past(self, layer_idx: int = 0) -> bool:
        return self.batch.record_past

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row `i` becomes old row ``beam_idx[i]``, sharing its blocks (no K/V is copied)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row `repeats` times in place, sharing blocks instead of copying them."""
        self._select_rows(torch.arange(self.batch_size).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only rows `indices` (their blocks are shared or freed, never copied)."""
        self._select_rows(indices)

    def _select_rows(self, indices: torch.Tensor | list[int]) -> None:
        self.lifecycle.drop_unfinished()
        self.batch.select(indices)

    def reset(self) -> None:
        """Give every block back to the pool and empty the cache; it stays usable."""
        with self.batch.lock:
            self.lifecycle.reset()  # an unfinished forward's blocks are released with the rest
            for layer in self.layers:
                layer.reset()

    def release(self) -> None:
        """Give every block back (`reset()`); what leaving ``with PagedCache(...) as cache:`` does."""
        self.reset()

    def __enter__(self) -> PagedCache:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    # ------------------------------------------------------------------ accounting

    @property
    def batch_size(self) -> int:
        """Rows (sequences) the cache holds, as its last committed forward left them."""
        with self.batch.lock:
            return self.lifecycle.committed()[0][0].batch_size

    @property
    def block_tables(self) -> RowsView:
        """A snapshot of each row's blocks (first layer group) and stored tokens, as last committed."""
        self.lifecycle.settle_failed_here()
        with self.batch.lock:
            return self.lifecycle.committed()[0][0].copy()

    @property
    def is_real(self) -> torch.Tensor:
        """``[B, L]`` bool: False where a logical position is padding (stored nowhere), as last committed."""
        with self.batch.lock:
            return self.lifecycle.committed()[1]

    def stats(self) -> CacheStats:
        """Blocks, state slots, tokens and bytes this cache holds, in total and per layer group, as last committed."""
        self.lifecycle.settle_failed_here()
        with self.batch.lock:
            slots = self.committed_state_slots() if self.batch.states is not None else ()
            return CacheStats.of(self.lifecycle.committed()[0], self.pool, slots)

    def dense_view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values as `DynamicCache` holds them: dense ``[B, H, length, D]`` copies.

        A sliding layer gives its last ``sliding_window - 1`` positions; padding positions read zeros.
        """
        self.lifecycle.settle_failed_here()
        with self.batch.lock:  # held while gathering: a commit may free blocks the last committed forward holds
            offset = self.layers[layer_idx].window_offset(self.lifecycle.committed_length())
            views, is_real = self.lifecycle.committed()
            return dense_layer(self.pool, layer_idx, views[self.pool.group_of[layer_idx]], is_real, offset)

    def __repr__(self) -> str:
        self.lifecycle.settle_failed_here()
        with self.batch.lock:
            views = self.lifecycle.committed()[0]
            blocks = [len(view.unique_blocks()) for view in views]
            length = self.lifecycle.committed_length()
        return (
            f"PagedCache(rows={views[0].batch_size}, length={length}, "
            f"blocks={blocks[0] if len(blocks) == 1 else blocks}, pool={self.pool!r})"
        )


CacheLayer = PagedLayer | PagedStateLayer | DummyLayer


def _layer_for(cache: PagedCache, layer_idx: int, spec: LayerSpec) -> CacheLayer:
    """Layer `layer_idx`'s view of `cache`, by what its kind keeps: tokens, states, both, or nothing."""
    kind = spec.kind
    if kind.tokens and kind.state:
        return PagedHybridLayer(cache, layer_idx, spec.window, spec.number_of_states)
    if kind.tokens:
        return PagedLayer(cache, layer_idx, spec.window)
    if kind.state:
        return PagedStateLayer(cache, layer_idx, spec.number_of_states)
    return PagedDummyLayer(layer_idx)


def _encoder_decoder_cache(model: PreTrainedModel, *args: Any, max_memory: int | str | None = None,
                           **kwargs: Any) -> PagedEncoderDecoderCache:
    """An encoder-decoder model's cache. `max_memory` is split between the decoder's pool and the cross-attention's
    (`cross_attention_share`), the latter then fixed; without it the cross-attention pool grows as needed."""
    if max_memory is None:
        return PagedEncoderDecoderCache(PagedCache.for_decoder(model, *args, **kwargs))
    budget = parse_memory(max_memory)
    cross_budget = int(budget * cross_attention_share(model.config))
    decoder = PagedCache.for_decoder(model, *args, max_memory=budget - cross_budget, **kwargs)
    pool = decoder.pool  # the cross-attention's: the decoder's heads and head size, kept as the model computes them
    cross_pool = KVPool.for_config(model.config, layout=pool.layout, block_size=pool.block_size, dtype=pool.dtype,
                                   max_memory=cross_budget)
    return PagedEncoderDecoderCache(decoder, PagedCrossAttentionCache(cross_pool))


def _release_all(groups: list[BlockTables]) -> None:
    for tables in groups:
        tables.release()


def _needs_grad(key_states: torch.Tensor, value_states: torch.Tensor, past_length: int) -> bool:
    """Whether this forward wants gradients through its keys/values; refused over stored positions."""
    needs_grad = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
    if needs_grad and past_length:
        raise RuntimeError(
            "PagedCache stores keys and values outside autograd, so gradients cannot flow into the positions "
            "it already holds: run this forward under torch.no_grad() (as generate does), or use DynamicCache "
            "or no cache to train through a chunked forward"
        )
    return needs_grad


def _pool_for(
    config: PreTrainedConfig,
    model: PreTrainedModel | None,
    windows: list[int | None],
    pool: KVPool | None,
    block_size: int,
    num_blocks: int | None,
    max_memory: int | str | None,
    kv_dtype: str | torch.dtype | None,
    max_sequences: int | None,
) -> KVPool:
    """The given `pool`, checked against the model's layers, or a new one of the requested size and format."""
    if pool is None:
        dtype = _model_dtype(model, config)
        measure = model is not None and max_memory is not None and keeps_states(config)
        state_bytes = state_bytes_per_sequence(model) if measure else None  # what a budget sets aside per sequence
        layout = KVLayout.from_model(model) if model is not None else None  # tensor-parallel ranks: their heads
        return KVPool.for_config(
            config, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, dtype=dtype, layout=layout,
            kv_dtype=kv_dtype, max_sequences=max_sequences, state_bytes=state_bytes,
        )
    if num_blocks is not None or max_memory is not None or max_sequences is not None:
        raise ValueError("pass either pool= or a size (num_blocks= / max_memory= / max_sequences=), not both")
    if kv_dtype is not None:
        raise ValueError("pass either pool= or kv_dtype=, not both: a shared pool stores keys and values its own way")
    if pool.layout.num_layers != len(windows):
        raise ValueError(
            f"the pool was built for {pool.layout.num_layers} layers but {config.model_type!r} has "
            f"{len(windows)}: is it a pool for another model?"
        )
    if list(pool.layout.windows or [None] * len(windows)) != list(windows):
        raise ValueError(
            f"the pool was built for attention windows {pool.layout.windows} but {config.model_type!r} has "
            f"{windows}: is it a pool for another model?"
        )
    return pool


def _model_dtype(model: PreTrainedModel | None, config: PreTrainedConfig) -> torch.dtype:
    if model is not None:
        return model.dtype
    dtype = getattr(config.get_text_config(decoder=True), "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32

