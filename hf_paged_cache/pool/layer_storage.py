"""`LayerStorage`: every layer's key and value tensors of one pool (and their scales), made and grown in place.

The tensors only: which block ids exist, and when the storage must grow, is `KVPool`'s to decide, under
its `storage_lock` (the protocol is in `kv_pool`'s docstring). A device that cannot allocate the storage
gives `KVMemoryError`, naming the bytes, with nothing changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import KVMemoryError
from .block_pool import NULL_BLOCK
from .kv_format import KVFormat, StoredStates, writable
from .memory import KVLayout, format_memory


class LayerStorage:
    """Per layer, keys ``[num_kv_heads, num_blocks * block_size, key_dim]`` and values alike, addressed by slot
    id (``block * block_size + offset``) along dim 1, stored in `kv_format` and read back in `dtype`; for an
    8-bit format, their ``[heads, num_blocks * block_size, G, P]`` scales (`key_scales`, `value_scales`; None
    otherwise).

    A layer's tensors are made on its first `create` (on the device of the states it stores) and never
    replaced: `grow` moves them onto a larger allocation in place (``Tensor.set_``), so the tensors (and the
    `stored` views over them) stay that layer's storage for the pool's life.
    """

    def __init__(self, layout: KVLayout, block_size: int, kv_format: KVFormat, dtype: torch.dtype):
        self.layout = layout
        self.block_size = block_size
        self.kv_format = kv_format  # how keys and values are stored
        self.dtype = dtype  # what they are read back as
        self.keys: list[torch.Tensor | None] = [None] * layout.num_layers
        self.values: list[torch.Tensor | None] = [None] * layout.num_layers
        self.key_scales: list[torch.Tensor | None] = [None] * layout.num_layers  # scaled formats only
        self.value_scales: list[torch.Tensor | None] = [None] * layout.num_layers
        self._stored: list[tuple[StoredStates, StoredStates] | None] = [None] * layout.num_layers  # `stored`
        # indexed attention: each token's DSA indexer key, [1, num_blocks * block_size, index_dim] (and scales)
        self.indexer_keys: list[torch.Tensor | None] = [None] * layout.num_layers
        self.indexer_scales: list[torch.Tensor | None] = [None] * layout.num_layers

    def tensors(self, layer_idx: int) -> list[tuple[str, torch.Tensor | None]]:
        """Every tensor layer `layer_idx` stores (keys, values and their scales), with its name."""
        return [("keys", self.keys[layer_idx]), ("values", self.values[layer_idx]),
                ("key scales", self.key_scales[layer_idx]), ("value scales", self.value_scales[layer_idx]),
                ("indexer keys", self.indexer_keys[layer_idx]), ("indexer key scales", self.indexer_scales[layer_idx])]

    def stored(self, layer_idx: int) -> tuple[StoredStates, StoredStates]:
        """Layer `layer_idx`'s keys and values as `StoredStates` (the layer must have storage: see `create`).

        Made once per layer: its tensors are never replaced (growth moves them in place)."""
        stored = self._stored[layer_idx]
        if stored is None:
            keys, values = self.keys[layer_idx], self.values[layer_idx]
            if keys is None or values is None:
                raise ValueError(f"layer {layer_idx} has stored nothing yet")
            stored = self._stored[layer_idx] = (
                StoredStates(keys, self.key_scales[layer_idx], self.kv_format, self.dtype),
                StoredStates(values, self.value_scales[layer_idx], self.kv_format, self.dtype),
            )
        return stored

    def stored_indexer(self, layer_idx: int) -> StoredStates:
        """Layer `layer_idx`'s indexer keys as `StoredStates` (one head; made by `create`)."""
        keys = self.indexer_keys[layer_idx]
        if keys is None:
            raise ValueError(f"layer {layer_idx} keeps no indexer keys")
        return StoredStates(keys, self.indexer_scales[layer_idx], self.kv_format, self.dtype)

    def create(self, layer_idx: int, device: torch.device, num_blocks: int) -> None:
        """Make layer `layer_idx`'s tensors of `num_blocks` blocks on `device`, the null block zeroed.

        Raises `KVMemoryError` if the device cannot allocate them (nothing is kept then).
        """
        shape = self.layout.layers[layer_idx]
        slots = num_blocks * self.block_size
        stored = self.kv_format
        stored.check_device(device)
        try:
            keys = _empty((shape.num_heads, slots, shape.key_dim), stored.storage, device)
            values = _empty((shape.num_heads, slots, shape.value_dim), stored.storage, device)
            scales = [_empty((shape.num_heads, slots, *stored.scale_shape(dim)), stored.scale_dtype, device)
                      if stored.scaled else None for dim in (shape.key_dim, shape.value_dim)]
        except (RuntimeError, MemoryError) as error:
            if not _out_of_memory(error):
                raise
            nbytes = slots * shape.num_heads * (stored.vector_bytes(shape.key_dim) + stored.vector_bytes(shape.value_dim))
            raise KVMemoryError(
                f"creating layer {layer_idx}'s KV storage ({num_blocks:,} blocks of {self.block_size} tokens) needs "
                f"{nbytes:,} bytes ({format_memory(nbytes)}) on {device}, which it could not allocate ({error}). "
                "Use a smaller pool (num_blocks= / max_memory=, or neither for one that grows as needed).",
                nbytes,
                device,
            ) from error
        indexer_dim = (self.layout.indexer_dims or (0,) * self.layout.num_layers)[layer_idx]
        indexer = [None, None]
        if indexer_dim:  # the DSA indexer's key of each token, one head, in the same slots
            indexer = [_empty((1, slots, indexer_dim), stored.storage, device),
                       _empty((1, slots, *stored.scale_shape(indexer_dim)), stored.scale_dtype, device)
                       if stored.scaled else None]
        null = slice(NULL_BLOCK * self.block_size, (NULL_BLOCK + 1) * self.block_size)
        with torch.inference_mode(False):
            for tensor in (keys, values, *scales, *indexer):  # padding reads the null block: keep it finite
                if tensor is not None:
                    tensor[:, null] = 0
        self.indexer_keys[layer_idx], self.indexer_scales[layer_idx] = indexer
        self.key_scales[layer_idx], self.value_scales[layer_idx] = scales
        self.values[layer_idx] = values  # first: whoever sees the keys (read unlocked) sees the values
        self.keys[layer_idx] = keys

    def grow(self, layer_idx: int, num_blocks: int, pool_blocks: int) -> None:
        """Grow layer `layer_idx`'s tensors in place to `num_blocks` blocks (the pool now has `pool_blocks`).

        Raises `KVMemoryError` if the device cannot allocate them: the tensors not yet grown keep their size.
        """
        slots = num_blocks * self.block_size
        for name, tensor in self.tensors(layer_idx):
            if tensor is None or tensor.shape[1] >= slots:
                continue
            nbytes = slots * tensor[:, 0].numel() * tensor.element_size()
            try:
                _grow_slots(tensor, slots)  # copies the contents; on failure, nothing changed
            except (RuntimeError, MemoryError) as error:
                if not _out_of_memory(error):
                    raise
                raise KVMemoryError(
                    f"growing the elastic KV pool from {tensor.shape[1] // self.block_size:,} to {num_blocks:,} "
                    f"blocks: layer {layer_idx}'s {name} need {nbytes:,} bytes ({format_memory(nbytes)}) on "
                    f"{tensor.device}, which it could not allocate ({error}). Nothing was taken: the pool keeps "
                    f"its {pool_blocks:,} blocks. Release other caches on this pool, or give the pool a "
                    "fixed size (num_blocks= / max_memory=) that fits.",
                    nbytes,
                    tensor.device,
                ) from error

    def copy_blocks(self, layers: Sequence[int], pairs: list[tuple[int, int]]) -> None:
        """Copy each ``(src, dst)`` block in `layers` that have storage (the caller holds the storage lock)."""
        size = self.block_size
        for storage in (tensor for i in layers for _, tensor in self.tensors(i)):
            if storage is None:
                continue
            src = torch.tensor([s * size + i for s, _ in pairs for i in range(size)], device=storage.device)
            dst = torch.tensor([d * size + i for _, d in pairs for i in range(size)], device=storage.device)
            storage = writable(storage)  # float8 has no CPU index_copy_: its bytes do
            storage.index_copy_(1, dst, storage.index_select(1, src))

    def nbytes(self) -> int:
        """Bytes of the tensors (and scales) made so far."""
        tensors = (tensor for i in range(self.layout.num_layers) for _, tensor in self.tensors(i))
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A normal tensor even under `torch.inference_mode()`, so the pool works inside and outside it."""
    with torch.inference_mode(False):
        return torch.empty(shape, dtype=dtype, device=device)


def _grow_slots(tensor: torch.Tensor, slots: int) -> None:
    """Make head-major `tensor` ``[H, S, ...]`` hold `slots` slots in place, keeping its contents: a new
    allocation, every head's slots copied into it, and the same tensor object pointed at it (``set_``)."""
    with torch.inference_mode(False):  # the pool's tensors are normal tensors (`_empty`)
        grown = torch.empty((tensor.shape[0], slots, *tensor.shape[2:]), dtype=tensor.dtype, device=tensor.device)
        grown[:, : tensor.shape[1]] = tensor
        tensor.set_(grown)


def _out_of_memory(error: BaseException) -> bool:
    if isinstance(error, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    message = str(error).lower()
    return "out of memory" in message or "can't allocate memory" in message or "failed to allocate" in message
