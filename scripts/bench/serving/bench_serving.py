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

The model's dtype (``--dtypes float32,bfloat16``, the first the reference): one model is loaded per dtype and
every contender runs on each (named ``contender@dtype``), all alternated in the same rounds. Each is then also
compared with the same contender on the reference dtype: per round the ratio of tokens/s and its median, the
requests whose tokens are all the reference's, and the mean position of the first different token among the
others (reduced precision follows its own rounding at near-ties; see `tests/models/test_model_dtype.py` for the
logits). ``--packed-linears`` multiplies through oneDNN-packed weights (``pack_linears``, as the server does on
a CPU) on every model alike.

Commands (the numbers and chart in docs/benchmarks.md; the second: 16 requests at once against one ``generate``
batch; the third: float32 against bfloat16 on the batcher)::

    python scripts/bench/serving/bench_serving.py --threads 2 --out results/bench_serving.json
    python scripts/bench/serving/bench_serving.py --threads 2 --repeats 5 --workload uniform --num-requests 16 \
        --min-prompt 50 --max-prompt 250 --min-new 32 --max-new 93 --contenders dynamic,batcher \
        --out results/bench_serving_16.json
    python scripts/bench/serving/bench_serving.py --threads 2 --dtypes float32,bfloat16 --packed-linears \
        --contenders batcher --num-requests 32 --budget 1GiB --repeats 3 --skip-check \
        --out results/bench_serving_model_dtype.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

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
    mib,
    percentile,
    prompt_token_range,
    sharegpt_workload,
    uniform_workload,
    write_json,
)
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import DTYPE_CHOICES, load_model_and_tokenizer, resolve_dtype

CONTENDERS = ("dynamic", "paged", "generate_batch", "batcher", "batcher_unpacked")
WORKLOADS = ("sharegpt", "uniform")
MODES = (
    "Two comparisons on one workload. The caches and engines (--contenders): static generate batches with "
    "DynamicCache or PagedCache, transformers' generate_batch, and our ContinuousBatcher packed or unpacked, each "
    "checked against greedy generate. The model's dtype (--dtypes float32,bfloat16): every contender on each "
    "dtype, each against itself on the first dtype (tokens/s ratio per round, requests with the same tokens)."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=MODES)
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
    parser.add_argument("--dtypes", default=None,
                        help=f"model dtypes to compare, comma-separated, the first the reference, from "
                        f"{','.join(DTYPE_CHOICES)}; every contender runs on each (default: --dtype alone)")
    parser.add_argument("--packed-linears", action="store_true",
                        help="multiply through oneDNN-packed weights (pack_linears, as the server does on a CPU) "
                        "on every model alike (without it: the stock kernels)")
    args = parser.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contenders {unknown}; choose from {CONTENDERS}")
    args.dtypes = [d.strip() for d in (args.dtypes or args.dtype).split(",") if d.strip()]
    for name in args.dtypes:
        if name not in DTYPE_CHOICES:
            parser.error(f"unknown dtype {name!r}; choose from {DTYPE_CHOICES}")
    return args


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


def load_models(args: argparse.Namespace) -> tuple[dict[str, PreTrainedModel], PreTrainedTokenizerBase]:
    """One model per ``--dtypes`` name (``--dtype`` alone by default), packed with ``--packed-linears``."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    models = {}
    for name in args.dtypes:  # "auto" resolves on this machine
        models[name], tokenizer = load_model_and_tokenizer(args.model, device=args.device,
                                                           dtype=resolve_dtype(name, args.device))
        if args.packed_linears:
            pack_linears(models[name])
    return models, tokenizer


def requests(args: argparse.Namespace, model: PreTrainedModel,
             tokenizer: PreTrainedTokenizerBase) -> tuple[list[list[int]], list[int]]:
    """The prompts of ``--workload`` and each request's output length."""
    token_range = prompt_token_range(model, tokenizer)
    if args.workload == "uniform":
        workload = uniform_workload(args.num_requests, seed=args.seed, prompt_lens=(args.min_prompt, args.max_prompt),
                                    output_lens=(args.min_new, args.max_new), token_range=token_range)
        return workload.prompts(), workload.output_lens
    workload = sharegpt_workload(args.num_requests, seed=args.seed, max_prompt=args.max_prompt,
                                 max_output=10**6, token_range=token_range)
    return workload.prompts(), workload.scaled_output_lens(args.output_scale, args.max_new)


def run_contender(name: str, model: PreTrainedModel, prompts: list[list[int]], outputs: list[int],
                  args: argparse.Namespace, pad_id: int, budget: int, stock_attention: str) -> dict[str, Any]:
    """One run of contender `name` on `model` (whose own attention is `stock_attention`)."""
    if name == "dynamic":
        model.set_attn_implementation(stock_attention)
        return run_static(model, prompts, outputs, args, pad_id, paged=False, budget=budget)
    set_paged_attention(model)
    if name == "paged":
        return run_static(model, prompts, outputs, args, pad_id, paged=True, budget=budget)
    if name == "generate_batch":
        model.set_attn_implementation(stock_attention)  # its own paged attention needs a stock backend
        return run_generate_batch(model, prompts, outputs, args, budget)
    return run_batcher(model, prompts, outputs, args, budget, pack_steps=name == "batcher")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    models, tokenizer = load_models(args)
    model = models[args.dtypes[0]]  # the reference
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts, outputs = requests(args, model, tokenizer)
    per_token = kv_bytes_per_token(model.config, model.dtype)
    row_blocks = -(-(args.max_prompt + args.max_new) // args.block_size)  # a row's blocks at most
    one_batch = (args.batch_size * row_blocks + 1) * args.block_size * per_token  # + 1: the null block
    budget = parse_memory(args.budget) if args.budget else one_batch
    stock = {dtype: m.config._attn_implementation for dtype, m in models.items()}
    several = len(models) > 1
    pairs = {(f"{c}@{d}" if several else c): (c, d) for d in args.dtypes for c in args.contenders}

    def run(key: str, count: int) -> dict[str, Any]:
        contender, dtype = pairs[key]
        return in_fresh_thread(run_contender, contender, models[dtype], prompts[:count], outputs[:count], args,
                               pad_id, budget, stock[dtype])

    for key in pairs:  # warm-up round, untimed
        run(key, args.batch_size)
    runs: dict[str, list[dict[str, Any]]] = {key: [] for key in pairs}
    for _, key in tqdm([(r, key) for r in range(args.repeats) for key in pairs], desc="rounds", unit="run"):
        runs[key].append(run(key, len(prompts)))
    model.set_attn_implementation(stock[args.dtypes[0]])
    expected = None if args.skip_check else reference(model, prompts, outputs)

    useful = sum(outputs)
    results: dict[str, Any] = {
        "benchmark": "serving", "model": args.model, "dtype": str(model.dtype), "threads": torch.get_num_threads(),
        "workload": args.workload, "num_requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": useful, "prompt_lens": [len(p) for p in prompts], "output_lens": outputs,
        "budget_bytes": budget, "batch_size": args.batch_size, "dtypes": args.dtypes,
        "packed_linears": args.packed_linears, "contenders": {},
    }
    for key, rounds in runs.items():
        results["contenders"][key] = summarize(rounds, useful, expected)
        if several:
            contender, dtype = pairs[key]
            reference_key = f"{contender}@{args.dtypes[0]}"
            results["contenders"][key] |= {"dtype": str(models[dtype].dtype).removeprefix("torch."),
                                           **against_reference(rounds, runs[reference_key], useful)}
    write_json(args.out, results, model.device)
    print_report(results)
    return results


def summarize(rounds: list[dict[str, Any]], useful: int, expected: list[list[int]] | None) -> dict[str, Any]:
    """One contender's rounds: tokens/s and TTFT medians, and whether its tokens are greedy `generate`'s."""
    throughput = [useful / r["seconds"] for r in rounds]
    ttft = [percentile(r["ttft"], 0.5) for r in rounds], [percentile(r["ttft"], 0.95) for r in rounds]
    return {
        "tokens_per_s": statistics.median(throughput), "tokens_per_s_range": [min(throughput), max(throughput)],
        "ttft_p50_s": statistics.median(ttft[0]), "ttft_p95_s": statistics.median(ttft[1]),
        "seconds": [r["seconds"] for r in rounds],
        "tokens_identical": None if expected is None else all(r["tokens"] == expected for r in rounds),
        "preemptions": [r.get("preemptions") for r in rounds],
        "packed_steps": [r.get("packed_steps") for r in rounds],
    }


def against_reference(rounds: list[dict[str, Any]], reference_rounds: list[dict[str, Any]],
                      useful: int) -> dict[str, Any]:
    """A contender on one dtype against itself on the reference dtype, round by round (``--dtypes``)."""
    ratios = [base["seconds"] / r["seconds"] for r, base in zip(rounds, reference_rounds, strict=True)]
    differences = [first_difference(ours, theirs)
                   for ours, theirs in zip(rounds[0]["tokens"], reference_rounds[0]["tokens"], strict=True)]
    differing = [d for d in differences if d is not None]
    return {
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "requests_identical_to_reference": differences.count(None),
        "mean_first_difference": statistics.mean(differing) if differing else None,
        "same_tokens_every_round": all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
    }


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """The position of the first token that differs, or None if none does."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)


def print_report(results: dict[str, Any]) -> None:
    base = results["contenders"].get("dynamic", {}).get("tokens_per_s")
    reference = results["dtypes"][0]
    rows = []
    for name, r in results["contenders"].items():
        row = {
            "contender": name,
            "tokens/s": r["tokens_per_s"],
            "range": f"{r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}",
            "x dynamic": r["tokens_per_s"] / base if base else float("nan"),
            "TTFT p50 s": r["ttft_p50_s"],
            "TTFT p95 s": r["ttft_p95_s"],
            "tokens identical": r["tokens_identical"],
        }
        if "ratio_median" in r:
            row |= {f"x {reference} (median of rounds)": r["ratio_median"],
                    f"requests identical to {reference}": f"{r['requests_identical_to_reference']}/"
                                                          f"{results['num_requests']}",
                    "mean first difference": r["mean_first_difference"]}
        rows.append(row)
    print(f"{results['num_requests']} requests, {results['output_tokens']} output tokens, KV budget "
          f"{mib(results['budget_bytes']):.1f} MiB, {results['threads']} threads")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
    sys.exit(0)
