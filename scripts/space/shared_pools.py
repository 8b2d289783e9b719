"""The app's KV memory: one shared pool per block size and way of storing keys and values, each with its line."""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from limits import BLOCK_SIZES, DEFAULT_NUM_BLOCKS, KV_DTYPES, MAX_WAIT_S, MAX_WAITING, InputError
from transformers import PreTrainedModel
from waiting_line import WaitingLine

from hf_paged_cache import KVPool


class SharedPools:
    """The app's KV memory: one `KVPool` per block size of `BLOCK_SIZES` and way of storing keys and values
    of `kv_dtypes`, shared by every session, each with the `WaitingLine` its requests wait in.

    Every pool of a block size takes the same bytes: the model-dtype pool has `num_blocks` blocks, and an
    int8 pool as many of its smaller blocks as fit in those bytes (about 3.7x for head dim 64 in float32).

    Pools are built up front (their tensors are allocated lazily, layer by layer, on first use) and never
    replaced; requests only take and give back blocks, which the pool's lock keeps safe across threads.
    """

    def __init__(self, model: PreTrainedModel, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_sizes: Sequence[int] = BLOCK_SIZES, *, kv_dtypes: Sequence[str | None] = KV_DTYPES,
                 max_waiting: int = MAX_WAITING, max_wait_s: float = MAX_WAIT_S):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        lines = {}
        for size in block_sizes:
            full = KVPool.for_config(model.config, num_blocks=num_blocks, block_size=size, dtype=model.dtype)
            for kv_dtype in kv_dtypes:
                pool = full if kv_dtype is None else _pool_in_same_bytes(model, full, kv_dtype)
                lines[size, kv_dtype] = WaitingLine(pool, max_waiting=max_waiting, max_wait_s=max_wait_s)
        self._lines = MappingProxyType(lines)

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(size for size, _ in self._lines))

    @property
    def kv_dtypes(self) -> tuple[str | None, ...]:
        return tuple(dict.fromkeys(kv_dtype for _, kv_dtype in self._lines))

    def line(self, block_size: int, kv_dtype: str | None = None) -> WaitingLine:
        """The waiting line of the shared pool of `block_size`-token blocks storing `kv_dtype` (None: the
        model's dtype); `InputError` for a size or a dtype not offered."""
        if block_size not in self.block_sizes:
            raise InputError(f"Block size must be one of {', '.join(map(str, self.block_sizes))}; got {block_size}.")
        if (block_size, kv_dtype) not in self._lines:
            raise InputError(f"Keys and values can be stored as {', '.join(kv_label(k) for k in self.kv_dtypes)}; "
                             f"got {kv_dtype!r}.")
        return self._lines[block_size, kv_dtype]

    def pool(self, block_size: int, kv_dtype: str | None = None) -> KVPool:
        """The shared pool of `block_size`-token blocks storing `kv_dtype` (raises `InputError` as `line`)."""
        return self.line(block_size, kv_dtype).pool


def _pool_in_same_bytes(model: PreTrainedModel, full: KVPool, kv_dtype: str) -> KVPool:
    """A pool storing `kv_dtype` with as many blocks as fit in the bytes of `full` (the model-dtype pool)."""
    probe = KVPool.for_config(model.config, num_blocks=2, block_size=full.block_size, dtype=model.dtype,
                              kv_dtype=kv_dtype)
    num_blocks = full.num_blocks * full.bytes_per_block // probe.bytes_per_block
    return KVPool.for_config(model.config, num_blocks=num_blocks, block_size=full.block_size, dtype=model.dtype,
                             kv_dtype=kv_dtype)


def capacities(pools: SharedPools, block_size: int) -> str:
    """``"255 blocks in the model's dtype, 947 in int8"``: what each pool of `block_size` holds at most."""
    sizes = [f"{pools.pool(block_size, k).blocks.capacity} {'blocks ' if not i else ''}in {kv_label(k)}"
             for i, k in enumerate(pools.kv_dtypes)]
    return ", ".join(sizes)


def kv_label(kv_dtype: str | None) -> str:
    """How the page names a way of storing keys and values."""
    return "the model's dtype" if kv_dtype is None else kv_dtype
