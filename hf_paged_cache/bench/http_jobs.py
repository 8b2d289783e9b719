"""The requests of ``scripts/bench/serving/bench_http.py``'s workloads as its clients send them (`Job`), and the sizes
drawn from them: the longest request, the default KV budget, the best prefix hit rate they allow.

- ``standard``: the seeded ShareGPT-shaped stream (`hf_paged_cache.bench.workload`) as text (its random token ids
  decoded), optionally each after one of a few shared system prompts, EOS ignored (`make_standard_jobs`);
- ``grounded``: chat requests whose answers repeat their prompt (`hf_paged_cache.bench.grounded`), EOS honoured
  (`make_grounded_jobs`);
- ``json``: chat requests for a JSON object of a schema (`hf_paged_cache.bench.json_workload`), EOS honoured
  (`make_json_jobs`).

A job's ``prompt_ids`` are its text tokenized as the servers tokenize it: what the in-process batcher gets.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..pool.block_pool import block_keys
from .grounded import grounded_workload
from .http_contenders import BLOCK_SIZE, VLLM_BLOCK_SIZE
from .json_workload import json_workload
from .workload import prompt_token_range, sharegpt_workload

WORKLOADS = ("standard", "grounded", "json")
CHAT_WORKLOADS = ("grounded", "json")
JSON_MAX_TOKENS = 192  # a json job's longest answer
WARMUP_MAX_TOKENS = 16  # a warm-up request's longest answer


@dataclass(frozen=True)
class Job:
    """One request as the clients send it."""

    text: str  # the prompt: the workload's token ids decoded (grounded: the messages through the chat template)
    prompt_ids: list[int]  # `text` tokenized again, as the servers tokenize it (what the batcher gets)
    max_tokens: int
    messages: tuple[dict[str, str], ...] | None = None  # a chat request's messages (None: a completion's prompt)
    ignore_eos: bool = True  # False: the answer may end before max_tokens, at the model's EOS
    expected: str | None = None  # grounded: a reference answer (what copying the prompt would give), if any
    response_format: dict[str, Any] | None = None  # json: what the -json contenders hold the answer to


def make_standard_jobs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, count: int, seed: int,
                       max_new: int, max_prompt: int, output_scale: float, prefixes: int,
                       prefix_tokens: int) -> list[Job]:
    """`count` requests of the ShareGPT-shaped stream as text, prompts capped at `max_prompt` tokens, request
    ``i`` asking for ``clamp(round(draw_i x output_scale), 1, max_new)`` tokens; with `prefixes` > 0, each after
    one of `prefixes` shared system prompts of `prefix_tokens` random tokens (drawn with `seed`)."""
    token_range = prompt_token_range(model, tokenizer)
    workload = sharegpt_workload(count, seed=seed, max_prompt=max_prompt, max_output=10**6, token_range=token_range)
    rng = random.Random(seed)
    shared = [tokenizer.decode([rng.randrange(*token_range) for _ in range(prefix_tokens)])
              for _ in range(prefixes)]
    jobs = []
    for request, max_tokens in zip(workload.requests, workload.scaled_output_lens(output_scale, max_new),
                                   strict=True):
        text = (rng.choice(shared) if shared else "") + tokenizer.decode(list(request.prompt_ids))
        jobs.append(Job(text, list(tokenizer(text).input_ids), max_tokens))
    return jobs


def chat_job(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], max_tokens: int,
             **fields: Any) -> Job:
    """A chat request (EOS honoured) as the servers see it: its messages through `tokenizer`'s chat template,
    tokenized as the servers tokenize it; `fields` set the rest of the `Job`."""
    text = tokenizer.apply_chat_template([dict(m) for m in messages], add_generation_prompt=True, tokenize=False)
    return Job(text, list(tokenizer(text, add_special_tokens=False).input_ids), max_tokens,
               messages=tuple(messages), ignore_eos=False, **fields)


def make_grounded_jobs(tokenizer: PreTrainedTokenizerBase, *, count: int, seed: int,
                       max_new: int | None = None) -> list[Job]:
    """`count` chat requests of the grounded workload (`hf_paged_cache.bench.grounded`), EOS honoured, their
    ``max_tokens`` set from the reference answers in `tokenizer`'s tokens (at most `max_new`, when given)."""
    workload = grounded_workload(count, seed=seed,
                                 count_tokens=lambda text: len(tokenizer(text, add_special_tokens=False).input_ids))
    return [chat_job(tokenizer, request.messages,
                     request.max_tokens if max_new is None else min(request.max_tokens, max_new),
                     expected=request.expected)
            for request in workload.requests]


def make_json_jobs(tokenizer: PreTrainedTokenizerBase, *, count: int, seed: int,
                   max_new: int = JSON_MAX_TOKENS) -> list[Job]:
    """`count` chat requests of `hf_paged_cache.bench.json_workload`, EOS honoured, at most `max_new` tokens."""
    return [chat_job(tokenizer, request.messages, max_new, response_format=request.response_format)
            for request in json_workload(count, seed=seed)]


def grounded_workload_summary(count: int, seed: int) -> dict[str, Any]:
    """What the results record of the grounded workload (kinds, sources, the Python that gave the text)."""
    summary = grounded_workload(count, seed=seed).summary()
    summary.pop("max_tokens")  # in the tokenizer's tokens: the results' max_tokens
    return summary


def prefix_hit_ceiling(jobs: Sequence[Job], block_size: int = BLOCK_SIZE) -> float:
    """The best prefix hit rate `jobs` allow, sent in order to one pool that forgets nothing: for each prompt, the
    leading full blocks (all but its last token) some earlier prompt began with, over all prompt tokens."""
    seen: set[bytes] = set()  # the chained keys (as a pool's prefix index) of every full block sent so far
    hits = 0
    for job in jobs:
        ids = job.prompt_ids
        keys = list(block_keys(ids, block_size))
        usable = keys[: (len(ids) - 1) // block_size]
        hits += block_size * next((i for i, key in enumerate(usable) if key not in seen), len(usable))
        seen.update(keys)
    return hits / sum(len(job.prompt_ids) for job in jobs)


def default_budget(jobs: Sequence[Job], concurrency: int, bytes_per_token: int, page_size: int) -> int:
    """Bytes that hold `concurrency` of the longest requests in whole blocks of every engine (+ a null block):
    ``max over b in (16, 128, page_size) of (concurrency x ceil(longest / b) + 1) x b x bytes_per_token``."""
    longest = longest_request(jobs)
    return max((concurrency * math.ceil(longest / b) + 1) * b * bytes_per_token
               for b in (BLOCK_SIZE, VLLM_BLOCK_SIZE, page_size))


def longest_request(jobs: Sequence[Job]) -> int:
    """Prompt and answer tokens of the longest of `jobs`."""
    return max(len(j.prompt_ids) + j.max_tokens for j in jobs)
