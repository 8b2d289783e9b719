"""The model's dtype on the batcher: float32 against bfloat16 (``--dtypes``), the same requests, alternated.

Workload: `bench_serving.py`'s, ``--num-requests`` requests of the seeded ShareGPT-shaped stream arriving at
once, prompts capped at ``--max-prompt``, request ``i`` generating ``clamp(round(draw_i x --output-scale), 1,
--max-new)`` tokens with EOS off. Each dtype's model is loaded once, its linear layers packed for oneDNN
(``pack_linears``, as the server does on a CPU), and runs a `ContinuousBatcher` of ``--budget``. After one
untimed warm-up run per dtype, rounds alternate the dtypes (A, B, A, B, ...), each on a fresh thread.

Reported per dtype: output tokens/s (``sum(o_i) / wall seconds``, prefill included; median and range over the
rounds), each round's ratio to the first dtype (the reference) and their median, and against the reference's tokens: the
requests whose tokens are all the same and the mean position of the first different token among the others
(reduced precision follows its own rounding at near-ties; see `tests/test_model_dtype.py` for the logits).

Commands (the numbers in docs/benchmarks.md)::

    python scripts/bench/serving/bench_model_dtype.py --threads 1 --out results/bench_model_dtype_1t.json
    python scripts/bench/serving/bench_model_dtype.py --threads 2 --out results/bench_model_dtype_2t.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from hf_paged_cache import ContinuousBatcher, parse_memory
from hf_paged_cache.bench import format_table, in_fresh_thread, prompt_token_range, sharegpt_workload, write_json
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import DTYPE_CHOICES, load_model_and_tokenizer, resolve_dtype


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="Hub id or local path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help=f"comma-separated, the first the reference, from {','.join(DTYPE_CHOICES)} "
                             "(default: float32,bfloat16)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--num-requests", type=int, default=32, help="requests (default: 32)")
    parser.add_argument("--max-prompt", type=int, default=256, help="cap on prompt tokens (default: 256)")
    parser.add_argument("--max-new", type=int, default=128, help="cap on output tokens (default: 128)")
    parser.add_argument("--output-scale", type=float, default=0.25,
                        help="multiplies the drawn output lengths before the cap (default: 0.25)")
    parser.add_argument("--budget", default="1GiB", help="the batcher's KV budget (default: 1GiB)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per dtype (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--out", default="results/bench_model_dtype.json", help="JSON output path "
                        "(default: results/bench_model_dtype.json)")
    return parser.parse_args(argv)


def run_batcher(model: PreTrainedModel, prompts: list[list[int]], outputs: list[int], budget: int) -> dict[str, Any]:
    with ContinuousBatcher(model, max_memory=budget) as batcher:
        start = time.perf_counter()
        handles = [batcher.submit(p, max_new_tokens=n, do_sample=False, eos_token_id=None)
                   for p, n in zip(prompts, outputs, strict=True)]
        tokens = [h.result() for h in handles]
        return {"seconds": time.perf_counter() - start, "tokens": tokens}


def first_difference(ours: list[int], reference: list[int]) -> int | None:
    """The position of the first token that differs, or None if none does."""
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    dtypes = {name: resolve_dtype(name) for name in names}  # "auto" resolves on this machine
    models: dict[str, PreTrainedModel] = {}
    for name, dtype in dtypes.items():
        models[name], tokenizer = load_model_and_tokenizer(args.model, dtype=dtype)
        pack_linears(models[name])
    workload = sharegpt_workload(args.num_requests, seed=args.seed, max_prompt=args.max_prompt, max_output=10**6,
                                 token_range=prompt_token_range(models[names[0]], tokenizer))
    prompts = workload.prompts()
    outputs = workload.scaled_output_lens(args.output_scale, args.max_new)
    budget = parse_memory(args.budget)

    def run(name: str, count: int) -> dict[str, Any]:
        return in_fresh_thread(run_batcher, models[name], prompts[:count], outputs[:count], budget)

    for name in names:  # warm-up, untimed
        run(name, min(4, len(prompts)))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _, name in tqdm([(r, n) for r in range(args.repeats) for n in names], desc="rounds", unit="run"):
        runs[name].append(run(name, len(prompts)))

    useful = sum(outputs)
    reference = runs[names[0]][0]["tokens"]
    results: dict[str, Any] = {
        "benchmark": "model_dtype", "model": args.model or "default", "threads": torch.get_num_threads(),
        "num_requests": len(prompts), "prompt_tokens": sum(len(p) for p in prompts), "output_tokens": useful,
        "budget_bytes": budget, "dtypes": {},
    }
    for name, rounds in runs.items():
        throughput = [useful / r["seconds"] for r in rounds]
        ratios = [t / (useful / base["seconds"]) for t, base in zip(throughput, runs[names[0]], strict=True)]
        differences = [first_difference(t, e) for t, e in zip(rounds[0]["tokens"], reference, strict=True)]
        differing = [d for d in differences if d is not None]
        results["dtypes"][name] = {
            "dtype": str(dtypes[name]).removeprefix("torch."),
            "tokens_per_s": statistics.median(throughput), "tokens_per_s_range": [min(throughput), max(throughput)],
            "ratio_per_round": ratios,
            "ratio_median": statistics.median(ratios),
            "requests_identical_to_reference": differences.count(None),
            "mean_first_difference": statistics.mean(differing) if differing else None,
            "same_tokens_every_round": all(r["tokens"] == rounds[0]["tokens"] for r in rounds),
        }
    write_json(args.out, results, "cpu")
    print_report(results, names[0])
    return results


def print_report(results: dict[str, Any], reference: str) -> None:
    rows = [{
        "dtype": f"{name} ({r['dtype']})" if name != r["dtype"] else name,
        "tokens/s": r["tokens_per_s"],
        "range": f"{r['tokens_per_s_range'][0]:.1f}-{r['tokens_per_s_range'][1]:.1f}",
        f"x {reference} (median of rounds)": r["ratio_median"],
        "per round": ", ".join(f"{x:.2f}" for x in r["ratio_per_round"]),
        f"requests identical to {reference}": f"{r['requests_identical_to_reference']}/{results['num_requests']}",
        "mean first difference": r["mean_first_difference"],
    } for name, r in results["dtypes"].items()]
    print(f"{results['num_requests']} requests, {results['output_tokens']} output tokens, {results['threads']} threads")
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
    sys.exit(0)
