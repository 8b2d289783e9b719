"""One round of a contender of ``scripts/bench/serving/bench_http.py``, started afresh: an untimed warm-up, then the
timed requests, with what the contender counts read before and after them.

- a server (`run_server_round`): started on a free port (`http_contenders.running_server`), its ``/metrics`` read
  around the timed requests for the prompt tokens taken from its prefix cache (ours and Ray's) and the draft tokens
  proposed and accepted (the speculating contenders);
- the in-process batcher (`run_batcher_round`): a fresh `ContinuousBatcher`, its step times split into decode and
  prompt steps (`step_split`).
"""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import httpx
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..engine import ContinuousBatcher, StepTimes
from .http_contenders import SPECULATIVE, ServerSettings, running_server
from .http_jobs import Job
from .http_load import Round, drive_batcher, drive_http, eos_token_ids, request_body

STATS_SETTLE_S = 1.5  # Ray replicas post their pool stats every 0.5 s, and the ingress reads them as often
SPEC_COUNTER = re.compile(r"^(\S*(?:draft|accepted)_tokens_total)(?:\{[^}]*\})? (\S+)$", flags=re.MULTILINE)
PREFIX_HIT_COUNTER = re.compile(r"^hf_paged_cache_prefix_cache_hit_tokens_total(?:\{[^}]*\})? (\S+)$",
                                flags=re.MULTILINE)


def run_server_round(contender: str, settings: ServerSettings, jobs: list[Job], warmup: list[Job],
                     concurrency: int, log_dir: Path) -> Round:
    """`contender`'s server started afresh: `warmup` sent untimed, then `jobs` timed by `concurrency` clients;
    the round records the start-up seconds and, where the server counts them, the prefix hits and the draft
    tokens of the timed requests (counters read before and after them)."""
    with running_server(contender, settings, log_dir) as (url, startup_seconds):
        asyncio.run(drive_http(url, [request_body(contender, j) for j in warmup], concurrency))
        hits_before = prefix_hit_tokens(url, contender)
        spec_before = speculation_counters(url, contender)
        timed = asyncio.run(drive_http(url, [request_body(contender, j) for j in jobs], concurrency))
        hits_after = prefix_hit_tokens(url, contender)
        spec_after = speculation_counters(url, contender)
    timed.startup_seconds = startup_seconds
    if hits_before is not None and hits_after is not None:
        timed.prefix_hit_tokens = hits_after - hits_before
    if spec_before is not None and spec_after is not None:
        timed.speculation = {name: value - spec_before.get(name, 0.0) for name, value in spec_after.items()}
    return timed


def speculation_counters(url: str, contender: str) -> dict[str, float] | None:
    """The speculating servers' draft and accepted token counters (``/metrics``: every counter named
    ``*draft_tokens_total`` or ``*accepted_tokens_total``, summed over its labels); None for the others, or
    when the server has no such counter or no ``/metrics``."""
    if contender not in SPECULATIVE:
        return None
    response = httpx.get(f"{url}/metrics", timeout=30, trust_env=False)
    if response.status_code != 200:
        return None
    counters: dict[str, float] = {}
    for name, value in SPEC_COUNTER.findall(response.text):
        counters[name] = counters.get(name, 0.0) + float(value)
    return counters or None


def prefix_hit_tokens(url: str, contender: str) -> float | None:
    """Prompt tokens our server (every replica of it) has taken from its prefix cache so far; None for others."""
    if not contender.startswith(("ours", "ray")):
        return None
    if contender.startswith("ray"):
        time.sleep(STATS_SETTLE_S)  # the replicas' latest stats reach the ingress
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return sum(float(v) for v in PREFIX_HIT_COUNTER.findall(text))


def run_batcher_round(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, jobs: list[Job],
                      warmup: list[Job], budget: int, concurrency: int) -> Round:
    """A fresh `ContinuousBatcher` of `budget` KV bytes: `warmup` untimed, then `jobs` timed by `concurrency`
    threads, the timed steps' split recorded (`step_split`)."""
    eos = eos_token_ids(model, tokenizer)
    with ContinuousBatcher(model, max_memory=budget) as batcher:
        drive_batcher(batcher, tokenizer, warmup, concurrency, eos)
        before = batcher.stats().steps
        timed = drive_batcher(batcher, tokenizer, jobs, concurrency, eos)
        timed.steps = step_split(before, batcher.stats().steps)
        return timed


def step_split(before: StepTimes, after: StepTimes) -> dict[str, float]:
    """Where the batcher's steps between two `stats().steps` spent their time: decode steps (running rows only)
    and prompt steps (prompt chunks, with the running rows when packed)."""
    run = after.since(before)
    return {
        "decode_steps": run.decode_steps, "decode_seconds": run.decode_seconds,
        "decode_share": run.decode_seconds / (run.decode_seconds + run.prompt_seconds),
        "decode_step_ms": 1e3 * run.decode_seconds / run.decode_steps if run.decode_steps else None,
        "decode_rows_mean": run.decode_rows / run.decode_steps if run.decode_steps else None,
        "prompt_steps": run.prompt_steps, "prompt_seconds": run.prompt_seconds,
        "prompt_ms_per_token": 1e3 * run.prompt_seconds / run.prompt_tokens,
    }
