"""Serving throughput: static `generate` batches against continuous batching, on one KV budget.

Workload (``--workload``): ``--num-requests`` requests of the seeded ShareGPT-shaped stream
(`hf_paged_cache.bench`, ``sharegpt``), prompts capped at ``--max-prompt``, request ``i`` generating ``o_i =
clamp(round(draw_i x --output-scale), 1, --max-new)`` tokens (the drawn ShareGPT output length, shrunk to what a
CPU run affords); or (``uniform``) prompts of ``--min-prompt`` to ``--max-prompt`` tokens and ``o_i`` from
``--min-new`` to ``--max-new``, uniformly (``--output-scale`` unused). EOS is off, so lengths are exact. All
requests arrive at time 0. Contenders (``--contenders``):

- ``dynamic``: ``model.generate`` over static batches of ``--batch-size`` requests in order, left-padded,
  ``DynamicCache``; a batch runs ``max(o_i)`` steps (rows cannot stop early), then the next starts;
- ``paged``: the same batches with ``PagedCache(model, max_memory=budget)`` and ``paged_sdpa``;
- ``generate_batch``: transformers' continuous batching (``model.generate_batch``), a cache of the budget;
- ``batcher``: `hf_paged_cache.ContinuousBatcher` (``max_memory=budget``), each step's prompt chunks and
  decode rows in one packed forward;
- ``batcher_unpacked``: the same with ``pack_steps=False`` (each prompt chunk a forward of its own, then
  one decode forward).

The budget (``--budget``, default: what one static batch of the longest requests needs in whole blocks,
``(batch_size x ceil((max_prompt + max_new) / block_size) + 1) x block_size x bytes per token``, the + 1 for
the null block) is the same for every contender; DynamicCache cannot be capped and uses at most that.

Every run happens on a thread of its own (`in_fresh_thread`), so that none inherits the OpenMP worker pool
of one before it: with more pooled OpenMP threads than cores, GNU OpenMP stops spin-waiting, which slowed a
batcher run after a static-batch run by 15-30% on a 2-core CPU.

Reported per contender, medians over ``--repeats`` alternated rounds after one untimed warm-up round on the
first ``--batch-size`` requests: output tokens/s = ``sum(o_i) / wall seconds`` (prefill included), and time
to first token (TTFT) from time 0, p50 and p95 over requests. Every contender's tokens are checked against
greedy ``generate`` with ``DynamicCache`` on each request alone (``tokens identical``).

Commands (the numbers and chart in docs/benchmarks.md; the second: 16 requests at once against one ``generate`` batch)::

    python scripts/bench/serving/bench_serving.py --threads 2 --out results/bench_serving.json
    python scripts/bench/serving/bench_serving.py --threads 2 --repeats 5 --workload uniform --num-requests 16 --min-prompt 50 \
        --max-prompt 250 --min-new 32 --max-new 93 --contenders dynamic,batcher --out results/bench_serving_16.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from hf_paged_cache import (
    ContinuousBatcher,
    PagedCache,
    parse_memory,
    set_paged_attention,
)
from hf_paged_cache.bench import (
    add_common_args,
    add_workload_args,
    format_table,
    in_fresh_thread,
    kv_bytes_per_token,
    left_pad,
    load,
    mib,
    percentile,
    prompt_token_range,
    sharegpt_workload,
    uniform_workload,
    write_json,
)

CONTENDERS = ("dynamic", "paged", "generate_batch", "batcher", "batcher_unpacked")
WORKLOADS = ("sharegpt", "uniform")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_serving.json")
    add_workload_args(parser, num_requests=64)
    parser.add_argument("--workload", choices=WORKLOADS, default=WORKLOADS[0],
                        help=f"request lengths: ShareGPT-shaped, or uniform in ranges (default: {WORKLOADS[0]})")
    parser.add_argument("--min-prompt", type=int, default=50, help="uniform: shortest prompt (default: 50)")
    parser.add_argument("--min-new", type=int, default=32, help="uniform: fewest new tokens (default: 32)")
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size (default: 16)")
    parser.add_argument("--budget", default=None, help="KV budget, e.g. 512MiB (default: one static batch's need)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds per contender (default: 2)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated (default: all of {','.join(CONTENDERS)})")
    parser.add_argument("--skip-check", action="store_true", help="do not run each request alone for the check")
    return parser.parse_args(argv)


def run_static(model: PreTrainedModel, prompts: list[list[int]], outputs: list[int], args: argparse.Namespace,
               pad_id: int, paged: bool, budget: int) -> dict[str, Any]:
    """Static batches of `--batch-size` in order; returns seconds, per-request tokens and first-token times."""
    tokens, first = [], []
    start = time.perf_counter()
    for lo in range(0, len(prompts), args.batch_size):
        batch_prompts, batch_outputs = prompts[lo : lo + args.batch_size], outputs[lo : lo + args.batch_size]
        batch = left_pad(batch_prompts, pad_id, model.device)
        steps = max(batch_outputs)
        cache = PagedCache(model, block_size=args.block_size, max_memory=budget) if paged else DynamicCache(
            config=model.config
        )
        stamp = FirstStep()
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                 eos_token_id=None, pad_token_id=pad_id, cache=cache, logits_processor=[stamp])
        if paged:
            cache.release()
        width = batch["input_ids"].shape[1]
        tokens += [out[row, width : width + n].tolist() for row, n in enumerate(batch_outputs)]
        first += [stamp.time - start] * len(batch_prompts)
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "ttft": first}


class FirstStep:
    """A logits processor that notes when `generate` first picks tokens (the batch's first token)."""

    def __init__(self) -> None:
        self.time: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.time is None:
            self.time = time.perf_counter()
        return scores


def run_generate_batch(model: PreTrainedModel, prompts: list[list[int]], outputs: list[int],
                       args: argparse.Namespace, budget: int) -> dict[str, Any]:
    """transformers' continuous batching, one request per prompt with its own max_new_tokens."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = ContinuousBatchingConfig()
    config.num_blocks = max(1, budget // (kv_bytes_per_token(model.config, model.dtype) * config.page_size))
    generation_config = GenerationConfig(max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1,
                                         pad_token_id=model.generation_config.pad_token_id)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=config)
        manager.start()
        try:
            start = time.perf_counter()
            ids = [manager.add_request(p, max_new_tokens=n, eos_token_id=-1, record_timestamps=True)
                   for p, n in zip(prompts, outputs, strict=True)]
            results = {}
            while len(results) < len(ids):
                result = manager.get_result(timeout=0.05)
                if result is not None and result.is_finished():
                    results[result.request_id] = result
                elif result is None and not manager.is_running():
                    raise RuntimeError("the continuous batching thread stopped before every request finished")
            seconds = time.perf_counter() - start
        finally:
            manager.stop(block=True)
            manager.destroy()
    return {"seconds": seconds, "tokens": [list(results[i].generated_tokens) for i in ids],
            "ttft": [results[i].timestamps[0] - start for i in ids]}


def run_batcher(model: PreTrainedModel, prompts: list[list[int]], outputs: list[int], args: argparse.Namespace,
                budget: int, pack_steps: bool = True) -> dict[str, Any]:
    with ContinuousBatcher(model, max_memory=budget, block_size=args.block_size, pack_steps=pack_steps) as batcher:
        start = time.perf_counter()
        handles = [batcher.submit(p, max_new_tokens=n, do_sample=False, eos_token_id=None)
                   for p, n in zip(prompts, outputs, strict=True)]
        tokens = [h.result() for h in handles]
        seconds = time.perf_counter() - start
        preemptions, packed_steps = batcher.preemptions, batcher.packed_steps
    return {"seconds": seconds, "tokens": tokens, "ttft": [h.first_token_time - start for h in handles],
            "preemptions": preemptions, "packed_steps": packed_steps}


def reference(model: PreTrainedModel, prompts: list[list[int]], outputs: list[int]) -> list[list[int]]:
    """Greedy generate with DynamicCache on each request alone."""
    tokens = []
    for prompt, n in tqdm(list(zip(prompts, outputs, strict=True)), desc="reference", unit="request"):
        ids = torch.tensor([prompt], device=model.device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, eos_token_id=None,
                                 cache=DynamicCache(config=model.config))
        tokens.append(out[0, len(prompt):].tolist())
    return tokens


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer = load(args)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    token_range = prompt_token_range(model, tokenizer)
    if args.workload == "uniform":
        workload = uniform_workload(args.num_requests, seed=args.seed, prompt_lens=(args.min_prompt, args.max_prompt),
                                    output_lens=(args.min_new, args.max_new), token_range=token_range)
        outputs = workload.output_lens
    else:
        workload = sharegpt_workload(args.num_requests, seed=args.seed, max_prompt=args.max_prompt,
                                     max_output=10**6, token_range=token_range)
        outputs = workload.scaled_output_lens(args.output_scale, args.max_new)
    prompts = workload.prompts()
    per_token = kv_bytes_per_token(model.config, model.dtype)
    row_blocks = -(-(args.max_prompt + args.max_new) // args.block_size)  # a row's blocks at most
    budget = parse_memory(args.budget) if args.budget else (args.batch_size * row_blocks + 1) * args.block_size * per_token
    original_attention = model.config._attn_implementation

    def run(name: str, count: int) -> dict[str, Any]:
        return in_fresh_thread(run_contender, name, count)

    def run_contender(name: str, count: int) -> dict[str, Any]:
        p, o = prompts[:count], outputs[:count]
        if name == "dynamic":
            model.set_attn_implementation(original_attention)
            return run_static(model, p, o, args, pad_id, paged=False, budget=budget)
        set_paged_attention(model)
        if name == "paged":
            return run_static(model, p, o, args, pad_id, paged=True, budget=budget)
        if name == "generate_batch":
            model.set_attn_implementation(original_attention)  # its own paged attention needs a stock backend
            return run_generate_batch(model, p, o, args, budget)
        return run_batcher(model, p, o, args, budget, pack_steps=name == "batcher")

    for name in contenders:  # warm-up round, untimed
        run(name, args.batch_size)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in contenders}
    plan = [(r, name) for r in range(args.repeats) for name in contenders]
    for _, name in tqdm(plan, desc="rounds", unit="run"):
        runs[name].append(run(name, len(prompts)))
    model.set_attn_implementation(original_attention)
    expected = None if args.skip_check else reference(model, prompts, outputs)

    useful = sum(outputs)
    results: dict[str, Any] = {
        "benchmark": "serving", "model": args.model, "dtype": str(model.dtype), "threads": torch.get_num_threads(),
        "workload": args.workload, "num_requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": useful, "prompt_lens": [len(p) for p in prompts], "output_lens": outputs,
        "budget_bytes": budget, "batch_size": args.batch_size, "contenders": {},
    }
    for name, rounds in runs.items():
        throughput = [useful / r["seconds"] for r in rounds]
        ttft = [percentile(r["ttft"], 0.5) for r in rounds], [percentile(r["ttft"], 0.95) for r in rounds]
        results["contenders"][name] = {
            "tokens_per_s": statistics.median(throughput), "tokens_per_s_range": [min(throughput), max(throughput)],
            "ttft_p50_s": statistics.median(ttft[0]), "ttft_p95_s": statistics.median(ttft[1]),
            "seconds": [r["seconds"] for r in rounds],
            "tokens_identical": None if expected is None else all(r["tokens"] == expected for r in rounds),
            "preemptions": [r.get("preemptions") for r in rounds],
            "packed_steps": [r.get("packed_steps") for r in rounds],
        }
    write_json(args.out, results, model.device)
    print_report(results)
    return results


def print_report(results: dict[str, Any]) -> None:
    base = results["contenders"].get("dynamic", {}).get("tokens_per_s")
    rows = [{
        "contender": name,
        "tokens/s": r["tokens_per_s"],
        "range": f"{r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}",
        "x dynamic": r["tokens_per_s"] / base if base else float("nan"),
        "TTFT p50 s": r["ttft_p50_s"],
        "TTFT p95 s": r["ttft_p95_s"],
        "tokens identical": r["tokens_identical"],
    } for name, r in results["contenders"].items()]
    print(f"{results['num_requests']} requests, {results['output_tokens']} output tokens, KV budget "
          f"{mib(results['budget_bytes']):.1f} MiB, {results['threads']} threads")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
    sys.exit(0)
