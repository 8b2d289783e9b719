"""`PagedCrossAttentionCache`: an encoder-decoder model's cross-attention keys and values, once per request.

The decoder's cross-attention layers attend to keys and values computed once from the encoder's output, at the
first decoder forward (transformers' models then read them back each step: ``cache.layers[i].keys``). Beams
and samples of one request all attend to the same ones: generate repeats each encoder row for them before that
forward. So this cache keeps each *distinct* encoder row's keys and values once, in blocks of a pool of its own
(`sources`: a request's blocks), and each row of the batch names the source it reads (`rows`). Reordering,
selecting and repeating rows (beam search) changes only those names, never the stored keys and values; a source
goes back to the pool when no row reads it any more.

What attention reads is a dense ``[B, heads, S, dim]`` tensor per layer (`CrossLayer.keys`). When the sources'
blocks are one run in order (a fresh pool), the sources are a view of the pool's storage: rows that read one
source each read that view (no copy: greedy and sampled generation), and rows that share sources (beams,
samples) read a copy selected from it for that read and dropped after it, so that the only lasting copy is the
pool's, one per request. (`DynamicCache` keeps a copy per beam and copies them all again at every reorder: the
same one selection a step.) Blocks out of order are gathered for each read.

A continuous batcher's running cache gathers rows from many requests (`add_rows_from`), whose encoder inputs
may differ in length: each source keeps its own length, the dense read is as long as the longest (a shorter
source's positions past its end read the null block's zeros) and `encoder_mask` says which positions are real.
Built with ``keep_reads=True`` (a batcher's running cache), its reads are kept dense between steps and follow
the rows as they join and leave by moving rows (`RunningReads`), instead of gathering every layer at every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import PoolExhaustedError
from ..pool.kv_pool import KVPool
from .layer_io import gather
from .running_reads import RunningReads


class CrossLayer(CacheLayerMixin):
    """One decoder layer's cross-attention keys and values, as the model reads them (``keys``, ``values``)."""

    is_sliding = False

    def __init__(self, cache: PagedCrossAttentionCache, layer_idx: int):
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx

    @property
    def keys(self) -> torch.Tensor | None:  # [B, heads, S, dim]
        return self.cache.dense(self.layer_idx, 0)

    @keys.setter
    def keys(self, value: object) -> None:  # CacheLayerMixin's constructor sets them; they live in the pool
        pass

    @property
    def values(self) -> torch.Tensor | None:  # [B, heads, S, dim]
        return self.cache.dense(self.layer_idx, 1)

    @values.setter
    def values(self, value: object) -> None:
        pass

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        return self.cache.update(key_states, value_states, self.layer_idx)

    def get_seq_length(self) -> int:
        return self.cache.encoder_length if self.layer_idx in self.cache.written else 0

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.encoder_length, 0


class PagedCrossAttentionCache(Cache):
    """Cross-attention keys and values in blocks of `pool`, one copy per distinct encoder row (see the module
    docstring). `pool` holds the decoder's cross-attention layers (`KVLayout` of their shapes)."""

    def __init__(self, pool: KVPool, *, keep_reads: bool = False):
        self.pool = pool
        self.sources: list[list[int]] = []  # per distinct encoder row: its blocks (held once)
        self.lengths: list[int] = []  # per source: its encoder positions
        self.tags: list[object] = []  # per source: an object that names it while it lives (`RunningReads`)
        self.rows: list[int] = []  # per row of the batch: the source it reads
        self.written: set[int] = set()  # layers whose keys and values are stored
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # (layer, keys 0 / values 1) -> a view of the pool
        self._running = RunningReads() if keep_reads else None  # the rows' reads, kept between steps
        super().__init__(layers=[CrossLayer(self, i) for i in range(pool.layout.num_layers)])

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    @property
    def keep_reads(self) -> bool:
        """Whether reads are kept dense between steps, following the rows (`RunningReads`)."""
        return self._running is not None

    @keep_reads.setter
    def keep_reads(self, keep: bool) -> None:
        self._running = RunningReads() if keep else None

    @property
    def encoder_length(self) -> int:
        """S: the positions a dense read has, the longest source's (0 when empty)."""
        return max(self.lengths, default=0)

    def encoder_mask(self, device: torch.device | None = None) -> torch.Tensor:
        """``[B, S]`` 1 where row ``b``'s source has position ``s``, 0 past its end (the encoder's attention mask
        for a forward on this cache's rows)."""
        lengths = torch.tensor([self.lengths[source] for source in self.rows], device=device)  # [B]
        return (torch.arange(self.encoder_length, device=device) < lengths.unsqueeze(1)).long()  # [B, S]

    # ------------------------------------------------------------------ the first decoder forward

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store layer `layer_idx`'s keys and values ``[B, heads, S, dim]`` (its rows' distinct sources once) and
        return them as given."""
        keys, values = self.pool.layer(layer_idx, key_states, value_states)
        if not self.rows:
            self._add_sources(key_states, value_states)
        elif (key_states.shape[0], key_states.shape[2]) != (self.batch_size, self.encoder_length) or (
            len(set(self.lengths)) > 1
        ):
            raise ValueError(
                f"cross-attention layer {layer_idx} got {key_states.shape[0]} rows of {key_states.shape[2]} encoder "
                f"positions, but this cache holds {self.batch_size} rows of {self.encoder_length}: reset() it first"
            )
        first = [self.rows.index(source) for source in range(len(self.sources))]  # a row of each source
        slots = self._slots(range(len(self.sources)), key_states.device)  # [sources * S]
        heads = key_states.shape[1]
        with self.pool.storage_lock.shared():
            for storage, states in ((keys, key_states), (values, value_states)):
                rows = states[first].transpose(0, 1).reshape(heads, len(first) * self.encoder_length, -1)  # [H, N, D]
                storage.write(slots, rows)
        self.written.add(layer_idx)
        self._views = {key: tensor for key, tensor in self._views.items() if key[0] != layer_idx}
        if self._running is not None:
            self._running.clear()  # the sources' keys and values were written again
        return key_states, value_states

    def _add_sources(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Give each distinct row of the first layer's keys and values ``[B, heads, S, dim]`` (generate repeats a
        request's encoder row for its beams and samples) the blocks of one source, all or nothing."""
        batch_size, length = key_states.shape[0], key_states.shape[2]
        flat = torch.cat([key_states.reshape(batch_size, -1), value_states.reshape(batch_size, -1)], dim=1)  # [B, n]
        probe = flat[:, :64]  # compared first: rows of different requests differ there already
        sources: list[int] = []
        distinct: list[int] = []  # a row of each source
        for row in range(batch_size):
            match = next((s for s, first in enumerate(distinct)
                          if torch.equal(probe[row], probe[first]) and torch.equal(flat[row], flat[first])), None)
            if match is None:
                match = len(distinct)
                distinct.append(row)
            sources.append(match)
        per_source = -(-length // self.pool.block_size)
        blocks = self.pool.blocks.allocate(per_source * len(distinct))
        if blocks is None:
            raise PoolExhaustedError(per_source * len(distinct), self.pool.blocks.num_free, self.pool.blocks.capacity,
                                     self.pool.block_size, "cross attention")
        self.sources = [blocks[i * per_source : (i + 1) * per_source] for i in range(len(distinct))]
        self.rows, self.lengths = sources, [length] * len(distinct)
        self.tags = [object() for _ in distinct]

    # ------------------------------------------------------------------ what attention reads

    def dense(self, layer_idx: int, which: int) -> torch.Tensor | None:
        """``[B, heads, S, dim]`` the rows' keys (`which` 0) or values (1) of layer `layer_idx`, None before any
        forward stored them."""
        if layer_idx not in self.written:
            return None
        if self._running is not None:
            storage = self.pool.stored(layer_idx)[which]
            return self._running.read(layer_idx, which, [self.tags[source] for source in self.rows],
                                      self.encoder_length, lambda tag: self._fetch(storage, tag))
        return self._read(layer_idx, which)

    def _fetch(self, storage: Any, tag: object) -> torch.Tensor:
        """``[heads, S_source, dim]`` the source named `tag`, gathered from `storage`."""
        source = next(s for s, own in enumerate(self.tags) if own is tag)
        slots = self._slots([source], storage.data.device)[: self.lengths[source]]
        with self.pool.storage_lock.shared():
            return gather(storage, slots, 1)[0]

    def _read(self, layer_idx: int, which: int) -> torch.Tensor:
        """`dense`'s read, made anew."""
        sources = self._views.get((layer_idx, which))
        if sources is None:
            storage = self.pool.stored(layer_idx)[which]
            sources = self._view(storage.plain) if storage.plain is not None else None
            if sources is None:  # blocks out of order, lengths that differ, or a scaled format: gathered
                device = storage.plain.device if storage.plain is not None else None
                with self.pool.storage_lock.shared():
                    return gather(storage, self._slots(self.rows, device), self.batch_size)  # [B, heads, S, dim]
            self._views[(layer_idx, which)] = sources  # a view: kept, it costs nothing
        if self.rows == list(range(len(self.sources))):
            return sources
        rows = torch.tensor(self.rows, device=sources.device)
        return sources.index_select(0, rows)  # [B, heads, S, dim]: this read's own copy (beams, samples)

    def _view(self, stored: torch.Tensor) -> torch.Tensor | None:
        """The sources' ``[sources, heads, S, dim]`` as a view of `stored` ``[heads, slots, dim]`` when their
        blocks are one run in order, else None."""
        size, length = self.pool.block_size, self.encoder_length
        blocks = [block for source in self.sources for block in source]
        if len(set(self.lengths)) > 1 or blocks != list(range(blocks[0], blocks[0] + len(blocks))):
            return None
        per_source = len(self.sources[0]) * size
        start = blocks[0] * size
        heads, _, dim = stored.shape
        run = stored[:, start : start + per_source * len(self.sources)]  # [H, sources * S_pad, D]
        return run.view(heads, len(self.sources), per_source, dim).transpose(0, 1)[:, :, :length]

    def _slots(self, sources: Sequence[int], device: torch.device | None) -> torch.Tensor:
        """``[len(sources) * S]`` the slots of each source's positions, source after source; a source shorter than
        S reads slot 0 (the null block's zeros) past its end."""
        size, length = self.pool.block_size, self.encoder_length
        slots = torch.zeros(len(sources), length, dtype=torch.long)  # [n, S]
        for row, source in enumerate(sources):
            blocks = torch.tensor(self.sources[source], dtype=torch.long)  # [blocks of the source]
            own = (blocks.unsqueeze(-1) * size + torch.arange(size)).flatten()[: self.lengths[source]]
            slots[row, : len(own)] = own
        return slots.flatten().to(device)

    # ------------------------------------------------------------------ rows

    def batch_select_indices(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep rows `indices` (repeats allowed, any order): only the names of their sources change."""
        rows = torch.as_tensor(indices, dtype=torch.long).tolist()
        self._keep([self.rows[r] for r in rows])

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._keep([source for source in self.rows for _ in range(repeats)])

    def _keep(self, rows: list[int]) -> None:
        """Make `rows` (source per row) the rows; give back the sources no row reads any more."""
        if rows != self.rows:
            self._views = {}
        kept = sorted(set(rows))
        for source, blocks in enumerate(self.sources):
            if source not in kept:
                self.pool.blocks.free(reversed(blocks))
        self.sources = [self.sources[s] for s in kept]
        self.lengths = [self.lengths[s] for s in kept]
        self.tags = [self.tags[s] for s in kept]
        self.rows = [kept.index(s) for s in rows]

    def add_rows_from(self, other: PagedCrossAttentionCache) -> None:
        """Move `other`'s rows (a cache on the same pool) in after this one's: its sources change hands, no key or
        value is copied; `other` is left empty."""
        if other.pool is not self.pool:
            raise ValueError("add_rows_from() needs a cross-attention cache on the same pool")
        offset = len(self.sources)
        self.sources += other.sources
        self.lengths += other.lengths
        self.tags += other.tags
        self.rows += [offset + source for source in other.rows]
        self.written |= other.written
        self._views = {}
        other.sources, other.lengths, other.tags, other.rows, other.written = [], [], [], [], set()
        other._views = {}

    def fork(self) -> PagedCrossAttentionCache:
        """A new cache on the same pool with the same rows, sharing every source's blocks (no copy)."""
        twin = PagedCrossAttentionCache(self.pool, keep_reads=self.keep_reads)
        for blocks in self.sources:
            self.pool.blocks.incref(blocks)
        twin.sources = [list(blocks) for blocks in self.sources]
        twin.rows, twin.lengths, twin.written = list(self.rows), list(self.lengths), set(self.written)
        twin.tags = list(self.tags)
        return twin

    def __deepcopy__(self, memo: dict) -> PagedCrossAttentionCache:
        """`copy.deepcopy(cache)` forks: the keys and values stay in the pool, shared."""
        return self.fork()

    def __copy__(self) -> PagedCrossAttentionCache:
        return self.fork()

    def reset(self) -> None:
        """Give every source back and forget the rows."""
        self._keep([])
        self.written = set()
        if self._running is not None:
            self._running.clear()

    release = reset

    def nbytes(self) -> int:
        """Bytes this cache holds: its sources' blocks (what attention reads is a view of them, or a copy made
        for one read)."""
        return sum(map(len, self.sources)) * self.pool.bytes_per_block

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()

    def __repr__(self) -> str:
        return (f"PagedCrossAttentionCache(rows={self.batch_size}, sources={len(self.sources)}, "
                f"encoder_length={self.encoder_length}, blocks={sum(map(len, self.sources))})")
