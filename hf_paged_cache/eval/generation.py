"""Greedy generation through `DynamicCache` and `PagedCache`, compared token for token.

:func:`compare_generation` runs the same left-padded ragged batches of prompts twice with
``model.generate(do_sample=False)``, once with a fresh `DynamicCache` per batch and once with a fresh
`PagedCache` per batch, and reports how many prompts produced identical generated token ids (which must be
all of them in float32), the first divergence if any, the largest logit difference seen while both runs
still agreed, and the memory each cache held when its batch finished.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..cache.paged_cache import PagedCache
from ..engine.batcher import ContinuousBatcher
from .perplexity import cache_bytes, num_blocks_for

__all__ = [
    "BatchMemory",
    "Divergence",
    "GenerationComparison",
    "compare_generation",
    "encode_prompts",
    "left_pad",
]


@dataclass(frozen=True)
class Divergence:
    """Where paged generation first differed from dynamic generation."""

    prompt_index: int
    position: int  # index among the generated tokens
    dynamic_token: int | None  # None when that run had already stopped
    paged_token: int | None


@dataclass(frozen=True)
class BatchMemory:
    """K/V memory each cache held at the end of one batch's generation."""

    prompt_indices: list[int]
    padded_length: int  # prompt tokens per row after left padding
    dynamic_bytes: int  # bytes of the DynamicCache's key and value tensors (padding included)
    paged_bytes_reserved: int  # PagedCache.stats().bytes_reserved
    paged_bytes_used: int  # PagedCache.stats().bytes_used
    paged_pool_bytes: int  # storage the paged pool allocated: sum over rows of ceil((prompt + new) / block) + 1 blocks


@dataclass
class GenerationComparison:
    """Outcome of :func:`compare_generation` (byte totals are sums over batches)."""

    prompts: int
    exact_matches: int
    exact_match_rate: float
    tokens_compared: int
    tokens_matching: int
    first_divergence: Divergence | None
    max_abs_logit_diff: float  # over the steps before the first divergence of each batch
    dynamic_bytes: int
    paged_bytes_reserved: int
    paged_bytes_used: int
    dynamic_seconds: float  # wall-clock time of the generate() calls
    paged_seconds: float
    dynamic_cpu_seconds: float  # CPU time of this process in them (steadier on a shared machine)
    paged_cpu_seconds: float
    batches: list[BatchMemory] = field(default_factory=list)
    dynamic_tokens: list[list[int]] = field(default_factory=list)  # generated ids per prompt
    paged_tokens: list[list[int]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompts: Sequence[str], use_chat_template: bool | None = None
) -> list[list[int]]:
    """Token ids of each prompt, as a single user turn of the chat template when there is one.

    Args:
        use_chat_template: ``None`` uses the template if ``tokenizer.chat_template`` is set.
    """
    if use_chat_template is None:
        use_chat_template = bool(getattr(tokenizer, "chat_template", None))
    encoded: list[list[int]] = []
    for prompt in prompts:
        if use_chat_template:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            encoded.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
        else:
            encoded.append(list(tokenizer(prompt)["input_ids"]))
    return encoded


def left_pad(prompts: Sequence[Sequence[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids [B, T]`` and ``attention_mask [B, T]`` of the prompts, left-padded to the longest."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T]
    for row, prompt in enumerate(prompts):
        if prompt:
            input_ids[row, width - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
    return input_ids, attention_mask


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    for position in range(max(len(a), len(b))):
        left = a[position] if position < len(a) else None
        right = b[position] if position < len(b) else None
        if left != right:
            return position
    return None


def compare_generation(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    *,
    pad_token_id: int,
    batch_size: int = 4,
    max_new_tokens: int = 32,
    block_size: int = 16,
    progress: bool = False,
) -> GenerationComparison:
    """Generate greedily for each batch with `DynamicCache`, then with `PagedCache`, and compare.

    Prompts are taken in the given order, `batch_size` at a time, left-padded with `pad_token_id`.
    Generated ids are the tokens after the padded prompt (rows that stopped early are padded by
    ``generate`` with `pad_token_id` in both runs alike).  Exact match means identical generated ids.

    Args:
        model: a causal LM in eval mode.
        prompts: token ids of each prompt (e.g. from :func:`encode_prompts`); none may be empty.
        pad_token_id: padding id for the prompts and for ``generate``.
        batch_size: prompts per batch.
        max_new_tokens: tokens to generate per prompt.
        block_size: tokens per `PagedCache` block.
        progress: show a tqdm bar over the runs (two per batch: dynamic, then paged).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("need at least one prompt, and no empty prompt")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    device = next(model.parameters()).device
    gen_kwargs: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "pad_token_id": pad_token_id,
        "output_scores": True,
        "return_dict_in_generate": True,
    }
    dynamic_tokens: list[list[int]] = []
    paged_tokens: list[list[int]] = []
    batches: list[BatchMemory] = []
    max_diff = 0.0
    dynamic_seconds = paged_seconds = dynamic_cpu = paged_cpu = 0.0
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=2 * -(-len(prompts) // batch_size), desc="generate (dynamic, paged)", unit="run")
    for first in range(0, len(prompts), batch_size):
        indices = list(range(first, min(first + batch_size, len(prompts))))
        input_ids, attention_mask = left_pad([prompts[i] for i in indices], pad_token_id)  # [B, T] each
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        width = input_ids.shape[1]

        with torch.no_grad():
            start, start_cpu = time.perf_counter(), time.process_time()
            dynamic = DynamicCache(config=model.config)
            reference = model.generate(  # type: ignore[operator]  # nn.Module.__getattr__ confuses mypy
                input_ids=input_ids, attention_mask=attention_mask, cache=dynamic, **gen_kwargs
            )
            dynamic_seconds += time.perf_counter() - start
            dynamic_cpu += time.process_time() - start_cpu
            dynamic_bytes = cache_bytes(dynamic)
            del dynamic
            if bar is not None:
                bar.update()

            start, start_cpu = time.perf_counter(), time.process_time()
            # Each row needs blocks for its own real tokens only (+1 spare): padding takes none.
            num_blocks = 1 + sum(
                num_blocks_for(1, len(prompts[i]) + max_new_tokens, block_size, spare_per_row=1) - 1 for i in indices
            )
            with PagedCache(model, block_size=block_size, num_blocks=num_blocks) as paged_cache:
                paged = model.generate(  # type: ignore[operator]
                    input_ids=input_ids, attention_mask=attention_mask, cache=paged_cache, **gen_kwargs
                )
                paged_seconds += time.perf_counter() - start
                paged_cpu += time.process_time() - start_cpu
                stats = paged_cache.stats()
                pool_bytes = paged_cache.pool.storage_bytes()
            if bar is not None:
                bar.update()

        ref_new = reference.sequences[:, width:].tolist()  # [B, new]
        paged_new = paged.sequences[:, width:].tolist()  # [B, new]
        dynamic_tokens.extend(ref_new)
        paged_tokens.extend(paged_new)

        agreeing_steps = min(len(reference.scores), len(paged.scores))
        for row_ref, row_paged in zip(ref_new, paged_new):
            diff = _first_difference(row_ref, row_paged)
            if diff is not None:
                agreeing_steps = min(agreeing_steps, diff + 1)  # the diverging step's logits still count
        for step in range(agreeing_steps):
            step_diff = (reference.scores[step].float() - paged.scores[step].float()).abs()  # [B, V]
            finite = torch.isfinite(step_diff)
            if bool(finite.any()):
                max_diff = max(max_diff, float(step_diff[finite].max()))

        batches.append(
            BatchMemory(
                prompt_indices=indices,
                padded_length=width,
                dynamic_bytes=dynamic_bytes,
                paged_bytes_reserved=stats.bytes_reserved,
                paged_bytes_used=stats.bytes_used,
                paged_pool_bytes=pool_bytes,
            )
        )

    if bar is not None:
        bar.close()
    exact = 0
    compared = matching = 0
    divergence: Divergence | None = None
    for index, (ref_row, paged_row) in enumerate(zip(dynamic_tokens, paged_tokens)):
        diff = _first_difference(ref_row, paged_row)
        compared += max(len(ref_row), len(paged_row))
        matching += sum(1 for a, b in zip(ref_row, paged_row) if a == b)
        if diff is None:
            exact += 1
        elif divergence is None:
            divergence = Divergence(
                prompt_index=index,
                position=diff,
                dynamic_token=ref_row[diff] if diff < len(ref_row) else None,
                paged_token=paged_row[diff] if diff < len(paged_row) else None,
            )
    return GenerationComparison(
        prompts=len(prompts),
        exact_matches=exact,
        exact_match_rate=exact / len(prompts),
        tokens_compared=compared,
        tokens_matching=matching,
        first_divergence=divergence,
        max_abs_logit_diff=max_diff,
        dynamic_bytes=sum(b.dynamic_bytes for b in batches),
        paged_bytes_reserved=sum(b.paged_bytes_reserved for b in batches),
        paged_bytes_used=sum(b.paged_bytes_used for b in batches),
        dynamic_seconds=dynamic_seconds,
        paged_seconds=paged_seconds,
        dynamic_cpu_seconds=dynamic_cpu,
        paged_cpu_seconds=paged_cpu,
        batches=batches,
        dynamic_tokens=dynamic_tokens,
        paged_tokens=paged_tokens,
    )


@dataclass(frozen=True)
class BatcherRun:
    """Greedy generation of every prompt through a `ContinuousBatcher` (:func:`batcher_generation`)."""

    tokens: list[list[int]]  # generated ids per prompt, up to and including an EOS
    seconds: float
    cpu_seconds: float


def batcher_generation(
    model: PreTrainedModel, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, block_size: int = 16
) -> BatcherRun:
    """Every prompt as one request of a `ContinuousBatcher` (greedy), all submitted at once.

    The batcher switches `model` to ``paged_sdpa`` attention (exact either way).
    """
    start, start_cpu = time.perf_counter(), time.process_time()
    with ContinuousBatcher(model, block_size=block_size) as batcher:
        tokens = batcher.generate(prompts, max_new_tokens=max_new_tokens, do_sample=False)
    return BatcherRun(tokens, time.perf_counter() - start, time.process_time() - start_cpu)


def until_eos(tokens: Sequence[int], eos_ids: Sequence[int]) -> list[int]:
    """`tokens` up to and including the first EOS (``generate`` pads a finished row after it)."""
    for index, token in enumerate(tokens):
        if token in eos_ids:
            return list(tokens[: index + 1])
    return list(tokens)
