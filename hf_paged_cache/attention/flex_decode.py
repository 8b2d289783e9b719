"""`paged_flex`'s decode forward: each row's query attends to its blocks where they lie, by a compiled `flex_attention`.

`paged_sdpa` attends a decode forward from a copy: every layer gathers the rows' keys and values out of the pool
(the bytes `DynamicCache`'s ``cat`` moves) and hands the copy to SDPA. `flex_attention` instead takes a block
mask, which can name for each row the physical blocks it reads: compiled by inductor (a C++ kernel on the CPU),
it reads them in place, block after block, with no copy and no padding. The pool is head-major (``[H, slots,
D]``), so the whole storage is the key tensor of every row (``[B, H, slots, D]``, expanded, not copied) and the
mask (`FlexDecodeReads`, built once per forward from the block tables for all layers) picks each row's blocks: its
full blocks unmasked, its last, partly filled block with a mask of its filled slots. A key/value head's query
heads are the query rows of one call (``[B, H, g, D]``), so each block is read once for all of them.

The kernel shares its work among threads by (row, head) in order, so the rows are handed to it long and short in
turn (`balanced_order`): consecutive rows then hold about as many keys, and the threads as much work.

It reads each block of 16 keys by a product of its own, which costs more per key than SDPA over a long run of
gathered keys: rows of about one length (which `paged_sdpa` attends in one group, one SDPA call over their
gathered keys) are left to that (16 rows of 300 tokens at two threads: 0.90x `DynamicCache`'s forward time in place
against 0.95x gathered). `paged_flex` reads in place the decode forwards whose rows `paged_sdpa` would attend in two
groups or more (`reading.length_groups`), where the copy and the calls cost the most.

Measured on SmolLM2-135M (3 key/value heads of 64, 9 query heads, float32, 30 layers, a 2-core AMD EPYC;
`scripts/bench/generate/bench_decode.py --per-step`, alternated forwards): decode forwards of 8 rows of 60 to 1,000
tokens took 97.5 against 109.7 ms with ``paged_sdpa`` at one thread and 76.8 against 84.3 ms at two (`DynamicCache`:
128.6 and 96.7 ms). What it costs: the first call compiles the kernel (a few seconds; once per process, thread count and
head shape, since the other sizes are dynamic), and it needs a C++ compiler; a compile that fails is reported once and
the forwards gather from then on (`FlexKernel`). Float32 only: in bfloat16 the kernel ran slower than the gather and
SDPA (11 to 16 rows of 100 to 300 keys: 0.33 to 0.66 against 0.22 to 0.41 ms a layer at two threads). The results equal
SDPA's up to float32 rounding (about 3e-7 on these shapes), not bit for bit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

logger = logging.getLogger(__name__)

FLEX_DTYPES = (torch.float32,)
"""Storage and query dtypes the compiled kernel takes (see the module docstring)."""
MIN_LIMIT_ROWS = 64
"""The rows' limits live in a buffer of at least this many rows (a power of two): the kernel compiles once for up
to 64 rows, and once more for each power of two beyond."""


def kernel_takes(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether the compiled kernel reads storage of `dtype` on `device`: `FLEX_DTYPES` on a CPU."""
    return dtype in FLEX_DTYPES and torch.device(device).type == "cpu"


class BlockRows(Protocol):
    """A forward's rows as block tables (`hf_paged_cache.cache.block_table.RowsView` is one)."""

    tables: list[list[int]]  # per row, its block ids
    num_tokens: list[int]  # per row, the tokens it stores
    block_size: int


@dataclass
class FlexDecodeReads:
    """One decode forward's rows as `flex_attention` reads them: the blocks of each, in the order the kernel takes
    them."""

    block_mask: BlockMask  # per row (in `order`): its full blocks, and its last block with its filled slots
    order: torch.Tensor | None  # [B] which row of the forward the kernel takes in each place; None = as they are
    restore: torch.Tensor | None  # [B] where each row of the forward sits in the kernel's order (`order`'s inverse)
    # [T] the slots of the rows' last blocks past their keys, which the kernel multiplies by a zero weight: set to
    # zero before it reads them (whatever a block's earlier holder left there, NaN included, would else leak in);
    # None when every row fills its last block
    unfilled: torch.Tensor | None


def balanced_order(num_tokens: list[int]) -> list[int]:
    """The rows, long and short in turn: the longest, the shortest, the second longest, the second shortest...

    The kernel splits its (row, head) pairs among threads in consecutive runs; in this order every run of rows
    holds about as many keys, where in the forward's own order one thread could get all the long rows.
    """
    by_length = sorted(range(len(num_tokens)), key=lambda row: -num_tokens[row])
    order, low, high = [], 0, len(by_length) - 1
    while low <= high:
        order.append(by_length[low])
        if low != high:
            order.append(by_length[high])
        low, high = low + 1, high - 1
    return order


def build_flex_decode_reads(rows: BlockRows, groups: int, capacity: int, device: torch.device) -> FlexDecodeReads:
    """The block mask of a decode forward whose row ``b`` reads its ``rows.num_tokens[b]`` keys (the forward's new one
    included) through ``rows.tables[b]``.

    Args:
        groups: query heads per key/value head (the query rows of one call).
        capacity: slots of the storage the keys are read from (a multiple of the block size).
    """
    tables, num_tokens, block_size = rows.tables, rows.num_tokens, rows.block_size
    order = balanced_order(num_tokens)
    batch_size = len(order)
    width = capacity // block_size  # the mask spans every block of the storage
    full_ids, full_counts, last_ids, partial, limits, unfilled = [], [], [], [], [], []
    for row in order:
        count = num_tokens[row]
        used = tables[row][: -(-count // block_size)]  # the blocks holding its keys
        filled = count % block_size
        full = used[:-1] if filled else used
        full_ids += full
        full_counts.append(len(full))
        last_ids.append(used[-1] if filled else 0)
        partial.append(int(filled > 0))
        limits.append(used[-1] * block_size + filled if filled else 0)  # [first slot past its keys]
        if filled:
            unfilled += range(limits[-1], (used[-1] + 1) * block_size)
    # [B, width]: each row's full blocks first (the kernel reads the first full_counts[b] of them)
    full_index = torch.zeros(batch_size, width, dtype=torch.int32)
    counts = torch.tensor(full_counts)  # [B]
    row_of = torch.repeat_interleave(torch.arange(batch_size), counts)  # [F] the row of each full block
    starts = torch.cumsum(counts, 0) - counts  # [B] where each row's blocks begin in full_ids
    full_index[row_of, torch.arange(len(full_ids)) - starts[row_of]] = torch.tensor(full_ids, dtype=torch.int32)
    last_index = torch.zeros(batch_size, width, dtype=torch.int32)  # [B, width]: a partly filled last block first
    last_index[:, 0] = torch.tensor(last_ids, dtype=torch.int32)
    # [R >= B] the rows' limits, padded to a power of two held static: the kernel's code then indexes a buffer of
    # known size (inductor's CPU flex kernel fails to compile some dynamically sized ones)
    limit = torch.zeros(max(MIN_LIMIT_ROWS, 1 << (batch_size - 1).bit_length()), dtype=torch.long, device=device)
    limit[:batch_size] = torch.tensor(limits)
    torch._dynamo.mark_static(limit, 0)

    def filled_slots(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx < limit[b]  # applied to a row's partly filled last block only: its slots before the limit

    mask = BlockMask.from_kv_blocks(
        torch.tensor(partial, dtype=torch.int32, device=device).view(batch_size, 1, 1),
        last_index.view(batch_size, 1, 1, width).to(device),
        counts.to(torch.int32).view(batch_size, 1, 1).to(device),
        full_index.view(batch_size, 1, 1, width).to(device),
        BLOCK_SIZE=(groups, block_size),
        mask_mod=filled_slots,
        seq_lengths=(groups, capacity),
        compute_q_blocks=False,  # what a backward pass needs; attention here never runs one
    )
    unfilled_slots = torch.tensor(unfilled, device=device) if unfilled else None
    if order == list(range(batch_size)):
        return FlexDecodeReads(mask, None, None, unfilled_slots)
    order_index = torch.tensor(order, device=device)
    return FlexDecodeReads(mask, order_index, torch.argsort(order_index), unfilled_slots)


class FlexKernel:
    """`flex_attention` compiled once (dynamic shapes), checked against SDPA before its first use, or nothing.

    One instance serves the process (`FLEX_KERNEL`): what it holds is inductor's compiled code, which is the
    process's anyway. Before the kernel attends a forward of a new shape (heads, query rows per head, head sizes,
    block size, dtype), it attends a small random case of that shape whose answer SDPA gives over gathered keys
    (`self_check`): a kernel that compiles but computes wrong here (seen with inductor generating AVX2 code on a
    CPU with AMX, under ``ATEN_CPU_CAPABILITY=avx2``) is never used. A compile error (no C++ compiler, an
    unsupported shape) or a failed check is logged once, and `available` turns False so that later forwards gather
    as ``paged_sdpa`` does.
    """

    def __init__(self) -> None:
        self._compiled: Callable[..., torch.Tensor] | None = None
        self._failed = False
        self._checked: set[tuple] = set()  # the shapes whose self-check passed
        self._lock = threading.Lock()

    @property
    def available(self) -> bool:
        return not self._failed

    def __call__(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_mask: BlockMask, scale: float
    ) -> torch.Tensor | None:
        """``flex_attention(query, keys, values, block_mask=..., scale=...)``, or None if the kernel cannot run.

        Args:
            query: ``[B, H, g, D]``; keys, values: ``[B, H, slots, D]`` and ``[B, H, slots, Dv]``.
        """
        if self._failed:
            return None
        _, heads, groups, key_dim = query.shape
        shape = (heads, groups, key_dim, values.shape[-1], block_mask.BLOCK_SIZE[1], query.dtype, query.device)
        try:
            with self._lock:
                if self._compiled is None:
                    self._compiled = torch.compile(flex_attention, dynamic=True)
                if shape not in self._checked:
                    self._self_check(*shape)
                    self._checked.add(shape)
            return self._compiled(query, keys, values, block_mask=block_mask, scale=scale)
        except Exception as error:  # inductor's errors have no common base; any means the same: gather instead
            self._failed = True
            logger.warning("paged_flex: the compiled flex_attention failed (%s: %s); decode steps gather their "
                           "keys as paged_sdpa does from now on", type(error).__name__, str(error).split("\n")[0])
            return None

    def _self_check(self, heads: int, groups: int, key_dim: int, value_dim: int, block_size: int,
                    dtype: torch.dtype, device: torch.device) -> None:
        """Attend two rows (20 and 5 keys in blocks 1, 2 and 3) of random keys and values through the kernel and
        through SDPA over each row's gathered keys; `KernelMismatch` where they differ beyond float32 rounding."""
        generator = torch.Generator().manual_seed(0)

        def rand(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

        rows = _CheckRows(tables=[[1, 2], [3]], num_tokens=[20, 5], block_size=block_size)
        keys, values = rand(heads, 4 * block_size, key_dim), rand(heads, 4 * block_size, value_dim)  # [H, slots, D]
        query = rand(2, heads, groups, key_dim)  # [B, H, g, D]
        reads = build_flex_decode_reads(rows, groups, keys.shape[1], device)
        order = reads.order if reads.order is not None else torch.arange(2, device=device)
        if reads.unfilled is not None:
            keys.index_fill_(1, reads.unfilled, 0)
            values.index_fill_(1, reads.unfilled, 0)
        got = self._compiled(query.index_select(0, order), keys.expand(2, -1, -1, -1), values.expand(2, -1, -1, -1),
                             block_mask=reads.block_mask, scale=key_dim**-0.5)  # [B, H, g, Dv] in the kernel's order
        got = got.index_select(0, torch.argsort(order))
        for b, (table, count) in enumerate(zip(rows.tables, rows.num_tokens)):
            slots = (torch.tensor(table)[:, None] * block_size + torch.arange(block_size)).flatten()[:count]  # [count]
            expected = F.scaled_dot_product_attention(query[b : b + 1], keys[None, :, slots], values[None, :, slots],
                                                      scale=key_dim**-0.5)  # [1, H, g, Dv]
            if not torch.allclose(got[b : b + 1], expected, rtol=1e-4, atol=1e-5):
                difference = (got[b : b + 1] - expected).abs().max().item()
                raise KernelMismatch(f"its output differs from SDPA's on a check of {heads} x {groups} heads of "
                                     f"{key_dim} (max |difference| {difference:.3g})")


class KernelMismatch(RuntimeError):
    """The compiled kernel's answer to `FlexKernel`'s self-check is not SDPA's: it is not used."""


@dataclass
class _CheckRows:
    tables: list[list[int]]
    num_tokens: list[int]
    block_size: int


FLEX_KERNEL = FlexKernel()


def warm_up(heads: int, groups: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Compile the kernel for a model's attention shape (`heads` key/value heads of `groups` query heads each),
    as its first decode forward would; whether it compiled (False, compiling nothing, for a dtype or device the
    kernel does not take: those forwards gather).
    """
    if not kernel_takes(dtype, device):
        return False
    rows = _CheckRows(tables=[[1, 2], [3]], num_tokens=[20, 5], block_size=16)
    keys = torch.zeros(heads, 4 * 16, key_dim, dtype=dtype, device=device)  # [H, slots, D]: 4 blocks
    values = torch.zeros(heads, 4 * 16, value_dim, dtype=dtype, device=device)
    query = torch.zeros(2, heads * groups, 1, key_dim, dtype=dtype, device=device)  # [B, Hq, 1, D]
    reads = build_flex_decode_reads(rows, groups, keys.shape[1], device)
    return attend_flex(query, keys, values, reads, key_dim**-0.5) is not None


def flex_decode_applies(query: torch.Tensor, storage: torch.Tensor | None) -> bool:
    """Whether the compiled kernel can attend this decode forward: plain float32 storage on a CPU, and no earlier
    compile failure."""
    return (
        storage is not None
        and kernel_takes(query.dtype, query.device)
        and storage.dtype == query.dtype
        and FLEX_KERNEL.available
    )


def attend_flex(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, reads: FlexDecodeReads, scale: float
) -> torch.Tensor | None:
    """``[B, 1, Hq, Dv]``: a decode forward's attention read in place through `reads`, or None if the kernel cannot run.

    Args:
        query: ``[B, Hq, 1, D]``; keys, values: the layer's ``[H, slots, D]`` and ``[H, slots, Dv]`` storage (its
            rows' last blocks are theirs alone, as every row has just written its new token into its own: the
            slots past their keys are zeroed here).
    """
    batch_size, query_heads, _, key_dim = query.shape
    heads = keys.shape[0]
    # [B, H, g, D]: query head kv * g + j reads key/value head kv, its g heads as g query rows
    grouped = query.view(batch_size, heads, query_heads // heads, key_dim)
    if reads.order is not None:
        grouped = grouped.index_select(0, reads.order)
    if reads.unfilled is not None:
        keys.index_fill_(1, reads.unfilled, 0)
        values.index_fill_(1, reads.unfilled, 0)
    # [B, H, slots, D]: every row reads the same storage (expanded, not copied); the mask picks its blocks
    out = FLEX_KERNEL(
        grouped,
        keys.unsqueeze(0).expand(batch_size, -1, -1, -1),
        values.unsqueeze(0).expand(batch_size, -1, -1, -1),
        reads.block_mask,
        scale,
    )  # [B, H, g, Dv] in the kernel's order
    if out is None:
        return None
    if reads.restore is not None:
        out = out.index_select(0, reads.restore)
    return out.reshape(batch_size, 1, query_heads, -1)
