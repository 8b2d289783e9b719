"""The scheduler's rules for starting and preempting requests, each a question about one request and the pool.

Whether a request may start at all (`never_fits`), whether it should wait for a prefix another request is
computing (`waits_for_prefix`), whether it fits now without reservation (`fits_with_headroom`; with
reservation, `admission.pool_holds`), whether a running request can never grow (`fills_a_group`), where a
prompt chunk of a model with states ends (`snapshot_chunk_end`), and which cached prefix a request starts from
(`start_from_prefix`; a request that asks for its prompt's log-probabilities, `start_from_scores`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch

from ..errors import PoolExhaustedError

if TYPE_CHECKING:
    from ..cache.paged_cache import PagedCache
    from ..pool.kv_pool import KVPool
    from .prompt_scores import PromptScores
    from .request import Request


def blocks_needed(pool: KVPool, num_tokens: int) -> list[int]:
    """Per layer group of `pool`, the blocks one row of `num_tokens` tokens holds."""
    return [group.max_blocks_per_row(num_tokens, pool.block_size) for group in pool.layer_groups]


def never_fits(pool: KVPool, needed: Sequence[int]) -> PoolExhaustedError | None:
    """The error for a request that needs `needed` blocks per group when, in some fixed group, that is more
    than the whole group (it could never run); None when every group could hold it."""
    for n, blocks, group in zip(needed, pool.groups, pool.layer_groups):
        if blocks.max_blocks is not None and n > blocks.capacity:
            name = group.name if len(pool.groups) > 1 else None
            return PoolExhaustedError(n, blocks.num_free, blocks.capacity, blocks.block_size, name)
    return None


def larger_than_pool(error: PoolExhaustedError) -> bool:
    """Whether a forward that ran out of blocks asked for more than its whole (fixed) pool: it could never run.
    (Admission checks a prompt against the decoder's pool; an encoder-decoder request's cross-attention is known
    only once its encoder ran.)"""
    return error.needed > error.total


def fits_with_headroom(pool: KVPool, needed: Sequence[int], in_flight: int) -> bool:
    """Whether `needed` blocks per group fit now with one block of headroom for each of `in_flight` requests
    (the requests in flight and the one to start): admission without reservation."""
    return all(blocks.can_allocate(n + in_flight) for n, blocks in zip(needed, pool.groups))


def waits_for_prefix(tokens: list[int], prefilling: Iterable[tuple[list[int], int]], block_size: int) -> bool:
    """Whether a prompt of `tokens` starts with full blocks that a prefilling request (its tokens, and how many
    it has computed) is computing and the pool has not cached yet: starting now would compute them a second
    time, when the prefix cache holds them a few steps later."""
    usable = (len(tokens) - 1) // block_size  # a prefix hit leaves at least one token to compute
    return any(
        common_full_blocks(tokens, other, usable, block_size) > done // block_size for other, done in prefilling
    )


def fills_a_group(pool: KVPool, cache: PagedCache) -> bool:
    """Whether `cache`'s own blocks are all a fixed layer group of `pool` holds (nothing anyone frees would help)."""
    return any(
        blocks.max_blocks is not None and len(tables.unique_blocks()) >= blocks.capacity
        for tables, blocks in zip(cache.batch.groups, pool.groups)
    )


def common_full_blocks(a: list[int], b: list[int], limit: int, size: int) -> int:
    """How many of the first `limit` blocks of `size` tokens `a` and `b` have in common, whole and in order."""
    for i in range(min(limit, len(b) // size)):
        if a[i * size : (i + 1) * size] != b[i * size : (i + 1) * size]:
            return i
    return min(limit, len(b) // size)


def snapshot_chunk_end(done: int, end: int, length: int, block_size: int) -> int:
    """Where the prompt chunk from `done` to at most `end` ends on a model with conv / recurrent states, whose
    states are kept as a snapshot only where a forward ends at a block boundary (`RowStates`): at the prompt's
    last block boundary before its end when the chunk would pass it (so a later prompt that repeats this one
    starts from there), else, short of the prompt's end, at the last block boundary in it, if any."""
    end = min(end, length)
    last = (length - 1) // block_size * block_size  # the last boundary that leaves a token to compute
    if done < last < end:
        return last
    if end < last and end // block_size * block_size > done:
        return end // block_size * block_size
    return end


def start_from_prefix(cache: PagedCache, request: Request) -> int:
    """Fill `request`'s empty `cache` with the longest prefix of its tokens the pool holds (keyed as its blocks
    are: `Request.key_tokens`) and return its length; for a request with images, one that holds all of them or
    none (`MediaInput.reusable`)."""
    tokens = request.key_tokens
    done = cache.reuse_prefix(torch.tensor([tokens]))
    allowed = done if request.media is None else request.media.reusable(done)
    if allowed < done:
        cache.release()
        done = cache.reuse_prefix(torch.tensor([tokens[: allowed + 1]])) if allowed else 0
    return done


def starts_from_cache(request: Request, scores: PromptScores | None) -> bool:
    """Whether `request` starts from the pool's prefix cache: unless its prompt's log-probabilities are asked for
    (cached blocks hold keys and values, not logits), or, when they are, `scores` may hold them (`reuses_scores`)."""
    return request.takes_cached_prefix or reuses_scores(request, scores)


def start_from_cache(cache: PagedCache, request: Request, scores: PromptScores | None) -> int:
    """Fill `request`'s empty `cache` with what the pool has cached of its tokens (`start_from_prefix`, or, when its
    prompt's log-probabilities are asked for, `start_from_scores`) and return how many positions it starts from."""
    if request.takes_cached_prefix:
        return start_from_prefix(cache, request)
    return start_from_scores(cache, request, scores) if reuses_scores(request, scores) else 0


def reuses_scores(request: Request, scores: PromptScores | None) -> bool:
    """Whether `request` may start from the prompt log-probabilities `scores` holds: it asks for them (and has not
    all) and reads no images (its blocks are keyed by their digests too). A batcher whose model keeps states, which
    cannot be cut back one position, has no `scores`."""
    return scores is not None and request.needs_prompt_logprobs and request.media is None


def start_from_scores(cache: PagedCache, request: Request, scores: PromptScores) -> int:
    """Fill `request`'s empty `cache` with the longest prefix of its prompt whose keys and values the pool holds and
    whose log-probabilities `scores` holds, record those, and return how many positions it starts from: the prefix
    less its last position, which is computed again (its logits give the next token's log-probability)."""
    known = scores.lookup(request.prompt, request.prompt_logprobs_k)  # tokens 1 .. len(known)
    if not known:
        return 0
    done = cache.reuse_prefix(torch.tensor([request.prompt[: len(known) + 2]]))  # whole blocks, at most len(known) + 1
    if done == 0:
        return 0
    cache.crop(-1)
    request.add_prompt_logprobs(known[: done - 1], first=1)
    return done - 1

