"""The shared memory of paged caches: block ids (`BlockPool`) plus the per-layer tensors they index.

Layer groups
------------
Layers that keep the same span of tokens form a group (`memory.LayerGroup`): full attention keeps every
token, a sliding window only the last ones. Each group has its own `BlockPool` (``pool.groups[g]``) and its
layers' tensors hold that pool's blocks only, so a sliding group that gives its old blocks back really
holds less memory. Most models have one group; ``pool.blocks`` is the first one's (full attention when the
model has any).

Fixed and elastic pools
-----------------------
A pool sized by ``num_blocks=`` or ``max_memory=`` is fixed: its tensors hold that many blocks and a step
that needs more raises `PoolExhaustedError`, changing nothing. A pool given neither is *elastic*
(``max_blocks=None``): it starts at one full context of the model, at most `ELASTIC_START_TOKENS` tokens, and
grows when a step needs more blocks than are free, doubling (at least) each time, without a cap but the
memory of the device. Block ids stay valid across growth, and so do the keys and values they hold.

Growth and threads: the protocol
--------------------------------
A layer's tensors are created once, on its first `layer()` call, and are never replaced: growing the pool
moves them *in place* onto a larger storage (a new allocation, every head's slots copied into it, then
``Tensor.set_``). So the tensors `layer()` returns stay that layer's storage for the pool's whole life, and
cover every block id handed out, before or after growth.

Growth happens inside `BlockPool.allocate` (when a step takes blocks), through the pool's ``on_grow`` hook,
before the new ids exist: every existing layer tensor is resized under ``storage_lock.exclusive()``, then the
id space grows. Resizing frees the old memory, so nobody may touch the tensors meanwhile. Hence, for callers
that read or write a layer's tensors (`PagedCache`):

1. Hold ``pool.storage_lock.shared()`` for as long as you read or write a layer's tensors (writing the new
   keys/values, gathering K/V, attending from views): `PagedCache.update`, `dense_layer` and
   `attend_from_pool` do. Call `layer()` (which may create the layer's tensors, under `exclusive()`) before
   entering `shared()`. Results of a gather (``index_select``) are copies, safe to use after the block;
   views are not.
2. Do not take blocks (`BlockTables.append`, `take_group_blocks`, `BlockPool.allocate`) and do not call `layer()`
   for a layer without storage while holding `shared()`: both may need `exclusive()`, and the lock refuses
   that upgrade with a `RuntimeError` (rather than deadlock). Taking blocks before or after calling
   `layer()` is equally fine: the tensors grow in place.
3. `copy_blocks` takes `shared()` itself (the lock is reentrant for holders of `shared()`).

Single-threaded use needs no lock at all (the tensors are grown in place), but taking it costs little.

Out of memory: creating or growing storage that the device cannot allocate raises `KVMemoryError` (a
`MemoryError`) naming the bytes. Growth fails inside `allocate`, before any block is taken or any tensor
written: the pool keeps its size (layers already resized keep their larger, unused storage) and the caller's
step changes nothing, as with `PoolExhaustedError`. Creating a layer's storage (its first forward) fails in
`layer()`, in the middle of that forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from transformers import PreTrainedConfig

from ..errors import KVMemoryError
from .block_pool import FIXED, BlockPool, as_count
from .kv_format import StoredStates, kv_format
from .layer_storage import LayerStorage
from .locks import SharedExclusiveLock
from .memory import (
    KVLayout,
    blocks_for_budget,
    bytes_per_block,
    check_fits_machine,
    exceeds_machine,
    format_memory,
    parse_memory,
)
from .state_slots import StateSlots

ELASTIC_START_TOKENS = 4096
"""An elastic pool starts with one full context of the model, but at most this many tokens (then grows)."""

DEFAULT_MAX_SEQUENCES = 64
"""The state slots a `max_memory` budget sets aside for a model with conv / recurrent states, unless told."""


def budget_after_states(max_memory: int | str, slots: int, state_bytes: int | None, model_type: str) -> int:
    """What is left of `max_memory` for blocks once `slots` state slots of `state_bytes` each (and the null slot,
    as the null block is counted among the blocks) are set aside."""
    if state_bytes is None:
        raise ValueError(
            f"a max_memory budget for {model_type!r}, whose layers keep conv / recurrent states, needs the bytes of "
            "one sequence's states: build the cache from the model (PagedCache(model, max_memory=...)), which "
            "measures them, or pass state_bytes="
        )
    budget, states = parse_memory(max_memory), (slots + 1) * state_bytes
    if budget <= states:
        raise ValueError(
            f"max_memory={max_memory!r} ({budget:,} bytes) does not hold the states of max_sequences={slots} "
            f"sequences (({slots} + 1 null slot) x {state_bytes:,} bytes = {states:,}), let alone their blocks: "
            "give more memory or fewer sequences"
        )
    return budget - states


class KVPool:
    """Key and value storage for every layer of one model, addressed by block id.

    Per attention layer (`storage`, a `LayerStorage`), keys are stored head-major as
    ``[num_kv_heads, num_blocks * block_size, key_dim]``
    (values likewise), addressed by slot id (``block * block_size + offset``) along dim 1: a run of
    consecutive blocks is, for each head, one contiguous stretch of memory, so attention reads it as an
    ``[H, n, D]`` view as fast as `DynamicCache`'s own tensors, and a gather by slot ids
    (``index_select(1, slots)``) yields ``[H, tokens, D]`` with no per-head strides to undo.

    Keys and values are stored in `kv_format` (`kv_dtype`: by default the model's `dtype` itself; ``"int8"``,
    ``"float8_e4m3fn"`` with their scales per token and head, or another float type; see `pool.kv_format`),
    and read back in `dtype`. An 8-bit format also keeps ``[heads, num_blocks * block_size, G, P]`` scales per
    layer (`key_scales`, `value_scales`, shaped by `KVFormat.scale_shape`; None otherwise), which grow, copy
    and count with their tensors.

    A layer's tensors are created on the device of the first key states it stores, so
    a model spread over several devices keeps each layer's cache beside that layer. Several `PagedCache`
    objects can share one pool; they share its blocks through reference counts in `blocks`.

    Each layer group (`layout.groups`) has its own `BlockPool` in `groups`, and a layer's tensors hold its
    group's blocks. `num_blocks` sizes every group alike (an int), or each group (a sequence, one per group).
    `max_blocks` (as for `BlockPool`): by default each group is fixed at its `num_blocks`; None makes them
    elastic (they grow as needed, see the module docstring for growth and the `storage_lock` protocol). A
    pool larger than this machine's memory (RAM plus accelerators) is refused with `ValueError`.

    A model with linear-attention, SSM or conv layers keeps each sequence's conv and recurrent states in
    `states` (`StateSlots`): elastic, or fixed at `state_slots` sequences.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_blocks: int | Sequence[int],
        block_size: int = 16,
        dtype: torch.dtype,
        max_blocks: int | None = FIXED,
        kv_dtype: str | torch.dtype | None = None,
        state_slots: int | None = None,
    ):
        self.layout = layout
        self.dtype = dtype  # what the model computes and reads back
        self.kv_format = kv_format(kv_dtype, dtype)  # how keys and values are stored
        self.storage_lock = SharedExclusiveLock()
        self.layer_groups = layout.groups
        self.group_of = layout.group_of()  # each layer's index in `groups`
        sizes = [num_blocks] * len(self.layer_groups) if not isinstance(num_blocks, Sequence) else list(num_blocks)
        if len(sizes) != len(self.layer_groups):
            raise ValueError(f"num_blocks gives {len(sizes)} sizes for {len(self.layer_groups)} layer groups")
        self.groups = tuple(
            BlockPool(size, block_size, max_blocks=max_blocks, on_grow=_grow_hook(self, g))
            for g, size in enumerate(sizes)
        )
        cap = self.groups[0].max_blocks
        asked = f"num_blocks={num_blocks}" if cap in (None, self.groups[0].num_blocks) else f"max_blocks={cap}"
        sizes = [b.num_blocks if cap is None else cap for b in self.groups]
        check_fits_machine(self._bytes_for(sizes), asked, f": {sizes[0]:,} blocks x {self.bytes_per_block:,} bytes"
                           if len(set(sizes)) == 1 else f": {sizes} blocks per layer group")
        self.storage = LayerStorage(layout, block_size, self.kv_format, dtype)  # every layer's tensors
        # the storage's own per-layer lists (None until a layer's first forward), kept in place as layers are made
        self.keys, self.values = self.storage.keys, self.storage.values
        self.key_scales, self.value_scales = self.storage.key_scales, self.storage.value_scales  # scaled formats only
        self._storage_blocks = [b.num_blocks for b in self.groups]  # blocks each group's tensors hold (or will)
        # per-sequence conv and recurrent states of linear-attention / SSM / conv layers (empty for other models):
        # elastic, or fixed at `state_slots` sequences
        self.states = StateSlots(self.storage_lock, state_slots)

    @classmethod
    def for_config(
        cls,
        config: PreTrainedConfig,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        dtype: torch.dtype = torch.float32,
        layout: KVLayout | None = None,
        kv_dtype: str | torch.dtype | None = None,
        max_sequences: int | None = None,
        state_bytes: int | None = None,
    ) -> KVPool:
        """A pool for `config`: fixed at `num_blocks` or at what a `max_memory` budget buys, else elastic.

        A model with conv / recurrent states keeps one state slot per sequence: elastic, or fixed at
        `max_sequences`. A `max_memory` budget holds the slots and the blocks together: it sets aside
        `max_sequences` slots (default `DEFAULT_MAX_SEQUENCES`) of `state_bytes` each (one sequence's states
        over every layer: `PagedCache(model, ...)` measures them) and buys blocks with the rest.

        `kv_dtype` is how keys and values are stored (see the class docstring); a budget buys blocks of that
        format. `layout` (default: the config's) gives the shapes the model really runs (`KVLayout.from_model`:
        a tensor-parallel rank holds a share of the heads).

        With neither, each group starts with what one sequence of the model's full context
        (``max_position_embeddings`` tokens, at most `ELASTIC_START_TOKENS`) holds in it, plus the null block,
        and grows as needed. A fixed pool gives every group the same number of blocks (`max_memory` buys that
        many of each). Sizes may be ints or numpy integers; `max_memory` also a string like ``"512MiB"``.
        Raises `ValueError` for a size this machine cannot hold.
        """
        block_size = as_count("block_size", block_size, 1)
        if num_blocks is not None and max_memory is not None:
            raise ValueError("pass num_blocks or max_memory, not both")
        layout = layout or KVLayout.from_config(config)
        stored = kv_format(kv_dtype, dtype)
        slots = max_sequences
        if max_memory is not None and layout.state_layers:
            slots = as_count("max_sequences", max_sequences or DEFAULT_MAX_SEQUENCES, 1)
            max_memory = budget_after_states(max_memory, slots, state_bytes, config.model_type)
            if not layout.token_layers:  # state layers only: blocks hold no bytes, so they stay elastic
                max_memory = None
        if max_memory is not None:
            num_blocks = blocks_for_budget(max_memory, layout, block_size, stored)
            per_block = bytes_per_block(layout, block_size, stored)
            check_fits_machine(
                num_blocks * per_block, f"max_memory={max_memory!r}", f": {num_blocks:,} blocks x {per_block:,} bytes"
            )
        if num_blocks is not None:
            return cls(layout, num_blocks=num_blocks, block_size=block_size, dtype=dtype, kv_dtype=kv_dtype,
                       state_slots=slots)
        context = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) or 4096
        tokens = min(context, ELASTIC_START_TOKENS)
        starts = [group.max_blocks_per_row(tokens, block_size) + 1 for group in layout.groups]
        return cls(layout, num_blocks=starts, block_size=block_size, dtype=dtype, max_blocks=None, kv_dtype=kv_dtype,
                   state_slots=slots)

    @property
    def blocks(self) -> BlockPool:
        """The first layer group's block ids (full attention when the model has any; most models have one group)."""
        return self.groups[0]

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def num_blocks(self) -> int:
        """Current size in blocks of the first group (the null block included); an elastic pool grows it."""
        return self.groups[0].num_blocks

    @property
    def max_blocks(self) -> int | None:
        """The cap on each group's `num_blocks`; None for an elastic pool."""
        return self.groups[0].max_blocks

    @property
    def is_elastic(self) -> bool:
        return self.groups[0].max_blocks is None

    @property
    def grow_count(self) -> int:
        """How many times the pool grew (all groups together)."""
        return sum(b.grow_count for b in self.groups)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block in every group: what a token costs when every group keeps it."""
        return bytes_per_block(self.layout, self.block_size, self.kv_format)

    def group_bytes_per_block(self, group: int) -> int:
        """Bytes of one block of group `group` (its layers only)."""
        return bytes_per_block(self.layout, self.block_size, self.kv_format, self.layer_groups[group])

    def _bytes_for(self, group_blocks: Sequence[int]) -> int:
        return sum(n * self.group_bytes_per_block(g) for g, n in enumerate(group_blocks))

    def layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[StoredStates, StoredStates]:
        """This layer's stored keys and values (`StoredStates` over its ``[heads, num_blocks * block_size, dim]``
        tensors), created on first use.

        The tensors are the layer's storage for the pool's life (growth resizes them in place); hold
        `storage_lock.shared()` while reading or writing them from threads that share the pool. Creating them takes `storage_lock.exclusive()`: do not call this for a layer without
        storage while holding `shared()` (it raises `RuntimeError`).

        Raises `ValueError` if the states do not fit the pool (another model's shapes, or another dtype), and
        `KVMemoryError` if the device cannot allocate the storage.
        """
        if not 0 <= layer_idx < self.layout.num_layers:
            raise ValueError(f"layer {layer_idx} is outside this pool, built for {self.layout.num_layers} layers")
        shape = self.layout.layers[layer_idx]
        # key_states: [B, heads, q, key_dim]; value_states: [B, heads, q, value_dim]
        got = (key_states.shape[1], key_states.shape[-1], value_states.shape[-1])
        if key_states.ndim != 4 or got != (shape.num_heads, shape.key_dim, shape.value_dim):
            raise ValueError(
                f"layer {layer_idx} produced keys {tuple(key_states.shape)} and values {tuple(value_states.shape)}, "
                f"but this cache was built for {shape.num_heads} KV heads of key dim {shape.key_dim} and value dim "
                f"{shape.value_dim}: is it a cache built for another model?"
            )
        if key_states.dtype != self.dtype or value_states.dtype != self.dtype:
            raise ValueError(
                f"layer {layer_idx} produced {key_states.dtype} keys and {value_states.dtype} values but the pool "
                f"stores {self.dtype}; build the cache from the model (or pass a pool of the model's dtype). "
                "torch.autocast is not supported (it makes keys and values of different dtypes): cast the model "
                "to one dtype instead"
            )
        keys, group = self.keys[layer_idx], self.group_of[layer_idx]
        num_blocks = self.groups[group].num_blocks
        if keys is None or keys.shape[1] < num_blocks * self.block_size:
            with self._exclusive(f"creating layer {layer_idx}'s storage"):
                if self.keys[layer_idx] is None:
                    self.storage.create(layer_idx, key_states.device, max(num_blocks, self._storage_blocks[group]))
                else:  # only if the id space grew without the hook (never for a pool built here)
                    self.storage.grow(layer_idx, num_blocks, num_blocks)
            keys = self.keys[layer_idx]
        if keys.device != key_states.device:
            raise ValueError(
                f"layer {layer_idx} ran on {key_states.device} but its pool storage lives on {keys.device}"
            )
        return self.stored(layer_idx)

    def stored(self, layer_idx: int) -> tuple[StoredStates, StoredStates]:
        """Layer `layer_idx`'s keys and values as `StoredStates` (the layer must have storage: see `layer`)."""
        return self.storage.stored(layer_idx)

    def copy_blocks(self, pairs: list[tuple[int, int]], group: int = 0) -> None:
        """Copy each ``(src, dst)`` block of group `group` in its layers that have storage (copy-on-write,
        second step). Takes `storage_lock.shared()` itself.
        """
        if not pairs:
            return
        size, layers = self.block_size, self.layer_groups[group].layers
        num_blocks = self.groups[group].num_blocks
        if any(self.keys[i] is not None and self.keys[i].shape[1] < num_blocks * size for i in layers):
            with self._exclusive("growing the storage for copy_blocks"):  # never for a pool built here
                for layer_idx in layers:
                    self.storage.grow(layer_idx, num_blocks, num_blocks)
        with self.storage_lock.shared():
            self.storage.copy_blocks(layers, pairs)

    def storage_bytes(self) -> int:
        """Bytes of K/V tensors (and scales) and of sequence states allocated so far (layers are created lazily;
        an elastic pool's grow with it)."""
        return self.storage.nbytes() + self.states.nbytes()

    # ------------------------------------------------------------------ growth

    @contextmanager
    def _exclusive(self, what: str) -> Iterator[None]:
        if self.storage_lock.held_shared() and not self.storage_lock.held_exclusive():
            raise RuntimeError(
                f"{what} needs storage_lock.exclusive(), but this thread holds storage_lock.shared(): take blocks "
                "and call layer() before entering shared() (see the protocol in hf_paged_cache/pool/kv_pool.py)"
            )
        with self.storage_lock.exclusive():
            yield

    def _grow_storage(self, group: int, num_blocks: int) -> None:
        """`BlockPool.allocate`'s hook: make group `group`'s tensors hold `num_blocks` blocks before the ids exist."""
        old = self.groups[group].num_blocks
        requested = self._bytes_for([num_blocks if g == group else n for g, n in enumerate(self._storage_blocks)])
        too_big = exceeds_machine(requested)
        if too_big:
            raise KVMemoryError(
                f"growing the elastic KV pool's {self.layer_groups[group].name} layers from {old:,} to "
                f"{num_blocks:,} blocks makes the pool {requested:,} bytes ({format_memory(requested)}), but this machine has {too_big}. Nothing was taken: "
                "release other caches on this pool, or give the pool a fixed size (num_blocks= / max_memory=).",
                requested,
                "this machine",
            )
        with self._exclusive(f"growing the pool to {num_blocks} blocks"):
            for layer_idx in self.layer_groups[group].layers:
                self.storage.grow(layer_idx, num_blocks, old)
            self._storage_blocks[group] = max(self._storage_blocks[group], num_blocks)

    def __repr__(self) -> str:
        size = f"num_blocks={self.num_blocks}, " + (
            f"elastic (grown {self.grow_count}x)" if self.is_elastic else f"max_blocks={self.max_blocks}"
        )
        stored = "" if self.kv_format.storage == self.dtype else f", kv_dtype={self.kv_format.name}"
        return (
            f"KVPool({size}, block_size={self.block_size}, dtype={self.dtype}{stored}, layers={self.layout.num_layers}, "
            f"free={self.blocks.num_free}, storage={format_memory(self.storage_bytes())})"
        )


def _grow_hook(pool: KVPool, group: int):
    """`pool._grow_storage` for one group, held weakly (the pool owns the `BlockPool` that holds the hook)."""
    ref = weakref.ref(pool)

    def on_grow(num_blocks: int) -> None:
        target = ref()
        if target is not None:
            target._grow_storage(group, num_blocks)

    return on_grow
