"""What the Space draws: a snapshot of the block pool, the dense-cache memory comparison, and their figures.

Pure functions over plain data (no Gradio, no model), so they can be tested on their own:

- `PoolSnapshot.take(cache)` records, while a request's `PagedCache` still holds its blocks, which rows of
  the request hold which blocks and what every block of the (shared) pool is doing;
- `block_states(snapshot)` classifies each block (null, one row's, shared, another request's, cached, free);
- `compare_memory(...)` puts the paged cache's bytes beside what `DynamicCache` and `StaticCache` would
  reserve for the same batch;
- `draw_pool_grid` / `draw_memory_chart` turn those into matplotlib figures for `gr.Plot`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle
from transformers import PreTrainedConfig

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import (
    kv_bytes_per_token,
    static_cache_reserved_bytes,
    stored_tokens,
    used_bytes,
)
from hf_paged_cache.pool.block_pool import NULL_BLOCK
from hf_paged_cache.pool.memory import format_memory

ROW_COLORS: tuple[str, ...] = (
    "#1f77b4",  # blue
    "#ff7f0e",  # orange
    "#2ca02c",  # green
    "#d62728",  # red
    "#9467bd",  # purple
    "#8c564b",  # brown
    "#e377c2",  # pink
    "#17becf",  # cyan
)
"""Colour of each row (sequence) of a batch, in the grid and in the outputs table; 8 rows at most."""

SHARED_COLOR = "#f2c14e"
OTHER_COLOR = "#8d99a6"
CACHED_COLOR = "#cfdce6"
FREE_COLOR = "#eeeeee"
NULL_COLOR = "#000000"


class BlockKind(Enum):
    """What one block of the pool is doing at the moment of a snapshot."""

    NULL = "null block 0 (padding reads it)"
    ROW = "held by one row of this batch"
    SHARED = "shared: held more than once"
    OTHER = "held by other requests"
    CACHED = "free, keeps a cached prefix"
    FREE = "free"


@dataclass(frozen=True)
class BlockState:
    """One block of a snapshot: its kind, the rows of this request holding it, and its tokens."""

    kind: BlockKind
    rows: tuple[int, ...] = ()  # rows of this request holding the block (0-based)
    tokens: int = 0  # tokens this request stores in it (0 for blocks it does not hold)
    refcount: int = 0  # holders pool-wide


@dataclass(frozen=True)
class PoolSnapshot:
    """The state of a pool as seen from one request's cache (read without stopping other requests)."""

    num_blocks: int
    block_size: int
    tables: tuple[tuple[int, ...], ...]  # block ids of each row of this request, in order
    row_tokens: tuple[int, ...]  # tokens each row stores
    refcounts: tuple[int, ...]  # holders of each block of the pool, all requests together
    cached: tuple[bool, ...]  # whether each block is findable by prefix

    @classmethod
    def take(cls, cache: PagedCache) -> PoolSnapshot:
        """Record `cache`'s block tables and every block's reference count and cached flag.

        Other requests may change the pool while this runs; each number is read once, so the picture is at
        worst a few blocks out of date, never inconsistent for this request's own rows.
        """
        blocks = cache.pool.blocks
        return cls(
            num_blocks=blocks.num_blocks,
            block_size=blocks.block_size,
            tables=tuple(tuple(table) for table in cache.block_tables.tables),
            row_tokens=tuple(cache.block_tables.num_tokens),
            refcounts=tuple(blocks.refcount(b) for b in range(blocks.num_blocks)),
            cached=tuple(blocks.is_cached(b) for b in range(blocks.num_blocks)),
        )

    @property
    def blocks_in_use(self) -> int:
        """Blocks held by anyone (this request or others)."""
        return sum(1 for count in self.refcounts if count > 0)


def block_states(snapshot: PoolSnapshot) -> list[BlockState]:
    """Classify every block of `snapshot` (index = block id).

    A block is SHARED when its pool-wide reference count is above 1 (several rows of this request, or this
    request and another, hold it); ROW when exactly one row of this request holds it; OTHER when only other
    requests do; CACHED when nobody holds it but its contents can still be found by prefix; else FREE.
    Block 0 is always NULL.
    """
    size = snapshot.block_size
    rows_of: dict[int, list[int]] = {}
    tokens_of: dict[int, int] = {}
    for row, (table, stored) in enumerate(zip(snapshot.tables, snapshot.row_tokens, strict=True)):
        for i, block in enumerate(table):
            rows_of.setdefault(block, []).append(row)
            tokens_of[block] = max(tokens_of.get(block, 0), min(size, stored - i * size))
    states = []
    for block in range(snapshot.num_blocks):
        count = snapshot.refcounts[block]
        rows = tuple(rows_of.get(block, ()))
        if block == NULL_BLOCK:
            kind = BlockKind.NULL
        elif rows and count > 1:
            kind = BlockKind.SHARED
        elif rows:
            kind = BlockKind.ROW
        elif count > 0:
            kind = BlockKind.OTHER
        elif snapshot.cached[block]:
            kind = BlockKind.CACHED
        else:
            kind = BlockKind.FREE
        states.append(BlockState(kind, rows, tokens_of.get(block, 0), count))
    return states


@dataclass(frozen=True)
class MemoryRow:
    """KV bytes one kind of cache reserves for a batch, and how many of them hold a real token."""

    name: str
    reserved_bytes: int
    used_bytes: int

    @property
    def utilization(self) -> float:
        """``used / reserved`` (1.0 when nothing is reserved)."""
        return self.used_bytes / self.reserved_bytes if self.reserved_bytes else 1.0


def compare_memory(
    *,
    paged_reserved: int,
    paged_used: int,
    prompt_lengths: Sequence[int],
    generated_steps: int,
    max_new_tokens: int,
    config: PreTrainedConfig,
    dtype: torch.dtype,
) -> list[MemoryRow]:
    """KV memory of `PagedCache`, `DynamicCache` and `StaticCache` for one left-padded batch after `generate`.

    The formulas are those of `hf_paged_cache.bench` (whose helpers this uses). With ``B`` rows of real
    lengths ``len_i`` (longest ``L``), ``T`` generated steps and ``b`` bytes per token over all layers
    (`kv_bytes_per_token`), a cache holds every position fed to the model, i.e. the prompt and all generated
    tokens but the last one (`stored_tokens`):

    - ``DynamicCache`` grows every row to the padded width: reserved ``B x (L + T - 1) x b``;
    - ``StaticCache`` is allocated up front with ``max_cache_len = L + max_new_tokens`` (what `generate`
      sizes it to): reserved ``B x (L + max_new_tokens) x b`` (`static_cache_reserved_bytes`);
    - both hold ``sum_i (len_i + T - 1) x b`` bytes of real tokens (`used_bytes`; left padding is the waste);
    - ``PagedCache`` reserves whole blocks only for real tokens (`paged_reserved`, `paged_used` come from
      `PagedCache.stats()`, which counts a block shared by several rows once).

    Args:
        paged_reserved: `CacheStats.bytes_reserved` of the paged cache.
        paged_used: `CacheStats.bytes_used` of the paged cache.
        prompt_lengths: real (unpadded) prompt length of each row.
        generated_steps: tokens `generate` appended to each row (``T``, the same for every row).
        max_new_tokens: the `max_new_tokens` passed to `generate`.
        config: the model's config (for the bytes per token).
        dtype: the dtype keys and values are stored in.
    """
    if not prompt_lengths:
        raise ValueError("compare_memory needs at least one row")
    rows, longest = len(prompt_lengths), max(prompt_lengths)
    per_token = kv_bytes_per_token(config, dtype)
    used = used_bytes(stored_tokens(prompt_lengths, generated_steps), per_token)
    dynamic = rows * stored_tokens([longest], generated_steps)[0] * per_token
    static = static_cache_reserved_bytes(config, longest + max_new_tokens, rows, dtype)
    return [
        MemoryRow("PagedCache", paged_reserved, paged_used),
        MemoryRow("DynamicCache", dynamic, used),
        MemoryRow("StaticCache", static, used),
    ]


def format_bytes(num_bytes: float) -> str:
    """``1536 -> '1.5 KiB'``: binary units, 3 significant digits."""
    return format_memory(num_bytes, ".3g")


def _lighten(color: str, amount: float = 0.7) -> tuple[float, float, float]:
    """Mix `color` (``#rrggbb``) with white; `amount` 0 keeps it, 1 gives white."""
    rgb = [int(color[i : i + 2], 16) / 255 for i in (1, 3, 5)]
    r, g, b = (c + (1 - c) * amount for c in rgb)
    return (r, g, b)


def draw_pool_grid(snapshot: PoolSnapshot, *, columns: int = 32, title: str | None = None) -> Figure:
    """The whole pool as a grid of blocks, ``columns`` per line, block 0 at the top left.

    A block held by one row is filled in that row's colour, the filled height being the share of its slots
    holding a token (the rest is a paler tint); shared blocks are gold, hatched, outlined and labelled with
    their holder count; blocks of other requests are slate, cached free blocks pale blue, free blocks grey and
    the null block black. Each held block shows the row number (1-based).
    """
    states = block_states(snapshot)
    lines = math.ceil(snapshot.num_blocks / columns)
    used_rows = sorted({row for state in states for row in state.rows})
    handles = [Patch(facecolor=ROW_COLORS[r % len(ROW_COLORS)], label=f"row {r + 1}") for r in used_rows]
    handles += [
        Patch(facecolor=SHARED_COLOR, edgecolor="black", hatch="////", label="shared (×holders)"),
        Patch(facecolor=OTHER_COLOR, label="other requests"),
        Patch(facecolor=CACHED_COLOR, label="free, cached prefix"),
        Patch(facecolor=FREE_COLOR, edgecolor="#bbbbbb", label="free"),
        Patch(facecolor=NULL_COLOR, label="null block 0"),
    ]
    legend_lines = 1 if len(handles) <= 9 else 2
    # lay the figure out in inches: title, grid (square cells), legend
    width, cell, title_h, legend_h = 11.0, 10.6 / columns, 0.4, 0.3 * legend_lines + 0.1
    grid_h = cell * lines
    height = title_h + grid_h + legend_h
    fig = Figure(figsize=(width, height), dpi=110)
    ax = fig.add_axes((0.2 / width, legend_h / height, 10.6 / width, grid_h / height))
    for block, state in enumerate(states):
        _draw_block(ax, block % columns, -(block // columns), state, snapshot.block_size)
    ax.set_xlim(0, columns)
    ax.set_ylim(-lines + 1, 1)
    ax.axis("off")
    fig.legend(handles=handles, loc="lower center", ncol=-(-len(handles) // legend_lines), fontsize=8,
               frameon=False, borderaxespad=0.2)
    held = sum(1 for s in states if s.kind in (BlockKind.ROW, BlockKind.SHARED))
    fig.suptitle(
        title or f"Block pool: {snapshot.num_blocks} blocks of {snapshot.block_size} tokens; "
        f"this batch holds {held}, all requests {snapshot.blocks_in_use}",
        fontsize=10, y=1 - 0.08 / height, va="top",
    )
    return fig


def _draw_block(ax: Axes, x: int, y: int, state: BlockState, block_size: int) -> None:
    """One block of the grid at ``(x, y)``: a row's colour filled to its share of tokens, or the colour of
    its kind (shared blocks hatched and labelled with their holder count)."""
    edge, hatch, line_width = "white", None, 0.6
    if state.kind is BlockKind.ROW:
        color = ROW_COLORS[state.rows[0] % len(ROW_COLORS)]
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor=_lighten(color), edgecolor="white", linewidth=0.6))
        fill = state.tokens / block_size
        ax.add_patch(Rectangle((x, y), 1, fill, facecolor=color, edgecolor="none"))
        ax.add_patch(Rectangle((x, y), 1, 1, facecolor="none", edgecolor="white", linewidth=0.6))
        ax.text(x + 0.5, y + 0.5, str(state.rows[0] + 1), ha="center", va="center", fontsize=7.5,
                color="white" if fill >= 0.5 else "black", fontweight="bold")
        return
    if state.kind is BlockKind.SHARED:
        color, edge, hatch, line_width = SHARED_COLOR, "black", "////", 1.2
    elif state.kind is BlockKind.OTHER:
        color = OTHER_COLOR
    elif state.kind is BlockKind.CACHED:
        color = CACHED_COLOR
    elif state.kind is BlockKind.NULL:
        color = NULL_COLOR
    else:
        color = FREE_COLOR
    ax.add_patch(Rectangle((x + 0.04, y + 0.04), 0.92, 0.92, facecolor=color, edgecolor=edge, hatch=hatch,
                           linewidth=line_width))
    if state.kind is BlockKind.SHARED:
        ax.text(x + 0.5, y + 0.5, f"×{state.refcount}", ha="center", va="center", fontsize=7.5,
                fontweight="bold", color="black",
                bbox={"boxstyle": "round,pad=0.1", "facecolor": SHARED_COLOR, "edgecolor": "none"})


def draw_memory_chart(rows: Sequence[MemoryRow]) -> Figure:
    """Horizontal bars, one per cache: the full bar is the bytes reserved, the dark part the bytes used."""
    fig = Figure(figsize=(6.4, 2.9), dpi=110)
    ax = fig.add_axes((0.22, 0.2, 0.74, 0.66))
    top = max((row.reserved_bytes for row in rows), default=1) or 1
    scale, unit = 1.0, "B"
    for candidate, name in ((1024**3, "GiB"), (1024**2, "MiB"), (1024, "KiB")):
        if top >= candidate:
            scale, unit = float(candidate), name
            break
    colors = ("#2a9d8f", "#e76f51", "#8d6cab")
    for i, row in enumerate(rows):
        color = colors[i % len(colors)]
        y = len(rows) - 1 - i
        ax.barh(y, row.reserved_bytes / scale, color=_lighten(color, 0.65), edgecolor=color, height=0.6)
        ax.barh(y, row.used_bytes / scale, color=color, height=0.6)
        ax.text(row.reserved_bytes / scale + top / scale * 0.01, y,
                f"{format_bytes(row.reserved_bytes)} · {row.utilization:.0%} used", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [row.name for row in reversed(rows)], fontsize=9)
    ax.set_xlim(0, top / scale * 1.45)
    ax.set_xlabel(f"KV cache ({unit}): pale = reserved, dark = holding real tokens", fontsize=8)
    ax.tick_params(axis="x", labelsize=8)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.suptitle("KV memory for this batch", fontsize=10)
    return fig
