"""`PagedCache`: a `transformers.Cache` whose keys and values live in blocks of a shared `KVPool`."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from transformers import Cache, PreTrainedConfig, PreTrainedModel

from ..attention.block_attention import PAGED_INPUTS, PagedAttentionInputs
from ..pool.kv_pool import KVPool
from ..pool.memory import KVLayout, attention_windows
from .batch import PagedBatch
from .block_table import BlockTables, RowsView
from .inputs import install_input_hook, prefix_root
from .layer import PagedLayer
from .stats import CacheStats
from .step import gather, write_new_tokens


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
        manual_commit: keep a forward's step pending once it has run, until `commit()` keeps it or `settle()`
            drops it (a continuous batcher commits a step only once every request in it has its token).

    A forward is all or nothing: it is kept once the whole forward has run (the model's LM head included,
    for a cache built from the model), and if it fails anywhere (an exception, `PoolExhaustedError`), its
    step is rolled back at once, blocks and prefix registrations included, so the cache and the pool are
    exactly as they were before. (After a ``KeyboardInterrupt``, which no hook sees, the next forward or the
    next read on the same thread rolls it back.)

    Reads (`get_seq_length`, `stats`, `is_real`, `block_tables`, ``repr``, ``layers[i].keys``) are safe from
    any thread at any time: they see the cache as its last committed step left it and change nothing.

    Use ``with PagedCache(model) as cache:`` or call `release()` to give the blocks back; a cache that is
    dropped gives them back at once.
    """

    def __init__(
        self,
        config_or_model: PreTrainedConfig | PreTrainedModel,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        pool: KVPool | None = None,
        manual_commit: bool = False,
    ):
        model = config_or_model if isinstance(config_or_model, PreTrainedModel) else None
        config = model.config if model is not None else config_or_model
        if not isinstance(config, PreTrainedConfig):
            raise TypeError(
                f"PagedCache needs a transformers model or config, got {type(config_or_model).__name__}"
            )
        windows = attention_windows(config)  # raises NotImplementedError for unsupported models
        self.pool = _pool_for(config, model, windows, pool, block_size, num_blocks, max_memory)
        self._source = config_or_model  # what fork() builds its twin from
        self.manual_commit = manual_commit
        super().__init__(layers=[PagedLayer(self, idx, window) for idx, window in enumerate(windows)])
        # Blocks are keyed by prefix only for a model-built cache: the key's root stands for the model's weights.
        self.batch = PagedBatch(self.pool, root=prefix_root(model) if model is not None else None)
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
        batch_size, _, query_length, _ = key_states.shape
        keys, values = self.pool.layer(layer_idx, key_states, value_states)
        layer.is_initialized = True
        step = self.batch.step
        if step is not None and layer.length == step.length:
            self._drop_unfinished()  # this layer already did the step in progress: a new forward began
            step = None
        if step is None:
            step = self.batch.begin(layer.length, batch_size, query_length, key_states.device, len(self.layers))
        elif layer.length != step.past_length:
            raise RuntimeError(
                f"layer {layer_idx} has seen {layer.length} positions but the forward in progress runs from "
                f"{step.past_length}: every layer of the model must update the cache once per forward"
            )
        if (batch_size, query_length) != (step.batch_size, step.query_length):
            raise ValueError(
                f"layer {layer_idx} got {batch_size} rows x {query_length} tokens but this forward began with "
                f"{step.batch_size} x {step.query_length}"
            )
        needs_grad = _needs_grad(key_states, value_states, step.past_length)
        attention_kwargs = kwargs.get("kwargs")  # the dict transformers also hands the attention function
        from_pool = step.from_pool and isinstance(attention_kwargs, dict) and not needs_grad
        index = self.batch.index(self.pool.group_of[layer_idx], key_states.device)
        offset = layer.window_offset()  # before this step's tokens count, as `get_mask_sizes` saw it
        with self.pool.storage_lock.shared():  # another thread's step may grow the pool's tensors in place
            write_new_tokens(keys, key_states, index)
            write_new_tokens(values, value_states, index)
            if needs_grad:
                result = key_states, value_states  # an empty cache returns the new K/V itself, as DynamicCache
            elif from_pool:
                # paged_sdpa reads each row's real keys from the pool; what update returns goes unused
                attention_kwargs[PAGED_INPUTS] = PagedAttentionInputs(
                    keys.view(-1, keys.shape[-1]), values.view(-1, values.shape[-1]), keys.shape[1],
                    index.row_keys(offset, keys.shape[1]), index.queries(),
                    layer.sliding_window, self.pool.storage_lock,
                    (key_states, value_states) if index.new_from_states else None,
                    index.decode_keys(offset, keys.shape[1], layer.sliding_window),
                )
                result = key_states, value_states
            else:
                rows = index.read_rows(offset, keys.shape[1])  # [B, H, kv], keys and values alike
                result = gather(keys, rows), gather(values, rows)  # copies: safe once the lock is let go
                if index.new_from_states:  # a sliding window stores only the step's last tokens: new K/V as given
                    result = torch.cat([result[0], key_states], dim=2), torch.cat([result[1], value_states], dim=2)
        layer.length = step.length
        step.layers_done += 1
        if step.complete and not (step.commit_at_end or self.manual_commit):
            self.batch.commit()  # no forward hook will report the end: keep the step now
        return result

    def forward_ended(self, failed: bool) -> None:
        """Called by the model's forward hook when a forward on this cache ends.

        Keeps the step it made (unless `manual_commit`: then it waits for `commit()`), or rolls it back when
        the forward raised anywhere, its LM head included.
        """
        step = self.batch.step
        if step is None:
            self.batch.pending.clear()  # the forward raised before its first layer
        elif failed or not step.complete:
            self.settle()
        elif step.commit_at_end and not self.manual_commit:
            self.batch.commit()

    def commit(self) -> None:
        """Keep the step of the last forward (with `manual_commit`; other caches commit by themselves).

        Nothing to do when no step is pending. Raises `RuntimeError` if the last forward did not finish.
        """
        step = self.batch.step
        if step is None:
            return
        if not step.complete:
            raise RuntimeError("the last forward on this cache did not finish: settle() it instead of commit()")
        self.batch.commit()

    def settle(self) -> None:
        """Roll back the step not committed, if any: one that a failed forward left unfinished or, with
        `manual_commit`, a complete one awaiting `commit()`. Nothing otherwise.

        Failed forwards are rolled back by themselves; call this to drop a pending step (`manual_commit`).
        """
        with self.batch.lock:
            if self.batch.step is not None:
                length = self.batch.rollback()
                for layer in self.layers:
                    layer.length = length

    def _drop_unfinished(self) -> None:
        """Before a change: roll back a step left over by a failed forward; refuse to drop a pending one."""
        step = self.batch.step
        if step is not None and step.complete and self.manual_commit:
            raise RuntimeError(
                "this cache's last forward awaits commit() or settle() (manual_commit=True): call one of them "
                "before changing the cache or running the next forward"
            )
        self.settle()

    def _settle_failed_here(self) -> None:
        """Before a read: on the thread whose forward failed without its hook seeing it (``KeyboardInterrupt``,
        or a model without the hook), roll that step back. Reads on other threads change nothing."""
        step = self.batch.step
        if step is not None and step.thread == threading.get_ident() and not (self.manual_commit and step.complete):
            self.settle()

    def _committed_length(self) -> int:
        """Positions the last committed step left (call under `batch.lock`)."""
        step = self.batch.step
        return step.past_length if step is not None else self.layers[0].length

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
        keys and values straight from the pool (no dense copy). A step left unfinished by a failed forward
        is rolled back. `hooked` (set by the model's pre-hook) means its forward hook will call `forward_ended`.
        """
        self._drop_unfinished()
        self.batch.pending.observe(input_ids, attention_mask, query_length, position_ids, attention, hooked)

    # ------------------------------------------------------------------ the Cache contract

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Positions the cache holds (padding included), as its last committed step left them."""
        if layer_idx >= len(self.layers):
            return 0
        self._settle_failed_here()
        with self.batch.lock:
            return self._committed_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if layer_idx >= len(self.layers):
            return query_length, 0
        self._settle_failed_here()
        with self.batch.lock:
            return self.layers[layer_idx].get_mask_sizes(query_length, self._committed_length())

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
        self._drop_unfinished()
        with self.batch.lock:
            length = self._committed_length()
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
        self._drop_unfinished()
        self.batch.select(indices)

    def add_rows_from(self, other: PagedCache) -> None:
        """Move `other`'s sequences (a cache on the same pool) into this one, after its own rows; `other` is left empty.

        No key or value is copied: the rows' blocks change hands. The shorter side is left-padded (padding
        takes no blocks), so feed the next forward an ``attention_mask`` of ``[cache.is_real, new tokens]``
        and each row's own ``position_ids``. A continuous batcher adds each newly prefilled request to the
        running batch this way.
        """
        if other.pool is not self.pool or other.batch.tables.root != self.batch.tables.root:
            raise ValueError("add_rows_from() needs a cache on the same pool, built from the same model")
        self._drop_unfinished()
        other._drop_unfinished()
        if not other.batch_size:
            return
        with self.batch.lock:
            length = self.batch.absorb(other.batch)
            initialized = any(layer.is_initialized for layer in (*self.layers, *other.layers))
            other.reset()
            for layer in self.layers:
                layer.length, layer.is_initialized = length, initialized

    def drop_leading_padding(self) -> int:
        """Forget the first positions that are padding in every row (after rows left); returns how many."""
        self._drop_unfinished()
        with self.batch.lock:
            drop = self.batch.drop_leading_padding()
            for layer in self.layers:
                layer.length -= drop
        return drop

    def reset(self) -> None:
        """Give every block back to the pool and empty the cache; it stays usable."""
        with self.batch.lock:
            self.batch.reset()  # an unfinished step's blocks are released with the rest
            for layer in self.layers:
                layer.reset()

    def release(self) -> None:
        """Give every block back (`reset()`); what leaving ``with PagedCache(...) as cache:`` does."""
        self.reset()

    def fork(self) -> PagedCache:
        """A new cache on the same pool holding the same sequences, sharing every block (copy-on-write).

        Prefill a long system prompt once, then fork it for each request instead of `copy.deepcopy`: the
        fork costs no K/V copy, and each side copies at most its partly filled last block when it writes.
        """
        self._drop_unfinished()
        twin = PagedCache(self._source, pool=self.pool, manual_commit=self.manual_commit)
        with self.batch.lock:
            self.batch.copy_to(twin.batch)
            for mine, theirs in zip(twin.layers, self.layers):
                mine.length, mine.is_initialized = theirs.length, theirs.is_initialized
        return twin

    def __deepcopy__(self, memo: dict) -> PagedCache:
        """`copy.deepcopy(cache)` (the usual way to reuse a prefilled cache) forks instead of copying the pool."""
        return self.fork()

    def __copy__(self) -> PagedCache:
        """`copy.copy(cache)` forks too: a shallow copy would share block tables that either side could free."""
        return self.fork()

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError(
            "a PagedCache cannot be pickled or torch.save()d: its keys and values live in a block pool shared "
            "with other caches. Save the token ids instead and prefill them again (or take them from a pool "
            "with reuse_prefix()); for a portable copy of the tensors, save cache.layers[i].keys / .values"
        )

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
        _check_token_rows(input_ids)
        if self.batch.tables.root is None:
            raise ValueError(
                "reuse_prefix() needs a cache built from the model (PagedCache(model)): cached blocks are keyed by "
                "the model that computed them, which a config-built cache does not know"
            )
        self._drop_unfinished()
        if self.batch_size or self.get_seq_length():
            raise ValueError("reuse_prefix() needs an empty cache; call reset() first")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("reuse_prefix() needs unpadded rows: a padded prompt's blocks are not position-aligned")
        with self.batch.lock:
            length = self.batch.adopt_prefix(input_ids.tolist(), input_ids.device)
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
        """Rows (sequences) the cache holds, as its last committed step left them."""
        with self.batch.lock:
            return self.batch.committed()[0][0].batch_size

    @property
    def block_tables(self) -> RowsView:
        """A snapshot of each row's blocks (first layer group) and stored tokens, as last committed."""
        self._settle_failed_here()
        with self.batch.lock:
            return self.batch.committed()[0][0].copy()

    @property
    def is_real(self) -> torch.Tensor:
        """``[B, L]`` bool: False where a logical position is padding (stored nowhere), as last committed."""
        with self.batch.lock:
            return self.batch.committed()[1]

    def stats(self) -> CacheStats:
        """Blocks, tokens and bytes this cache holds, in total and per layer group, as last committed."""
        self._settle_failed_here()
        with self.batch.lock:
            return CacheStats.of(self.batch.committed()[0], self.pool)

    def dense_view(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer_idx`'s keys and values as `DynamicCache` holds them: dense ``[B, H, length, D]`` copies.

        A sliding layer gives its last ``sliding_window - 1`` positions; padding positions read zeros.
        """
        self._settle_failed_here()
        with self.batch.lock:  # held while gathering: a commit may free blocks the last committed step holds
            offset = self.layers[layer_idx].window_offset(self._committed_length())
            return self.batch.dense(layer_idx, offset)

    def __repr__(self) -> str:
        self._settle_failed_here()
        with self.batch.lock:
            views = self.batch.committed()[0]
            blocks = [len(view.unique_blocks()) for view in views]
            length = self._committed_length()
        return (
            f"PagedCache(rows={views[0].batch_size}, length={length}, "
            f"blocks={blocks[0] if len(blocks) == 1 else blocks}, pool={self.pool!r})"
        )


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


def _check_token_rows(input_ids: object) -> None:
    """`reuse_prefix`'s argument must be a non-empty 2-D integer tensor."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.is_floating_point():
        raise TypeError(
            "reuse_prefix() takes input_ids as a 2-D integer tensor [batch, tokens], got "
            + (f"a {input_ids.ndim}-D {input_ids.dtype} tensor" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        )
    if input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(
            f"reuse_prefix() needs at least one row of at least one token, got shape {tuple(input_ids.shape)}"
        )


def _pool_for(
    config: PreTrainedConfig,
    model: PreTrainedModel | None,
    windows: list[int | None],
    pool: KVPool | None,
    block_size: int,
    num_blocks: int | None,
    max_memory: int | str | None,
) -> KVPool:
    """The given `pool`, checked against the model's layers, or a new one of the requested size."""
    if pool is None:
        dtype = _model_dtype(model, config)
        layout = KVLayout.from_model(model) if model is not None else None  # tensor-parallel ranks: their heads
        return KVPool.for_config(
            config, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory, dtype=dtype, layout=layout
        )
    if num_blocks is not None or max_memory is not None:
        raise ValueError("pass either pool= or a size (num_blocks= / max_memory=), not both")
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

