"""Scoring a multiple-choice set through the server: contexts computed once for their endings (the prompt
log-probabilities kept by block, `engine.prompt_scores`) against every prompt computed whole
(``--no-reuse-prompt-scores``).

The set is shaped as lm-eval's multiple-choice tasks send it through ``local-completions``: ``--contexts`` contexts
of 64-192 tokens, each with 4 endings of 4-24 tokens, every context-and-ending prompt scored by ``echo`` with
``logprobs=1`` and ``max_tokens=1`` (token ids, so nothing is tokenized twice), the 4 prompts of a context in one
request, ``--concurrency`` requests at a time. Token ids are drawn at random (seeded) from 1,000-40,000 of the
default model's vocabulary: a prompt's cost does not depend on what it says. Both servers run at once on the same
model (``--threads`` each, the idle one waiting); the rounds alternate between them, each round a fresh set (a new
seed: nothing cached from an earlier round), after a warm-up round each. Reported: each round's seconds, the
medians, the ratio, and the largest difference between the two servers' log-probabilities of the same set
(the warm-up's: both scored it).

Command (the run reported in docs/benchmarks.md)::

    python scripts/bench/serving/bench_scoring.py --out results/bench_scoring.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch

from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.server_process import running_process
from hf_paged_cache.models import resolve_model_path

CONTENDERS = {"reuse": [], "cold": ["--no-reuse-prompt-scores"]}


def scoring_set(contexts: int, seed: int) -> list[list[list[int]]]:
    """`contexts` lists of 4 prompts: one context of 64-192 random token ids with 4 endings of 4-24."""
    generator = torch.Generator().manual_seed(seed)

    def ids(low: int, high: int) -> list[int]:
        length = int(torch.randint(low, high + 1, (1,), generator=generator))
        return torch.randint(1000, 40000, (length,), generator=generator).tolist()

    return [[context + ids(4, 24) for _ in range(4)] for context in (ids(64, 192) for _ in range(contexts))]


def score(url: str, work: list[list[list[int]]], concurrency: int) -> tuple[float, list[list[float]]]:
    """Seconds to score every prompt of `work` (one request per context), and each prompt's log-probabilities."""
    with httpx.Client(timeout=600.0, trust_env=False) as client:
        def ask(prompts: list[list[int]]) -> list[list[float]]:
            body = {"model": "default", "prompt": prompts, "max_tokens": 1, "temperature": 0, "echo": True,
                    "logprobs": 1}
            answer = client.post(f"{url}/v1/completions", json=body)
            answer.raise_for_status()
            choices = sorted(answer.json()["choices"], key=lambda choice: choice["index"])
            return [choice["logprobs"]["token_logprobs"][1:-1] for choice in choices]  # the prompt's, after its first

        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(ask, work))
        return time.perf_counter() - start, [prompt for context in results for prompt in context]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, default=200, help="contexts of 4 endings each (default: 200)")
    parser.add_argument("--concurrency", type=int, default=4, help="requests at a time (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per server (default: 3)")
    parser.add_argument("--threads", type=int, default=2, help="each server's torch threads (default: 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    model = resolve_model_path(None)  # the default model (offline: its converted copy)
    logs = Path(tempfile.mkdtemp(prefix="bench-scoring-"))
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    seconds: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    with ExitStack() as stack:
        urls = {}
        for name, flags in CONTENDERS.items():
            command = [sys.executable, "-m", "hf_paged_cache.serve", model, "--port", "{port}", "--max-memory", "1GiB",
                       "--served-model-name", "default", "--speculative", "off", *flags]
            url, _ = stack.enter_context(running_process(
                lambda port, command=command: [str(port) if part == "{port}" else part for part in command],
                env, lambda port, name=name: logs / f"{name}-{port}.log", 600.0))
            urls[name] = url
        warm = {name: score(url, scoring_set(args.contexts, seed=0), args.concurrency)[1] for name, url in urls.items()}
        differences = [abs(a - b) for x, y in zip(warm["reuse"], warm["cold"], strict=True)
                       for a, b in zip(x, y, strict=True)]
        for round_ in range(args.repeats):
            work = scoring_set(args.contexts, seed=round_ + 1)
            for name in (CONTENDERS if round_ % 2 == 0 else reversed(CONTENDERS)):
                took, _ = score(urls[name], work, args.concurrency)
                seconds[name].append(took)
                print(f"round {round_ + 1} {name}: {took:.1f} s", flush=True)
    result = {"contexts": args.contexts, "prompts": 4 * args.contexts, "concurrency": args.concurrency,
              "threads": args.threads, "seconds": seconds,
              "median_s": {name: statistics.median(times) for name, times in seconds.items()},
              "max_logprob_difference": max(differences)}
    result["speedup"] = result["median_s"]["cold"] / result["median_s"]["reuse"]
    print(f"scoring {4 * args.contexts} prompts: reuse {result['median_s']['reuse']:.1f} s, cold "
          f"{result['median_s']['cold']:.1f} s, {result['speedup']:.2f}x; largest log-probability difference "
          f"{result['max_logprob_difference']:.2e}")
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
