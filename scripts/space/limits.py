"""The Space's bounds: pool sizes, concurrency, and the size of every input, checked before anything is tokenized.

A 10 MB system prompt would otherwise take seconds to tokenize just to be refused, so each text input is
measured in characters first (`bounded_text`), numbers are parsed with a bound on their text (`bounded_int`),
and inputs echoed back in a message are cut short (`shown`). `InputError` carries the message the page shows.
"""

from __future__ import annotations

import html
import re
from typing import Any

BLOCK_SIZES: tuple[int, ...] = (8, 16, 32)
"""Block sizes a batch may pick; the app keeps one shared pool for each."""

CHAT_BLOCK_SIZE = 16
"""Block size of the pool the chat tab uses."""

DEFAULT_NUM_BLOCKS = 256
"""Blocks in each shared pool (block 0 is the reserved null block)."""

KV_DTYPES: tuple[str | None, ...] = (None, "int8")
"""How the Batch tab's pools may store keys and values: as the model computes them, or int8 (in the same bytes)."""

DEFAULT_CONCURRENCY = 4
"""Requests of each tab that Gradio runs at once (they share the pools)."""

DEFAULT_QUEUE_SIZE = 64
"""Requests Gradio's own queue holds before it answers "queue full" (bounds the server's memory)."""

MAX_WAITING = 8
"""Requests that may wait for blocks in one pool's `WaitingLine` at once; the next one is told the pool is full."""

MAX_WAIT_S = 30.0
"""Longest a request waits in a `WaitingLine` for its blocks before it is told the pool is full."""

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


class InputError(ValueError):
    """A request outside the app's bounds; its message is shown to the user as is."""


def bounded_int(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an int in ``[low, high]``, else `InputError` naming `name`."""
    try:
        if isinstance(value, str) and len(value) > 40:
            raise ValueError("too long for a number")
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InputError(f"{name} must be a number; got {shown(value)}.") from None
    if not number.is_integer() or not low <= number <= high:
        raise InputError(f"{name} must be a whole number from {low} to {high}; got {shown(value)}.")
    return int(number)


def bounded_text(value: Any, name: str, limit: int) -> str:
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


def shown(value: Any, limit: int = 40) -> str:
    """`repr(value)`, cut to about `limit` characters: inputs are echoed in messages, never in full."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def plural(count: int, noun: str) -> str:
    """``plural(1, "block") -> "1 block"``, ``plural(2, "block") -> "2 blocks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def as_page_text(message: object) -> str:
    """`message` (text or an exception) made safe to show in the page: Gradio renders toasts (`gr.Error`,
    `gr.Warning`, `gr.Info`) and Markdown as HTML, and messages quote user input and exceptions, so ``<``,
    ``>``, ``&`` and quotes are escaped and read as the characters they are."""
    return html.escape(str(message))
