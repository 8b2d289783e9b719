"""`BlockSharing`: the ways a `PagedCache` shares its blocks with other caches instead of copying keys and values."""

from __future__ import annotations

from typing import Any

import torch

from ..pool.kv_pool import KVPool
from .batch import PagedBatch
from .forward_lifecycle import ForwardLifecycle
from .layer import PagedLayer


class BlockSharing:
    """`PagedCache`'s sharing: rows that change hands (`add_rows_from`), forks that share every block
    (`fork`, ``copy.copy``, ``copy.deepcopy``), and prefixes taken from the pool (`reuse_prefix`). No key or
    value is copied: blocks are held once more (reference counts), and written only after a copy-on-write.
    """

    pool: KVPool
    batch: PagedBatch
    lifecycle: ForwardLifecycle
    layers: list[PagedLayer]
    _source: Any  # the model or config a twin is built from

    def add_rows_from(self, other: BlockSharing) -> None:
        """Move `other`'s sequences (a cache on the same pool) into this one, after its own rows; `other` is left empty.

        No key or value is copied: the rows' blocks change hands. The shorter side is left-padded (padding
        takes no blocks), so feed the next forward an ``attention_mask`` of ``[cache.is_real, new tokens]``
        and each row's own ``position_ids``. A continuous batcher adds each newly prefilled request to the
        running batch this way.
        """
        if other.pool is not self.pool or other.batch.tables.root != self.batch.tables.root:
            raise ValueError("add_rows_from() needs a cache on the same pool, built from the same model")
        self.lifecycle.drop_unfinished()
        other.lifecycle.drop_unfinished()
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
        self.lifecycle.drop_unfinished()
        with self.batch.lock:
            drop = self.batch.drop_leading_padding()
            for layer in self.layers:
                layer.length -= drop
        return drop

    def fork(self) -> BlockSharing:
        """A new cache on the same pool holding the same sequences, sharing every block (copy-on-write).

        Prefill a long system prompt once, then fork it for each request instead of `copy.deepcopy`: the
        fork costs no K/V copy, and each side copies at most its partly filled last block when it writes.
        """
        self.lifecycle.drop_unfinished()
        twin = type(self).for_decoder(self._source, pool=self.pool, manual_commit=self.lifecycle.manual_commit,
                                      batch_invariant=self.batch_invariant)
        with self.batch.lock:
            self.batch.copy_to(twin.batch)
            for mine, theirs in zip(twin.layers, self.layers):
                mine.length, mine.is_initialized = theirs.length, theirs.is_initialized
        return twin

    def empty_like(self) -> BlockSharing:
        """A new empty cache on the same pool, committing as this one does (a batcher's cache for one request)."""
        return type(self).for_decoder(self._source, pool=self.pool, manual_commit=self.lifecycle.manual_commit,
                                      batch_invariant=self.batch_invariant)

    def __deepcopy__(self, memo: dict) -> BlockSharing:
        """`copy.deepcopy(cache)` (the usual way to reuse a prefilled cache) forks instead of copying the pool."""
        return self.fork()

    def __copy__(self) -> BlockSharing:
        """`copy.copy(cache)` forks too: a shallow copy would share block tables that either side could free."""
        return self.fork()

    def __reduce_ex__(self, protocol: object) -> object:
        raise TypeError(
            "a PagedCache cannot be pickled or torch.save()d: its keys and values live in a block pool shared "
            "with other caches. Save the token ids instead and prefill them again (or take them from a pool "
            "with reuse_prefix()); for a portable copy of the tensors, save cache.layers[i].keys / .values"
        )

    def key_next_forward(self, key_ids: torch.Tensor) -> None:
        """Key the blocks the next forward fills by `key_ids` ``[B, q]`` instead of its token ids: for a forward
        whose rows read more than their tokens, ids that stand for all they read (an image's placeholders
        replaced by ids from a digest of the image: `engine.media`). Pass the same ids to `reuse_prefix`."""
        self.lifecycle.pending.next_keys = key_ids

    def reuse_prefix(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> int:
        """Fill this empty cache with the longest prefix of `input_ids` already cached in the pool.

        Full blocks that earlier caches on this pool wrote (and registered by their token ids) are shared,
        not recomputed; `generate(input_ids, cache=cache)` then computes only the remaining tokens.
        Rows must not be padded. Returns the number of positions reused (a multiple of `block_size`, the
        same for every row, always leaving at least one token to compute). On a model with conv / recurrent
        states the prefix must also end where a cache on this pool kept a snapshot of its states: at a block
        boundary where one of its forwards ended (a decode step that filled a block, a prompt or chunk of whole
        blocks).

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
        self.lifecycle.drop_unfinished()
        if self.batch_size or self.get_seq_length():
            raise ValueError("reuse_prefix() needs an empty cache; call reset() first")
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("reuse_prefix() needs unpadded rows: a padded prompt's blocks are not position-aligned")
        with self.batch.lock:
            length = self.batch.adopt_prefix(input_ids.tolist(), input_ids.device)
            for layer in self.layers:
                layer.length = length
        return length


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
