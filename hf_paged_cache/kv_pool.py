"""The shared memory of paged caches: block ids (`BlockPool`) plus the per-layer tensors they index."""

from __future__ import annotations

import threading

import torch
from transformers import PreTrainedConfig

from .block_pool import NULL_BLOCK, BlockPool
from .memory import KVLayout, blocks_for_budget, blocks_for_tokens, bytes_per_block


class KVPool:
    """Key and value storage for every layer of one model, addressed by block id.

    Per attention layer, keys are stored as ``[num_blocks, block_size, num_kv_heads, key_dim]`` (values
    likewise): token-major inside a block, so the tokens of a sequence are rows of one flat
    ``[num_blocks * block_size, heads, dim]`` view and a gather by slot id (``block * block_size + offset``)
    yields ``[tokens, heads, dim]`` directly, with no per-head strides to undo.

    A layer's tensors are created, in the pool's dtype, on the device of the first key states it stores, so
    a model spread over several devices keeps each layer's cache beside that layer. Several `PagedCache` objects can
    share one pool; they share its blocks through reference counts in `blocks`.
    """

    def __init__(self, layout: KVLayout, *, num_blocks: int, block_size: int = 16, dtype: torch.dtype):
        self.layout = layout
        self.dtype = dtype
        self.blocks = BlockPool(num_blocks, block_size)
        self.keys: list[torch.Tensor | None] = [None] * layout.num_layers
        self.values: list[torch.Tensor | None] = [None] * layout.num_layers
        self._init_lock = threading.Lock()  # guards lazy creation of `keys` / `values` only

    @classmethod
    def for_config(
        cls,
        config: PreTrainedConfig,
        *,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> KVPool:
        """Size a pool for `config` by `num_blocks`, by a `max_memory` budget, or by default.

        The default holds one sequence of the model's full context (``max_position_embeddings`` tokens) plus
        the null block; pass `num_blocks` or `max_memory` to size it for your batch.
        """
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if num_blocks is not None and max_memory is not None:
            raise ValueError("pass num_blocks or max_memory, not both")
        layout = KVLayout.from_config(config)
        if max_memory is not None:
            num_blocks = blocks_for_budget(max_memory, layout, block_size, dtype)
        elif num_blocks is None:
            context = getattr(config.get_text_config(decoder=True), "max_position_embeddings", None) or 4096
            num_blocks = blocks_for_tokens(context, block_size) + 1
        return cls(layout, num_blocks=num_blocks, block_size=block_size, dtype=dtype)

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_block(self.layout, self.block_size, self.dtype)

    def layer(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's ``[num_blocks * block_size, heads, dim]`` key and value views, created on first use.

        Raises `ValueError` if the states do not fit the pool (another model's shapes, or another dtype).
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
        keys = self.keys[layer_idx]
        if keys is None:
            with self._init_lock:
                if self.keys[layer_idx] is None:
                    self.keys[layer_idx], self.values[layer_idx] = self._allocate(shape, key_states.device)
            keys = self.keys[layer_idx]
        elif keys.device != key_states.device:
            raise ValueError(
                f"layer {layer_idx} ran on {key_states.device} but its pool storage lives on {keys.device}"
            )
        return keys, self.values[layer_idx]

    def _allocate(self, shape, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.num_blocks * self.block_size
        keys = torch.empty(slots, shape.num_heads, shape.key_dim, dtype=self.dtype, device=device)
        values = torch.empty(slots, shape.num_heads, shape.value_dim, dtype=self.dtype, device=device)
        null = slice(NULL_BLOCK * self.block_size, (NULL_BLOCK + 1) * self.block_size)
        keys[null] = 0  # padding reads the null block: keep it finite
        values[null] = 0
        return keys, values

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each ``(src, dst)`` block in every layer that has storage (copy-on-write, second step)."""
        if not pairs:
            return
        size = self.block_size
        for storage in (*self.keys, *self.values):
            if storage is None:
                continue
            src = torch.tensor([s * size + i for s, _ in pairs for i in range(size)], device=storage.device)
            dst = torch.tensor([d * size + i for _, d in pairs for i in range(size)], device=storage.device)
            storage.index_copy_(0, dst, storage.index_select(0, src))

    def storage_bytes(self) -> int:
        """Bytes of K/V tensors allocated so far (layers are created lazily)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    def __repr__(self) -> str:
        return (
            f"KVPool(num_blocks={self.num_blocks}, block_size={self.block_size}, dtype={self.dtype}, "
            f"layers={self.layout.num_layers}, free={self.blocks.num_free})"
        )
