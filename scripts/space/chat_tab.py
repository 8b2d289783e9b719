"""The Chat tab: a multi-turn chat whose every turn takes the earlier turns' blocks with `reuse_prefix`.

Each turn runs on a fresh `PagedCache` over the chat's shared pool, so only the new tokens are computed; the
page shows per turn the tokens reused, the tokens computed and the time to first token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gradio as gr
import torch
from limits import (
    MAX_CHAT_CHARS,
    MAX_CHAT_MESSAGE_CHARS,
    MAX_CHAT_TOKENS,
    MAX_NEW_TOKENS,
    MAX_SYSTEM_CHARS,
    InputError,
    as_page_text,
    bounded_int,
    bounded_text,
)
from prompts import DEFAULT_SYSTEM, blocks_needed, context_length, pad_token_id, prompt_ids
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from waiting_line import PoolFullError, WaitingLine, pool_full_message

from hf_paged_cache import PagedCache, PoolExhaustedError
from hf_paged_cache.bench import FirstTokenTimer


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
    message = bounded_text(message, "The message", MAX_CHAT_MESSAGE_CHARS)
    if not message:
        raise InputError("Type a message first.")
    system_prompt = bounded_text(system_prompt, "The system prompt", MAX_SYSTEM_CHARS)
    history = _chat_history(history)
    characters = len(system_prompt) + len(message) + sum(len(m["content"]) for m in history)
    if characters > MAX_CHAT_CHARS:
        raise InputError(
            f"The conversation has {characters:,} characters; the limit is {MAX_CHAT_CHARS:,}. Press Clear to start "
            "a new one."
        )
    max_new_tokens = bounded_int(max_new_tokens, "max_new_tokens", 1, MAX_NEW_TOKENS)
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


def build_chat_tab(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, line: WaitingLine, *,
                   concurrency: int, on_wait: Callable[[str], None]) -> None:
    """The Chat tab's conversation, inputs and buttons, inside the caller's ``gr.Blocks``; turns use `line`."""
    block_size = line.pool.block_size

    def on_chat(message: str | None, history: list[dict[str, str]] | None, turns: list[ChatTurn] | None,
                system_prompt: str | None, max_new_tokens: float
                ) -> tuple[list[dict[str, str]], list[ChatTurn], str, str, list[dict[str, str]]]:
        history, turns = list(history or []), list(turns or [])
        try:
            turn = run_chat_turn(model, tokenizer, line, history, message, system_prompt=system_prompt,
                                 max_new_tokens=max_new_tokens, on_wait=on_wait)
        except InputError as error:
            raise gr.Error(as_page_text(error)) from None
        except (PoolFullError, PoolExhaustedError) as error:
            gr.Warning(as_page_text(pool_full_message(error)))
            return history, turns, message or "", chat_stats_markdown(turns, block_size), history
        history = [*history, {"role": "user", "content": str(message).strip()},
                   {"role": "assistant", "content": turn.answer}]
        turns = [*turns, turn]
        return history, turns, "", chat_stats_markdown(turns, block_size), history

    def on_clear() -> tuple[list[dict[str, str]], list[ChatTurn], str, list[dict[str, str]]]:
        return [], [], chat_stats_markdown([], block_size), []

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
            chat_system = gr.Textbox(label="System prompt", value=DEFAULT_SYSTEM, scale=3, elem_id="chat-system")
            chat_max_new = gr.Slider(1, MAX_NEW_TOKENS, value=64, step=1, label="max_new_tokens", scale=2,
                                     elem_id="chat-max-new")
        chat_stats = gr.Markdown(chat_stats_markdown([], block_size), elem_id="chat-stats")
        chat_inputs = [text, history, turns, chat_system, chat_max_new]
        chat_outputs = [history, turns, text, chat_stats, chatbot]
        send.click(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency, concurrency_id="chat")
        text.submit(on_chat, chat_inputs, chat_outputs, concurrency_limit=concurrency, concurrency_id="chat")
        clear.click(on_clear, None, [history, turns, chat_stats, chatbot])
