"""The page: its header and the three tabs around one model and the shared pools, behind Gradio's queue."""

from __future__ import annotations

import gradio as gr
from batch_tab import build_batch_tab
from chat_tab import build_chat_tab
from limits import (
    CHAT_BLOCK_SIZE,
    DEFAULT_CONCURRENCY,
    DEFAULT_NUM_BLOCKS,
    DEFAULT_QUEUE_SIZE,
    MAX_WAIT_S,
    as_page_text,
)
from plan_tab import build_plan_tab
from shared_pools import SharedPools
from transformers import PreTrainedModel, PreTrainedTokenizerBase


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
    with gr.Blocks(title="hf_paged_cache: a paged KV cache for transformers") as demo:
        gr.Markdown(
            "# hf_paged_cache: a paged KV cache for Hugging Face transformers\n"
            "`PagedCache` stores keys and values in fixed-size blocks of one shared pool, so a ragged batch "
            "reserves memory for its real tokens only, rows can share blocks, and later requests can reuse "
            f"cached prefixes. Model: `{model_name or model.config.model_type}` on "
            f"{str(model.device).upper()}; every session shares the same pools "
            f"({pools.num_blocks} blocks each)."
        )
        build_batch_tab(model, tokenizer, pools, concurrency=concurrency, on_wait=show_waiting)
        build_chat_tab(model, tokenizer, chat_line, concurrency=concurrency, on_wait=show_waiting)
        build_plan_tab(model, model_name, concurrency=concurrency)
    demo.queue(max_size=queue_size, default_concurrency_limit=concurrency)
    return demo


def show_waiting(message: str) -> None:
    """Tell the page a request is waiting in a pool's `WaitingLine` (a toast for as long as it may wait)."""
    gr.Info(as_page_text(message), duration=MAX_WAIT_S, title="Waiting for KV blocks")
