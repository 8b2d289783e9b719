"""The load of ``scripts/bench/serving/bench_http.py``: the body each server is sent, the streaming client that
times each request, and the closed loops of clients over HTTP or straight into a `ContinuousBatcher`.

A closed loop: `concurrency` clients share the jobs in order, each sending its next request as soon as its previous
stream ends, so at most `concurrency` requests are in flight. Every request is timed with ``time.perf_counter``:
sent, each chunk that carried text (the batcher: each token), ended; a `Round` holds those `Stream` records and the
wall seconds from the first request sent to the last stream ended.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..engine import ContinuousBatcher
from .http_contenders import CONSTRAINED, OUR_SERVERS, RAY_CONTENDERS, VLLM_SERVERS, base_contender
from .http_jobs import Job


@dataclass
class Stream:
    """What one client saw of one request."""

    sent: float  # time.perf_counter() when the request was sent
    arrivals: list[float]  # time.perf_counter() at each chunk that carried text (batcher: each token)
    text: str
    completion_tokens: int | None  # the server's usage count (None: it sent none)
    prompt_tokens: int | None
    ended: float | None = None  # time.perf_counter() when the stream ended
    finish_reason: str | None = None  # the last one a chunk carried ("stop", "length"; None: none sent)


@dataclass
class Round:
    """One contender's timed requests: its clients' streams in job order, and what was read around them."""

    seconds: float  # first request sent to last stream ended
    streams: list[Stream]
    startup_seconds: float | None = None  # server process started to /health answering
    prefix_hit_tokens: float | None = None  # prompt tokens served from the prefix cache (ours, from /metrics)
    steps: dict[str, float] | None = None  # batcher: where its steps' time went (`http_rounds.step_split`)
    speculation: dict[str, float] | None = None  # the servers' draft/accepted token counters over the timed requests


def request_body(contender: str, job: Job) -> dict[str, Any]:
    """The streamed body each server needs for a greedy answer of exactly `job.max_tokens` (EOS ignored), or of
    at most that (`job.ignore_eos` False); a `/v1/chat/completions` body when `job` has messages."""
    body: dict[str, Any] = {"max_tokens": job.max_tokens, "temperature": 0, "stream": True}
    body |= {"prompt": job.text} if job.messages is None else {"messages": [dict(m) for m in job.messages]}
    if contender in CONSTRAINED and job.response_format is not None:
        body["response_format"] = job.response_format
    if base_contender(contender) in (*OUR_SERVERS, *VLLM_SERVERS, *RAY_CONTENDERS):
        return body | ({"ignore_eos": True} if job.ignore_eos else {}) | {"stream_options": {"include_usage": True}}
    # transformers serve answers 422 to fields it does not know (ignore_eos) and sends usage unasked; with
    # --continuous-batching it applies max_tokens and the EOS id per request, and the first request's
    # generation config (here the same for all) for everything else.
    config = {"do_sample": False} | ({"eos_token_id": -1} if job.ignore_eos else {})
    return body | {"generation_config": json.dumps(config)}


def endpoint(body: dict[str, Any]) -> str:
    """The path `body` is posted to: chat completions when it has messages, else completions."""
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def chunk_text(choice: dict[str, Any]) -> str:
    """The text one streamed choice carries: a completion's ``text``, a chat answer's ``delta.content``."""
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> Stream:
    """Post `body` and read its server-sent events to the end (``data: [DONE]`` or the stream closed), stamping
    each chunk that carries text; raises RuntimeError on a status other than 200 or an error chunk."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    parts: list[str] = []
    usage: dict[str, Any] = {}
    finish_reason = None
    path = endpoint(body)
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{path} answered {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[len("data:"):].strip()
            if payload == "[DONE]":  # ours and vLLM end with it; transformers serve just closes the stream
                break
            chunk = json.loads(payload)
            if "error" in chunk:
                raise RuntimeError(f"the server failed a request mid-stream: {chunk['error']}")
            choices = chunk.get("choices") or []
            text = "".join(chunk_text(choice) for choice in choices)
            if text:
                arrivals.append(time.perf_counter())
                parts.append(text)
            usage = chunk.get("usage") or usage
            finish_reason = next((c["finish_reason"] for c in choices if c.get("finish_reason")), finish_reason)
    return Stream(sent, arrivals, "".join(parts), usage.get("completion_tokens"), usage.get("prompt_tokens"),
                  time.perf_counter(), finish_reason)


async def drive_http(url: str, bodies: list[dict[str, Any]], concurrency: int) -> Round:
    """`concurrency` clients in a closed loop over `bodies`, in order."""
    streams: list[Stream | None] = [None] * len(bodies)
    pending = iter(range(len(bodies)))  # shared by the clients; the event loop runs one at a time
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(None, connect=30.0)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout, trust_env=False) as client:

        async def client_loop() -> None:
            for i in pending:
                streams[i] = await stream_completion(client, bodies[i])

        start = time.perf_counter()
        await asyncio.gather(*(client_loop() for _ in range(min(concurrency, len(bodies)))))
        seconds = time.perf_counter() - start
    return Round(seconds, streams)


def drive_batcher(batcher: ContinuousBatcher, tokenizer: PreTrainedTokenizerBase, jobs: list[Job],
                  concurrency: int, eos_token_ids: Sequence[int] = ()) -> Round:
    """The same closed loop as `drive_http`, `concurrency` threads submitting to `batcher` directly; a job that
    does not ignore EOS stops at `eos_token_ids` (the model's and the tokenizer's, as the servers stop)."""

    def one(i: int) -> Stream:
        sent = time.perf_counter()
        eos = None if jobs[i].ignore_eos or not eos_token_ids else list(eos_token_ids)  # None: no EOS
        handle = batcher.submit(jobs[i].prompt_ids, max_new_tokens=jobs[i].max_tokens, do_sample=False,
                                eos_token_id=eos)
        tokens, arrivals = [], []
        for token in handle:
            arrivals.append(time.perf_counter())
            tokens.append(token)
        text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        reason = "stop" if eos is not None and tokens and tokens[-1] in eos else "length"
        return Stream(sent, arrivals, text, len(tokens), len(jobs[i].prompt_ids), time.perf_counter(), reason)

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="client") as clients:
        start = time.perf_counter()
        streams = list(clients.map(one, range(len(jobs))))
        seconds = time.perf_counter() - start
    return Round(seconds, streams)


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids an answer that honours EOS stops at: the model's generation config's and the tokenizer's (as our
    server stops)."""
    ids: list[int] = []
    for value in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        ids += [] if value is None else [value] if isinstance(value, int) else list(value)
    return list(dict.fromkeys(ids))
