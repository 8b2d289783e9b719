"""Per-sequence block lists of one cache, and the slot arithmetic that maps tokens to pool memory."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from ..errors import PoolExhaustedError
from ..pool.block_pool import FOLLOW, NULL_BLOCK, BlockPool, hash_block


class BlockTables:
    """The block tables of a batch: row `b` stores `num_tokens[b]` tokens in blocks `tables[b]`, in order.

    Token `j` of row `b` lives in block ``tables[b][j // block_size]`` at offset ``j % block_size``. Only real
    tokens are stored (no padding), so rows of a ragged batch hold different counts. A block can appear
    in several rows (or several caches) when shared; its reference count in the `BlockPool` says how many
    tables hold it, and a write into a shared, partly filled last block first copies it (copy-on-write).

    When a row's token ids are known (`token_ids[b]` is a list), each block it fills is registered in the
    pool's prefix index (`register_full_blocks`, once the forward that filled it is complete) under a key chained
    from `root` over all the row's tokens so far (`hashes[b]`). `root` stands for whatever else the contents
    depend on (the model that computed them); with `root=None` nothing is registered or looked up.

    A forward is all or nothing: `savepoint()` before it, then `rollback()` restores the tables and every
    reference count exactly, or `commit()` lets go of the blocks copied away from and registers new full blocks.

    Tables of a sliding-window layer group keep only the blocks their next queries can see: a block lying
    wholly before a row's `keep_from` token (given to `append`) is never taken if the forward writes it, and is
    given back when the forward commits. Its entry stays in the table as the null block, so token `j` keeps
    living at ``tables[b][j // block_size]``. Every slot of a held block is written (a forward writes its new
    tokens into every held block, even one it gives back at commit), so a full block is whole when it is
    registered; a row whose block would miss earlier tokens (one given back, then taken again after a
    `truncate`) is never registered again.
    """

    def __init__(self, blocks: BlockPool, root: bytes | None = None):
        self.blocks = blocks
        self.root = root
        self.drop_before: list[int] | None = None  # per row, the first token the forward in progress keeps
        self.tables: list[list[int]] = []
        self.num_tokens: list[int] = []
        self.token_ids: list[list[int] | None] = []  # the row's stored token ids, None once unknown
        self.hashes: list[list[bytes]] = []  # prefix key of each full block of the row
        self.copied_from: list[int] = []  # blocks the forward in progress copied away from, still held until commit

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    def add_rows(self, n: int) -> None:
        self.tables.extend([] for _ in range(n))
        self.num_tokens.extend([0] * n)
        self.token_ids.extend(([] if self.root is not None else None) for _ in range(n))
        self.hashes.extend([] for _ in range(n))

    def append(
        self,
        new_tokens: Sequence[int],
        token_ids: Sequence[Sequence[int] | None] | None = None,
        keep_from: Sequence[int] | None = None,
    ) -> list[tuple[int, int]]:
        """Make room for `new_tokens[b]` more tokens in each row; all or nothing.

        `token_ids[b]` are those tokens' ids when known and usable as a prefix key (for prefix caching); None
        (for a row, or for all) marks them unknown, and the row is never registered again. `keep_from[b]`
        (sliding windows): the row's first token still needed once the forward is done; blocks wholly before it
        are not taken (the new tokens there get no slot) and held ones are given back at `commit`.

        Returns the ``(src, dst)`` pairs of shared last blocks that were replaced by private copies: the caller
        must copy their contents. The sources stay held (`copied_from`) until `commit` or `rollback`. Raises
        `PoolExhaustedError`, with the tables and pool untouched, if the pool cannot supply every block.
        """
        size = self.blocks.block_size
        first = [0] * len(new_tokens) if keep_from is None else [k // size for k in keep_from]  # first kept block
        grow, copy_rows, reopen_rows = [], [], []
        for row, n in enumerate(new_tokens):
            table, stored = self.tables[row], self.num_tokens[row]
            end = -(-(stored + n) // size)  # ceil((stored + n) / size): the row's blocks after the forward
            grow.append(end - max(len(table), first[row]) if end > len(table) else 0)
            if n > 0 and stored % size:
                if table[-1] == NULL_BLOCK and len(table) - 1 >= first[row]:
                    reopen_rows.append(row)  # a partly filled block given back earlier: start a fresh one
                elif table[-1] != NULL_BLOCK and self._shared(table[-1]):
                    copy_rows.append(row)  # written even if the window drops it at commit: it must be whole
        grow = [max(g, 0) for g in grow]
        needed = sum(grow) + len(copy_rows) + len(reopen_rows)
        prefer = self._preferred_blocks(grow, len(copy_rows) + len(reopen_rows), set(copy_rows) | set(reopen_rows))
        new_ids = self.blocks.allocate(needed, prefer)
        if new_ids is None:
            raise PoolExhaustedError(needed, self.blocks.num_free, self.blocks.capacity, size)
        fresh = iter(new_ids)
        pairs = []
        for row in copy_rows:
            dst = next(fresh)
            pairs.append((self.tables[row][-1], dst))
            self.copied_from.append(self.tables[row][-1])
            self.tables[row][-1] = dst
        for row in reopen_rows:
            self.tables[row][-1] = next(fresh)
            self.token_ids[row] = None  # its earlier tokens in that block are written nowhere: never register it
        for row, n in enumerate(new_tokens):
            table = self.tables[row]
            end = -(-(self.num_tokens[row] + n) // size)
            table.extend(NULL_BLOCK for _ in range(len(table), min(first[row], end)))  # out of the window
            table.extend(next(fresh) for _ in range(grow[row]))
            self.num_tokens[row] += n
            known = self.token_ids[row]
            row_ids = token_ids[row] if token_ids is not None else None
            if known is not None and row_ids is not None and self.root is not None:
                known.extend(row_ids)
            else:
                self.token_ids[row] = None
        self.drop_before = list(keep_from) if keep_from is not None else None
        return pairs

    def _preferred_blocks(self, grow: Sequence[int], copies: int, replaced: set[int]) -> list[int | None]:
        """`BlockPool.allocate`'s ``prefer`` for `copies` replacement blocks (no preference), then each row's
        `grow` blocks one after the other from the block after its last (none for a row that starts empty, ends
        out of its window or has its last block `replaced`): its keys in consecutive slots where the pool allows."""
        if not any(grow):
            return []  # most decode steps: nothing to take
        prefer: list[int | None] = [None] * copies
        for row, count in enumerate(grow):
            if count:
                table = self.tables[row]
                last = table[-1] if table and row not in replaced else NULL_BLOCK
                prefer += [None if last == NULL_BLOCK else last + 1, *[FOLLOW] * (count - 1)]
        return prefer

    def _shared(self, block: int) -> bool:
        """Whether writing into `block` would change what someone else reads (then copy it first)."""
        return self.blocks.refcount(block) > 1 or self.blocks.is_cached(block)

    def register_full_blocks(self) -> None:
        """Make every full block of a row with known token ids findable by prefix (after its forward completed)."""
        for row, tokens in enumerate(self.token_ids):
            if tokens is not None:
                self._register_full_blocks(row)

    def boundaries(self) -> list[tuple[bytes, list[int]] | None]:
        """Per row, the prefix key and tokens of its last block when the row ends exactly at a registered block
        boundary (call after `register_full_blocks`), else None: where a row's per-sequence states can be kept
        as a snapshot of its prefix."""
        size = self.blocks.block_size
        found: list[tuple[bytes, list[int]] | None] = []
        for tokens, hashes, stored in zip(self.token_ids, self.hashes, self.num_tokens):
            at_boundary = tokens is not None and stored and stored % size == 0 and len(hashes) == stored // size
            found.append((hashes[-1], tokens[stored - size : stored]) if at_boundary else None)
        return found

    def _register_full_blocks(self, row: int) -> None:
        size, tokens, hashes = self.blocks.block_size, self.token_ids[row], self.hashes[row]
        for i in range(len(hashes), self.num_tokens[row] // size):
            chunk = tokens[i * size : (i + 1) * size]
            hashes.append(hash_block(hashes[-1] if hashes else self.root, chunk))
            if self.tables[row][i] != NULL_BLOCK:  # a sliding group's block that was never taken
                self.blocks.register(self.tables[row][i], hashes[-1], chunk)

    def savepoint(self) -> TablesSavepoint:
        """What `rollback` needs to restore the tables as they are now (O(blocks held) to take)."""
        return TablesSavepoint(
            tables=[list(t) for t in self.tables],
            num_tokens=list(self.num_tokens),
            token_ids=list(self.token_ids),
            token_counts=[0 if t is None else len(t) for t in self.token_ids],
            hashes=list(self.hashes),
        )

    def rollback(self, savepoint: TablesSavepoint) -> None:
        """Undo everything since `savepoint`: rows, blocks taken, copies made.

        Between the savepoint and the rollback, rows may be repeated or reordered (`select`) but not dropped,
        so every block of the savepoint is still held, by the current tables or as a copy source: holding
        them again first and then dropping the current holds restores each reference count exactly.
        """
        self.blocks.incref(_held(b for t in savepoint.tables for b in t))
        for table in self.tables:
            self.blocks.free(_held(reversed(table)))
        self.blocks.free(self.copied_from)
        self.copied_from, self.drop_before = [], None
        self.tables, self.num_tokens = savepoint.tables, savepoint.num_tokens
        self.token_ids, self.hashes = savepoint.token_ids, savepoint.hashes
        for tokens, count in zip(self.token_ids, savepoint.token_counts):
            if tokens is not None:
                del tokens[count:]  # a forward only appends to the lists it found

    def adopt_prefix(self, row: int, blocks: list[int], token_ids: Sequence[int]) -> None:
        """Start empty row `row` with already-held, full, cached `blocks` spelling `token_ids`."""
        self.tables[row] = list(blocks)
        self.num_tokens[row] = len(token_ids)
        self.token_ids[row] = list(token_ids)
        self.hashes[row] = []
        self._register_full_blocks(row)  # computes the keys; the blocks are registered already

    def copy_to(self, other: BlockTables) -> None:
        """Give `other` (empty, on the same pool and root) the same rows, sharing every block by reference count."""
        if other.blocks is not self.blocks or other.root != self.root or other.batch_size:
            raise ValueError("copy_to needs empty block tables on the same pool, with the same root")
        other.tables = [list(t) for t in self.tables]
        other.num_tokens = list(self.num_tokens)
        other.token_ids = [None if t is None else list(t) for t in self.token_ids]
        other.hashes = [list(h) for h in self.hashes]
        self.blocks.incref(_held(b for t in other.tables for b in t))

    def extend_from(self, other: BlockTables) -> None:
        """Append `other`'s rows (same pool and root) after these, each block held once more (shared)."""
        if other.blocks is not self.blocks or other.root != self.root:
            raise ValueError("extend_from needs block tables on the same pool, with the same root")
        self.blocks.incref(_held(b for t in other.tables for b in t))
        self.tables += [list(t) for t in other.tables]
        self.num_tokens += other.num_tokens
        self.token_ids += [None if t is None else list(t) for t in other.token_ids]
        self.hashes += [list(h) for h in other.hashes]

    def commit(self) -> None:
        """Finish a forward: drop the holds on the blocks copied away from, register the blocks it filled, and
        give back the blocks that fell out of a sliding window (registered ones stay findable by prefix)."""
        self.blocks.free(self.copied_from)
        self.copied_from = []
        self.register_full_blocks()
        if self.drop_before is not None:
            self.drop_blocks_before(self.drop_before)
            self.drop_before = None

    def drop_blocks_before(self, keep_from: Sequence[int]) -> None:
        """Give back each row's blocks that lie wholly before its token `keep_from[b]` (they become null entries)."""
        size = self.blocks.block_size
        for table, first in zip(self.tables, keep_from):
            end = min(first // size, len(table))
            dropped = [b for b in table[:end] if b != NULL_BLOCK]
            if dropped:
                table[:end] = [NULL_BLOCK] * end
                self.blocks.free(reversed(dropped))

    def first_held_token(self, row: int) -> int:
        """The first token of `row` that still has a block (0 unless a sliding window gave blocks back)."""
        table = self.tables[row]
        held = next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table))
        return min(held * self.blocks.block_size, self.num_tokens[row])

    def truncate(self, remove_tokens: Sequence[int]) -> None:
        """Forget the last `remove_tokens[b]` tokens of each row, freeing blocks no longer needed."""
        size = self.blocks.block_size
        for row, n in enumerate(remove_tokens):
            self.num_tokens[row] -= n
            keep = -(-self.num_tokens[row] // size)
            dropped = self.tables[row][keep:]
            del self.tables[row][keep:]
            self.blocks.free(_held(reversed(dropped)))
            del self.hashes[row][self.num_tokens[row] // size :]
            if self.token_ids[row] is not None:
                del self.token_ids[row][self.num_tokens[row] :]

    def select(self, rows: Sequence[int]) -> None:
        """Keep rows `rows` (repeats allowed, any order): blocks are shared, never copied."""
        tables = [list(self.tables[r]) for r in rows]
        num_tokens = [self.num_tokens[r] for r in rows]
        token_ids = [None if self.token_ids[r] is None else list(self.token_ids[r]) for r in rows]
        hashes = [list(self.hashes[r]) for r in rows]
        self.blocks.incref(_held(b for table in tables for b in table))
        for table in self.tables:
            self.blocks.free(_held(reversed(table)))
        self.tables, self.num_tokens, self.token_ids, self.hashes = tables, num_tokens, token_ids, hashes
        if self.drop_before is not None:
            self.drop_before = [self.drop_before[r] for r in rows]

    def release(self) -> None:
        """Give every block back (tail blocks first, then those of an unfinished copy) and forget all rows."""
        for table in self.tables:
            self.blocks.free(_held(reversed(table)))
        self.blocks.free(self.copied_from)
        self.copied_from, self.drop_before = [], None
        self.tables, self.num_tokens, self.token_ids, self.hashes = [], [], [], []

    def view(self) -> RowsView:
        """These rows as they are now (the lists themselves, not copies)."""
        return RowsView(self.tables, self.num_tokens, self.blocks.block_size)

    def unique_blocks(self) -> dict[int, int]:
        """Each block held, mapped to the tokens it holds (shared blocks counted once)."""
        return self.view().unique_blocks()

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """``[B, max_blocks]`` int64 block ids, short rows padded with the null block."""
        return self.view().as_tensor(device)


@dataclass(frozen=True)
class RowsView:
    """A read-only look at one layer group's rows: each row's block list and how many tokens it stores.

    What readers of a cache get (`PagedCache.block_tables`, `stats`): either the live lists, under the
    cache's lock, or copies (`copy`).
    """

    tables: list[list[int]]
    num_tokens: list[int]
    block_size: int

    @property
    def batch_size(self) -> int:
        return len(self.tables)

    def copy(self) -> RowsView:
        return RowsView([list(t) for t in self.tables], list(self.num_tokens), self.block_size)

    def unique_blocks(self) -> dict[int, int]:
        """Each block held, mapped to the tokens it holds (shared blocks counted once)."""
        size = self.block_size
        filled: dict[int, int] = {}
        for table, stored in zip(self.tables, self.num_tokens):
            for i, block in enumerate(table):
                if block != NULL_BLOCK:
                    filled[block] = max(filled.get(block, 0), min(size, stored - i * size))
        return filled

    def as_tensor(self, device: torch.device) -> torch.Tensor:
        """``[B, max_blocks]`` int64 block ids, short rows padded with the null block."""
        width = max(1, max((len(t) for t in self.tables), default=0))
        padded = [t + [NULL_BLOCK] * (width - len(t)) for t in self.tables]
        return torch.tensor(padded, dtype=torch.long, device=device)


def _held(blocks: Iterable[int]) -> Iterator[int]:
    """The real blocks among table entries (a sliding group's given-back blocks are null entries)."""
    return (b for b in blocks if b != NULL_BLOCK)


def slots_for_positions(table: torch.Tensor, is_real: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat pool slot of every logical position; padding positions map to the null block's first slot.

    Args:
        table: ``[B, max_blocks]`` block ids (`BlockTables.as_tensor`).
        is_real: ``[B, L]`` bool, True where a position holds a stored token (False for padding).
    Returns:
        ``[B, L]`` int64 slots ``block * block_size + offset``.
    """
    token = (is_real.cumsum(dim=1) - 1).clamp(min=0)  # [B, L] index of each position among its row's tokens
    block = table.gather(1, token // block_size)  # [B, L]
    slots = block * block_size + token % block_size  # [B, L]
    return slots.masked_fill(~is_real, NULL_BLOCK * block_size)


@dataclass
class TablesSavepoint:
    """The state of a `BlockTables` before a forward (see `BlockTables.savepoint`)."""

    tables: list[list[int]]  # copies of each row's block list
    num_tokens: list[int]
    token_ids: list[list[int] | None]  # the row lists themselves: a forward only appends to them
    token_counts: list[int]  # their lengths then
    hashes: list[list[bytes]]  # the row lists themselves: only `commit` appends to them

    def view(self, block_size: int) -> RowsView:
        """The rows as they were at the savepoint."""
        return RowsView(self.tables, self.num_tokens, block_size)
