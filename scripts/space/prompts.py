"""Prompts as token ids and as a batch: the chat template, padding, the model's context, the blocks a batch may
take, and its common prefix prefilled once."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from limits import MAX_PROMPT_TOKENS, InputError
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import PagedCache

DEFAULT_PROMPTS = (
    "Hi!",
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, for a ten-year-old who loves science and asks many questions.",
)
DEFAULT_SYSTEM = (
    "You are a concise, friendly assistant in a demo of paged KV caches. Answer every question plainly and "
    "accurately in at most three short sentences."
)


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


def batch_rows(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str],
               system_prompt: str, max_new_tokens: int) -> list[list[int]]:
    """Each prompt's token ids, chat-templated with `system_prompt` (if any); `InputError` for a row too long."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    rows = [prompt_ids(tokenizer, [*system, {"role": "user", "content": p}]) for p in prompts]
    limit = min(MAX_PROMPT_TOKENS, context_length(model) - max_new_tokens)
    for i, row in enumerate(rows, start=1):
        if len(row) > limit:
            raise InputError(
                f"Prompt {i} is {len(row)} tokens with the chat template and system prompt; the limit is {limit}."
            )
    return rows


def left_padded(rows: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` as one left-padded batch: ``(input_ids, attention_mask)``, both ``[rows, longest]``."""
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros_like(input_ids)  # [B, S]
    for i, row in enumerate(rows):  # left padding, then the row's tokens
        input_ids[i, width - len(row) :] = torch.tensor(row)
        attention_mask[i, width - len(row) :] = 1
    return input_ids, attention_mask


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
