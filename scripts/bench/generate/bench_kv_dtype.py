"""Keys and values stored as int8 (or bfloat16, float8) against the model's own dtype: bytes, fidelity, speed.

Four measurements on the default model (SmolLM2-135M-Instruct, float32 weights), each `PagedCache` with
``paged_sdpa`` attention and ``kv_dtype`` one of ``--kv-dtypes`` (``float32``: the model's dtype, the
reference):

1. **bytes**: KV bytes per token of each pool (scales included), and the ratio to float32;
2. **fidelity**: 8 ragged rows of real text (slices of ``--corpus``, the offline Wikipedia excerpt, ``--fidelity-lens``
   tokens), ``--fidelity-tokens`` greedy tokens each: rows whose tokens equal the float32 cache's, and for
   the others the first position that differs;
3. **decode**: a decode step of those 8 ragged rows (prefilled once, untimed), ``--decode-steps`` steps timed
   per round, rounds alternated between kv dtypes (A, B, A, B, ...) after a warm-up, at each of ``--threads``;
   the median ms per step and its range, and float32's time / this dtype's (> 1: faster);
4. **batcher**: `ContinuousBatcher` on a fixed KV budget (``--budget``, default: 4 of the longest requests
   in float32 blocks, too small for the whole batch) serving ``--num-requests`` requests that all arrive at
   once (ShareGPT-shaped lengths, prompts ``--min-prompt`` to ``--max-prompt``, ``--min-new`` to ``--max-new``
   new tokens, EOS off); the most requests decoding at once (between their first token and their end, from
   the handles' times) and output tokens/s, rounds alternated.

Command (the numbers in docs/benchmarks.md)::

    python scripts/bench/generate/bench_kv_dtype.py --threads 1,2 --out results/bench_kv_dtype.json
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import ContinuousBatcher, KVPool, PagedCache, RequestHandle, set_paged_attention
from hf_paged_cache.bench import (
    format_table,
    in_fresh_thread,
    left_pad,
    median,
    pad_token_id,
    prompt_token_range,
    uniform_workload,
    write_json,
)
from hf_paged_cache.eval.corpora import load_corpus_text
from hf_paged_cache.models import add_model_arguments, load_model_and_tokenizer

REFERENCE = "float32"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--kv-dtypes", default="float32,int8,bfloat16,float8_e4m3fn",
                        help="stored dtypes to compare, the first the reference (default: %(default)s)")
    parser.add_argument("--threads", default="1,2", help="thread counts of the decode rounds (default: %(default)s)")
    parser.add_argument("--fidelity-lens", default="60,120,200,300,450,600,800,1000",
                        help="prompt tokens of the ragged rows (default: %(default)s)")
    parser.add_argument("--corpus", default="offline",
                        help="text the fidelity rows are cut from: a file, or 'offline' (default: %(default)s)")
    parser.add_argument("--fidelity-tokens", type=int, default=48, help="greedy tokens per row (default: 48)")
    parser.add_argument("--decode-steps", type=int, default=16, help="decode steps timed per round (default: 16)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per dtype and part (default: 5)")
    parser.add_argument("--num-requests", type=int, default=16, help="batcher requests (default: 16)")
    parser.add_argument("--min-prompt", type=int, default=50, help="batcher: shortest prompt (default: 50)")
    parser.add_argument("--max-prompt", type=int, default=250, help="batcher: longest prompt (default: 250)")
    parser.add_argument("--min-new", type=int, default=32, help="batcher: fewest new tokens (default: 32)")
    parser.add_argument("--max-new", type=int, default=93, help="batcher: most new tokens (default: 93)")
    parser.add_argument("--budget-requests", type=int, default=4,
                        help="batcher: the KV budget holds this many of the longest requests in float32 (default: 4)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--out", default="results/bench_kv_dtype.json", help="JSON output (default: %(default)s)")
    parser.add_argument("--skip", default="", help="parts to skip, comma-separated: fidelity, decode, batcher "
                        "(default: none)")
    return parser.parse_args(argv)


def stored(kv_dtype: str) -> str | None:
    """`PagedCache`'s ``kv_dtype`` for a name of ``--kv-dtypes`` (the reference: None, the model's own)."""
    return None if kv_dtype == REFERENCE else kv_dtype


# ------------------------------------------------------------------ 1. bytes


def bytes_per_token(model: PreTrainedModel, kv_dtypes: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for kv_dtype in kv_dtypes:
        pool = KVPool.for_config(model.config, num_blocks=2, dtype=model.dtype, kv_dtype=stored(kv_dtype))
        rows.append({"kv_dtype": kv_dtype, "bytes_per_token": pool.bytes_per_block // pool.block_size})
    for row in rows:
        row["vs_float32"] = row["bytes_per_token"] / rows[0]["bytes_per_token"]
    return rows


# ------------------------------------------------------------------ 2. fidelity


def text_prompts(tokenizer: PreTrainedTokenizerBase, corpus: str, lengths: Sequence[int]) -> list[list[int]]:
    """One slice of `corpus` (by default the offline Wikipedia excerpt) per length, from different places in it."""
    ids = tokenizer(load_corpus_text(corpus).text).input_ids
    starts = [len(ids) * i // (len(lengths) + 1) for i in range(len(lengths))]
    return [ids[start : start + n] for start, n in zip(starts, lengths, strict=True)]


def greedy(model: PreTrainedModel, batch: dict[str, torch.Tensor], kv_dtype: str, new_tokens: int) -> list[list[int]]:
    with PagedCache(model, kv_dtype=stored(kv_dtype)) as cache:
        out = model.generate(**batch, cache=cache, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[:, batch["input_ids"].shape[1] :].tolist()


def fidelity(model: PreTrainedModel, batch: dict[str, torch.Tensor], kv_dtypes: Sequence[str],
             new_tokens: int) -> list[dict[str, Any]]:
    answers = {kv_dtype: greedy(model, batch, kv_dtype, new_tokens) for kv_dtype in kv_dtypes}
    rows = []
    for kv_dtype in kv_dtypes:
        firsts = [next((i for i, (a, b) in enumerate(zip(row, ref)) if a != b), None)
                  for row, ref in zip(answers[kv_dtype], answers[kv_dtypes[0]], strict=True)]
        diverged = [f for f in firsts if f is not None]
        rows.append({"kv_dtype": kv_dtype, "rows_identical": firsts.count(None), "rows": len(firsts),
                     "first_divergence": firsts,
                     "mean_first_divergence": sum(diverged) / len(diverged) if diverged else None})
    return rows


# ------------------------------------------------------------------ 3. decode


def decode_round(model: PreTrainedModel, batch: dict[str, torch.Tensor], kv_dtype: str, steps: int) -> float:
    """Seconds per decode step of the batch, prefilled (untimed) into a fresh cache of `kv_dtype`."""
    mask = batch["attention_mask"]
    with torch.no_grad(), PagedCache(model, kv_dtype=stored(kv_dtype)) as cache:
        out = model(**batch, cache=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)  # [B, 1]
        start = time.perf_counter()
        for _ in range(steps):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(input_ids=token, attention_mask=mask, cache=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        return (time.perf_counter() - start) / steps


def decode_speed(model: PreTrainedModel, batch: dict[str, torch.Tensor], kv_dtypes: Sequence[str],
                 threads: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    for kv_dtype in kv_dtypes:  # warm-up
        in_fresh_thread(decode_round, model, batch, kv_dtype, 2)
    times: dict[str, list[float]] = {k: [] for k in kv_dtypes}
    for _ in tqdm(range(args.repeats), desc=f"decode, {threads} thread(s)", leave=False):
        for kv_dtype in kv_dtypes:
            times[kv_dtype].append(in_fresh_thread(decode_round, model, batch, kv_dtype, args.decode_steps))
    reference = median(times[kv_dtypes[0]])
    return [{"kv_dtype": k, "threads": threads, "ms_per_step": median(t) * 1e3,
             "range_ms": [min(t) * 1e3, max(t) * 1e3], "speed_vs_float32": reference / median(t)}
            for k, t in times.items()]


# ------------------------------------------------------------------ 4. batcher


def batcher_requests(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     args: argparse.Namespace) -> list[tuple[list[int], int]]:
    workload = uniform_workload(args.num_requests, seed=args.seed, prompt_lens=(args.min_prompt, args.max_prompt),
                                output_lens=(args.min_new, args.max_new),
                                token_range=prompt_token_range(model, tokenizer))
    return list(zip(workload.prompts(), workload.output_lens, strict=True))


def batcher_round(model: PreTrainedModel, requests: list[tuple[list[int], int]], kv_dtype: str,
                  budget: int) -> dict[str, Any]:
    with ContinuousBatcher(model, max_memory=budget, kv_dtype=stored(kv_dtype)) as batcher:
        start = time.perf_counter()
        handles = [batcher.submit(prompt, max_new_tokens=new, do_sample=False, eos_token_id=None)
                   for prompt, new in requests]
        tokens = sum(len(handle.result()) for handle in handles)
        seconds = time.perf_counter() - start
        return {"tokens_per_s": tokens / seconds, "most_in_flight": most_decoding_at_once(handles),
                "blocks": batcher.pool.blocks.capacity}


def most_decoding_at_once(handles: Sequence[RequestHandle]) -> int:
    """The most requests that were at once between their first token and their end (the handles' own times):
    rows the pool held together. Exact, where polling the batcher's counts misses runs shorter than its period."""
    # (time, 0, +1) at each first token and (time, 1, -1) at each end: at equal times the start comes first
    events = sorted([(h.first_token_time, 0, 1) for h in handles] + [(h.finish_time, 1, -1) for h in handles])
    most = now = 0
    for _, _, change in events:
        now += change
        most = max(most, now)
    return most


def batcher_speed(model: PreTrainedModel, requests: list[tuple[list[int], int]], kv_dtypes: Sequence[str],
                  budget: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    for kv_dtype in kv_dtypes:  # warm-up
        in_fresh_thread(batcher_round, model, requests[:2], kv_dtype, budget)
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kv_dtypes}
    for _ in tqdm(range(args.repeats), desc="batcher", leave=False):
        for kv_dtype in kv_dtypes:
            runs[kv_dtype].append(in_fresh_thread(batcher_round, model, requests, kv_dtype, budget))
    reference = median([r["tokens_per_s"] for r in runs[kv_dtypes[0]]])
    rows = []
    for kv_dtype, rounds in runs.items():
        speeds = [r["tokens_per_s"] for r in rounds]
        rows.append({"kv_dtype": kv_dtype, "blocks": rounds[0]["blocks"],
                     "most_in_flight": max(r["most_in_flight"] for r in rounds),
                     "tokens_per_s": median(speeds), "range": [min(speeds), max(speeds)],
                     "speed_vs_float32": median(speeds) / reference})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    if not kv_dtypes or kv_dtypes[0] != REFERENCE:
        raise SystemExit(f"--kv-dtypes must start with the reference, {REFERENCE}")
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    model, tokenizer = load_model_and_tokenizer(args.model, device="cpu", dtype=args.dtype)
    if model.dtype != torch.float32:
        raise SystemExit("this benchmark compares stored dtypes under float32 weights (--dtype float32)")
    set_paged_attention(model)
    results: dict[str, Any] = {"benchmark": "kv_dtype", "model": args.model or "default", "dtype": "float32",
                               "settings": vars(args), "bytes": bytes_per_token(model, kv_dtypes)}
    prompts = text_prompts(tokenizer, args.corpus, [int(n) for n in args.fidelity_lens.split(",")])
    batch = left_pad(prompts, pad_token_id(model, tokenizer), "cpu")
    if "fidelity" not in skip:
        results["fidelity"] = fidelity(model, batch, kv_dtypes, args.fidelity_tokens)
    if "decode" not in skip:
        results["decode"] = [row for threads in (int(t) for t in args.threads.split(","))
                             for row in decode_speed(model, batch, kv_dtypes, threads, args)]
    if "batcher" not in skip:
        torch.set_num_threads(max(int(t) for t in args.threads.split(",")))
        requests = batcher_requests(model, tokenizer, args)
        longest = max(len(p) + n for p, n in requests)
        reference_pool = KVPool.for_config(model.config, num_blocks=2, dtype=model.dtype)
        budget = (args.budget_requests * -(-longest // reference_pool.block_size) + 1) * reference_pool.bytes_per_block
        results["batcher_budget_bytes"] = budget
        results["batcher"] = batcher_speed(model, requests, [k for k in kv_dtypes if k in (REFERENCE, "int8")],
                                           budget, args)
    path = write_json(args.out, results, "cpu")
    print_report(results)
    print(f"wrote {path}")
    return results


def print_report(results: dict[str, Any]) -> None:
    print(format_table(results["bytes"], ["kv_dtype", "bytes_per_token", "vs_float32"]))
    if "fidelity" in results:
        print(format_table(results["fidelity"], ["kv_dtype", "rows_identical", "rows", "mean_first_divergence",
                                                 "first_divergence"]))
    if "decode" in results:
        print(format_table(results["decode"], ["kv_dtype", "threads", "ms_per_step", "range_ms", "speed_vs_float32"]))
    if "batcher" in results:
        print(f"batcher budget: {results['batcher_budget_bytes']:,} bytes")
        print(format_table(results["batcher"], ["kv_dtype", "blocks", "most_in_flight", "tokens_per_s", "range",
                                                "speed_vs_float32"]))


if __name__ == "__main__":
    main()
