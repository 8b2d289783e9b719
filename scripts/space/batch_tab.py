"""The Batch tab: several prompts as one ragged `generate` batch on a `PagedCache` over a shared pool.

The page then shows each row's answer, the pool as the batch held it (`pool_view.draw_pool_grid`) and the KV
bytes it reserved and used beside `DynamicCache` and `StaticCache` on the same batch.
"""

from __future__ import annotations

import html
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr
import torch
from limits import (
    MAX_NEW_TOKENS,
    MAX_PROMPT_CHARS,
    MAX_PROMPTS,
    MAX_PROMPTS_TEXT_CHARS,
    MAX_SYSTEM_CHARS,
    InputError,
    as_page_text,
    bounded_int,
    bounded_text,
    plural,
)
from pool_view import (
    ROW_COLORS,
    MemoryRow,
    PoolSnapshot,
    compare_memory,
    draw_memory_chart,
    draw_pool_grid,
    format_bytes,
)
from prompts import (
    DEFAULT_PROMPTS,
    DEFAULT_SYSTEM,
    batch_rows,
    blocks_needed,
    context_length,
    left_padded,
    pad_token_id,
    prefill_sharing_prefix,
    shared_prefix_length,
)
from shared_pools import SharedPools, capacities, kv_label
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from waiting_line import PoolFullError, pool_full_message

from hf_paged_cache import KVPool, PagedCache, PoolExhaustedError
from hf_paged_cache.bench import static_cache_reserved_bytes


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
    text = bounded_text(text, "The prompts box", MAX_PROMPTS_TEXT_CHARS)
    prompts = [line.strip() for line in text.splitlines() if line.strip()]
    if not prompts:
        raise InputError("Enter at least one prompt (one per line).")
    if len(prompts) > MAX_PROMPTS:
        raise InputError(f"At most {MAX_PROMPTS} prompts per batch; got {len(prompts)}.")
    for i, prompt in enumerate(prompts, start=1):
        if len(prompt) > MAX_PROMPT_CHARS:
            raise InputError(f"Prompt {i} has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}.")
    return prompts


def run_batch(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pools: SharedPools, prompts_text: str, *,
              system_prompt: str = "", max_new_tokens: float = 48, block_size: float = 16, block_budget: float = 64,
              share_prefix: bool = True, kv_dtype: str | None = None,
              on_wait: Callable[[str], None] | None = None) -> BatchResult:
    """Run the prompts as one ragged batch through `generate` with a `PagedCache` on the shared pool.

    Each prompt is chat-templated (with `system_prompt` if given). With `share_prefix`, the whole blocks at
    the start that every row has in common (the system prompt) are prefilled once and every row shares their
    blocks rather than copying them (`prefill_sharing_prefix`); the answers are those of the unshared batch,
    sliding-window models included. `kv_dtype` picks the pool (keys and values as the model computes them, or
    int8 in a pool of the same bytes holding more blocks). The request is admitted only if its worst case
    (`blocks_needed`) fits `block_budget`; it then waits in the pool's `WaitingLine` until those blocks are
    free (`on_wait(message)` is called if it has to wait).

    Raises:
        InputError: for inputs out of bounds (the message says which and why); text is measured before it
            is tokenized.
        PoolFullError: when the request cannot get its blocks from the waiting line (nothing was taken).
        PoolExhaustedError: when the pool still runs out while it runs (blocks taken outside the line); the
            pool is left unchanged and this request's blocks are given back.
    """
    prompts = parse_prompts(prompts_text)
    system_prompt = bounded_text(system_prompt, "The system prompt", MAX_SYSTEM_CHARS)
    max_new_tokens = bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
    line = pools.line(bounded_int(block_size, "Block size", 1, 1 << 20), kv_dtype)  # InputError unless offered
    pool, block_size = line.pool, line.pool.block_size
    block_budget = bounded_int(block_budget, "Block budget", 1, pool.blocks.capacity)
    rows = batch_rows(model, tokenizer, prompts, system_prompt, max_new_tokens)
    shared = shared_prefix_length(rows, block_size) if share_prefix else 0
    needed = blocks_needed([len(r) for r in rows], max_new_tokens, block_size, shared)
    if needed > block_budget:
        raise InputError(
            f"This batch may need up to {needed} blocks of {block_size} tokens, more than its budget of "
            f"{block_budget}. Raise the block budget, or use fewer prompts or fewer new tokens."
        )

    pad = pad_token_id(tokenizer)
    input_ids, attention_mask = left_padded(rows, pad)
    queued = time.perf_counter()
    with line.admit(needed, on_wait), PagedCache(model, pool=pool) as cache:
        start = time.perf_counter()
        if shared:
            prefill_sharing_prefix(model, cache, rows, shared)
        output = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                                max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        snapshot = PoolSnapshot.take(cache)
        stats = cache.stats()
    seconds = time.perf_counter() - start

    generated = output[:, input_ids.shape[1] :]
    outputs, new_tokens = answers(model, tokenizer, generated)
    memory = compare_memory(paged_reserved=stats.bytes_reserved, paged_used=stats.bytes_used,
                            prompt_lengths=[len(r) for r in rows], generated_steps=generated.shape[1],
                            max_new_tokens=max_new_tokens, config=model.config, dtype=model.dtype)
    full_static = static_cache_reserved_bytes(model.config, context_length(model), len(rows), model.dtype)
    return BatchResult(tuple(prompts), outputs, tuple(len(r) for r in rows), tuple(new_tokens), shared,
                       snapshot, tuple(memory), full_static, seconds, waited_s=start - queued)


def answers(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
            generated: torch.Tensor) -> tuple[tuple[str, ...], list[int]]:
    """Each row's answer (decoded up to and including its first EOS) and how many tokens that is."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    new_tokens = []
    for row in generated.tolist():
        ends = [j for j, token in enumerate(row) if token in eos_ids]
        new_tokens.append(ends[0] + 1 if ends else len(row))
    outputs = tuple(str(tokenizer.decode(row[:n], skip_special_tokens=True)).strip()
                    for row, n in zip(generated.tolist(), new_tokens, strict=True))
    return outputs, new_tokens


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
        f"{plural(result.shared_tokens // result.snapshot.block_size, 'block')} holding them "
        f"{'is' if result.shared_tokens == result.snapshot.block_size else 'are'} shared by all rows."
        if result.shared_tokens else ""
    )
    return (
        f"**KV memory for this batch** ({len(result.prompts)} rows, {result.seconds:.1f} s)\n\n"
        "| cache | reserved | used | utilization | wasted |\n|---|---|---|---|---|\n"
        f"{rows}\n\n"
        f"PagedCache utilization: **{paged.utilization:.1%}**, in "
        f"{paged.reserved_bytes // pool.bytes_per_block} blocks of {pool.block_size} tokens "
        f"({format_bytes(pool.bytes_per_block)} each, keys and values stored as {pool.kv_format.description})."
        f"{shared} "
        f"The shared pool ({pool.num_blocks} blocks, {format_bytes(pool.num_blocks * pool.bytes_per_block)}, "
        f"**{pool.blocks.capacity * pool.block_size:,} tokens**) is allocated once for all sessions; "
        f"{pool.blocks.num_free} of its {pool.blocks.capacity} blocks are free now. DynamicCache pads every row "
        "to the longest; StaticCache is sized to the longest prompt + max_new_tokens (sized to the model's whole "
        f"context, it would reserve {format_bytes(result.static_full_context_bytes)})."
    )


def batch_page(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pools: SharedPools,
               inputs: Sequence[Any], on_wait: Callable[[str], None]) -> tuple[str, str, Any, Any, str]:
    """The Batch tab's answer to its inputs (see `build_batch_tab`): status, outputs, pool grid, memory chart
    and numbers. Input errors are raised as `gr.Error`; a full pool is a warning and an empty page."""
    prompts_text, system_prompt, max_new_tokens, block_size, block_budget, share_prefix, kv_dtype = inputs
    try:
        result = run_batch(model, tokenizer, pools, prompts_text, system_prompt=system_prompt,
                           max_new_tokens=max_new_tokens, block_size=block_size, block_budget=block_budget,
                           share_prefix=bool(share_prefix), kv_dtype=kv_dtype or None, on_wait=on_wait)
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


def build_batch_tab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, pools: SharedPools, *,
                    concurrency: int, on_wait: Callable[[str], None]) -> None:
    """The Batch tab's inputs, outputs and its button, inside the caller's ``gr.Blocks``."""
    default_size = 16 if 16 in pools.block_sizes else pools.block_sizes[0]
    capacity = max(pools.pool(default_size, kv).blocks.capacity for kv in pools.kv_dtypes)

    def on_batch(prompts_text: str | None, system_prompt: str | None, max_new_tokens: float, block_size: int,
                 block_budget: float, share_prefix: bool | None, kv_dtype: str | None = None
                 ) -> tuple[str, str, Any, Any, str]:
        inputs = (prompts_text, system_prompt, max_new_tokens, block_size, block_budget, share_prefix, kv_dtype)
        return batch_page(model, tokenizer, pools, inputs, on_wait)

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
                                         f"(usable: {capacities(pools, default_size)})",
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
