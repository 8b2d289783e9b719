"""Starting new rows from blocks already in the pool: the longest prefix every layer group has cached.

A full-attention group needs every block of the prefix. A sliding-window group of window `W` needs only
the blocks its next query can see: a prefix of `n` tokens is usable if the group still has the blocks
holding tokens ``n - W + 1 .. n - 1`` (blocks before those may have been given back or evicted).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..pool.block_pool import NULL_BLOCK
from .block_table import BlockTables

_RETRIES = 3  # lookups to try again when another thread evicts a block between lookup and hold


def adopt_longest_prefix(groups: Sequence[BlockTables], windows: Sequence[int | None], rows: Sequence[Sequence[int]]) -> int:
    """Add `rows` to every group's tables, started from the longest prefix (whole blocks) all of them find.

    Each row keeps at least one token to compute. Returns the number of tokens adopted per row (0 when
    nothing usable is cached).
    """
    root = groups[0].root
    if root is None:
        raise ValueError("these block tables have no prefix root: nothing can be looked up by prefix")
    size = groups[0].blocks.block_size
    max_blocks = (min(len(tokens) for tokens in rows) - 1) // size
    for _ in range(_RETRIES):
        found = [[tables.blocks.lookup_prefix(tokens, max_blocks, root) for tokens in rows] for tables in groups]
        length = next(
            n for n in range(max_blocks, -1, -1)
            if all(_usable(hits, n, window, size) for per_row, window in zip(found, windows) for hits in per_row)
        )
        held = _hold(groups, windows, found, length, size, max_blocks)
        if held is not None:
            break
    else:
        length, held = 0, [[[] for _ in rows] for _ in groups]
    for tables, per_row in zip(groups, held):
        start = tables.batch_size
        tables.add_rows(len(rows))
        for row, (tokens, blocks) in enumerate(zip(rows, per_row), start=start):
            tables.adopt_prefix(row, blocks, tokens[: length * size])
    return length * size


def _first_needed(num_blocks: int, window: int | None, size: int) -> int:
    """The first block a group needs after a prefix of `num_blocks` blocks (0 for full attention)."""
    if window is None:
        return 0
    return max(num_blocks * size - window + 1, 0) // size


def _usable(hits: list, num_blocks: int, window: int | None, size: int) -> bool:
    return all(hits[i] is not None for i in range(_first_needed(num_blocks, window, size), num_blocks))


def _hold(groups, windows, found, num_blocks: int, size: int, max_blocks: int) -> list[list[list[int]]] | None:
    """Hold every needed block (null entries before a window's first), or None if one was evicted meanwhile."""
    held: list[list[list[int]]] = []
    taken: list[tuple[BlockTables, list[int]]] = []
    for tables, per_row, window in zip(groups, found, windows):
        first = _first_needed(num_blocks, window, size)
        rows = []
        for hits in per_row:
            needed = hits[first:num_blocks]
            if not tables.blocks.hold_cached(needed, looked_up=max_blocks):
                for owner, blocks in taken:
                    owner.blocks.free(reversed(blocks))
                return None
            blocks = [block for block, _ in needed]
            taken.append((tables, blocks))
            rows.append([NULL_BLOCK] * first + blocks)
        held.append(rows)
    return held
