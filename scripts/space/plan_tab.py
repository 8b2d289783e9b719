"""The Plan tab: KV memory planned from a config alone (`hf_paged_cache.planner`), no model run.

For the demo's model or a Hub id, it shows bytes per token and per block, and how many sequences of a shape
fit beside the weights with `DynamicCache`, `StaticCache` and `PagedCache`.
"""

from __future__ import annotations

import os
from typing import Any

import gradio as gr
from limits import (
    HUB_ID,
    MAX_HUB_ID_CHARS,
    MAX_MEMORY_CHARS,
    MAX_PLAN_BLOCK_SIZE,
    MAX_PLAN_LENGTHS_CHARS,
    MAX_PLAN_MEMORY,
    MAX_PLAN_ROWS,
    MAX_PLAN_TOKENS,
    PLAN_DTYPES,
    InputError,
    as_page_text,
    bounded_int,
    bounded_text,
    shown,
)
from transformers import PreTrainedModel

from hf_paged_cache import parse_memory
from hf_paged_cache.planner import format_plan, load_config, plan_memory, weights_of_model


def parse_plan_lengths(text: str | None, batch_size: float) -> list[int]:
    """One prompt length per row: ``"512"`` repeated `batch_size` times, or ``"300, 512, 80"`` (one per row,
    the list setting the batch size)."""
    text = bounded_text(text, "The prompt lengths box", MAX_PLAN_LENGTHS_CHARS)
    if not text:
        raise InputError("Enter a prompt length, or one per row separated by commas.")
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > MAX_PLAN_ROWS:
        raise InputError(f"At most {MAX_PLAN_ROWS} prompt lengths; got {len(parts)}.")
    lengths = [bounded_int(part, "Each prompt length", 1, MAX_PLAN_TOKENS) for part in parts]
    if len(lengths) == 1:
        return lengths * bounded_int(batch_size, "Batch size", 1, MAX_PLAN_ROWS)
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
    hub_id = bounded_text(hub_id, "The Hub model id", MAX_HUB_ID_CHARS)
    memory_text = bounded_text(max_memory, "Max memory", MAX_MEMORY_CHARS)
    lengths = parse_plan_lengths(prompt_lengths, batch_size)
    new_tokens = bounded_int(new_tokens, "New tokens", 0, MAX_PLAN_TOKENS)
    block_size = bounded_int(block_size, "Block size", 1, MAX_PLAN_BLOCK_SIZE)
    if dtype not in PLAN_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(PLAN_DTYPES)}; got {shown(dtype)}.")
    memory = parse_plan_memory(memory_text)
    config, weights, name = plan_target(model, model_name, hub_id, dtype)
    try:
        plan = plan_memory(config, prompt_lens=lengths, new_tokens=new_tokens, dtype=dtype, block_size=block_size,
                           max_memory=memory, weight_bytes=weights, model_name=name)
    except (ValueError, NotImplementedError) as error:
        raise InputError(f"Cannot plan {name!r}: {error}") from None
    return format_plan(plan)


def parse_plan_memory(text: str) -> int:
    """The "max memory" box (already bounded in characters) in bytes, from 1 byte to `MAX_PLAN_MEMORY`."""
    if not text:
        raise InputError("Enter the max memory for weights and KV cache, e.g. 24GiB.")
    try:
        memory = parse_memory(text)
    except (TypeError, ValueError) as error:
        raise InputError(f"Max memory: {error}.") from None
    if not 1 <= memory <= MAX_PLAN_MEMORY:
        raise InputError(f"Max memory must be between 1 byte and 1 PiB; got {text}.")
    return memory


def plan_target(model: PreTrainedModel, model_name: str, hub_id: str, dtype: str) -> tuple[Any, int | None, str]:
    """``(config, weight bytes or None, name)`` of what to plan: the Hub model `hub_id` (its ``config.json``
    only; never a local path), else the demo's `model` with its weights counted in `dtype`."""
    if not hub_id:
        weights = weights_of_model(model, dtype, "the demo's loaded model")
        return model.config, weights, model_name or model.config.model_type
    if not HUB_ID.fullmatch(hub_id) or ".." in hub_id or os.path.exists(hub_id):
        raise InputError(f"Enter a Hub model id such as 'meta-llama/Llama-2-7b-hf' (local paths are not "
                         f"read); got {hub_id!r}.")
    try:
        config = load_config(hub_id)  # the raw config.json is checked against CONFIG_LIMITS first
    except ValueError as error:
        raise InputError(f"Could not plan {hub_id!r}: {str(error).rstrip('.')}.") from None
    return config, None, hub_id


def build_plan_tab(model: PreTrainedModel, model_name: str, *, concurrency: int) -> None:
    """The Plan tab's inputs, button and plan, inside the caller's ``gr.Blocks`` (it opens on `model`'s plan)."""

    def on_plan(hub_id: str, batch_size: float, prompt_lengths: str, new_tokens: float, dtype: str,
                block_size: float, max_memory: str) -> str:
        try:
            return run_plan(model, model_name, hub_id=hub_id, batch_size=batch_size, prompt_lengths=prompt_lengths,
                            new_tokens=new_tokens, dtype=dtype, block_size=block_size, max_memory=max_memory)
        except InputError as error:
            raise gr.Error(as_page_text(error)) from None

    with gr.Tab("Plan", elem_id="tab-plan"):
        gr.Markdown("Plan KV memory from a model's config alone, before loading anything: bytes per token "
                    "and per block, and how many sequences of this shape fit beside the weights with "
                    "`DynamicCache`, `StaticCache` and `PagedCache` (`python -m hf_paged_cache.planner`).")
        with gr.Row():
            with gr.Column():
                hub_id = gr.Textbox(label="Hub model id (empty: this demo's model)",
                                    placeholder="e.g. meta-llama/Llama-2-7b-hf", elem_id="plan-hub-id")
                lengths = gr.Textbox(label="Prompt length, or one per row separated by commas "
                                     "(a list sets the batch size)", value="512", elem_id="plan-lengths")
                batch = gr.Number(32, label="Batch size", precision=0, minimum=1, maximum=MAX_PLAN_ROWS,
                                  elem_id="plan-batch")
                new = gr.Number(256, label="New tokens per row", precision=0, minimum=0, maximum=MAX_PLAN_TOKENS,
                                elem_id="plan-new-tokens")
            with gr.Column():
                dtype = gr.Radio(list(PLAN_DTYPES), value="bfloat16", label="dtype", elem_id="plan-dtype")
                block = gr.Number(16, label="PagedCache block size (tokens)", precision=0, minimum=1,
                                  maximum=MAX_PLAN_BLOCK_SIZE, elem_id="plan-block-size")
                memory = gr.Textbox(label="Max memory for weights + KV cache (e.g. 24GiB, 80GB)", value="24GiB",
                                    elem_id="plan-max-memory")
                run = gr.Button("Plan", variant="primary", elem_id="run-plan")
        output = gr.Markdown(run_plan(model, model_name), elem_id="plan-output")
        run.click(on_plan, [hub_id, batch, lengths, new, dtype, block, memory], output, concurrency_limit=concurrency)
