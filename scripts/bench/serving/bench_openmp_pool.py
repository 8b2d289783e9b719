"""A `ContinuousBatcher` started on the thread that loaded the model: that thread's idle OpenMP workers ended
(``released``, what `submit` does) or kept (``kept``, as before), on the default model.

Each run is a fresh process at ``--threads`` torch threads: the main thread loads the model and packs it for oneDNN
(`pack_linears`, as the server does), builds the batcher, warms it up with one request, then times one greedy
request of ``--new-tokens`` tokens after a prompt of about 55 tokens, streamed: the first token's time and a decode
step's (``(whole - first) / (new - 1)``). The two variants alternate for ``--runs`` runs each (the order turned every
other round). Reported: per variant the medians (min-max) in milliseconds, and the ratio kept / released.

Command (the run reported in docs/benchmarks.md)::

    python scripts/bench/serving/bench_openmp_pool.py --out results/bench_openmp_pool.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

VARIANTS = ("released", "kept")


def child(variant: str, new_tokens: int) -> dict[str, float]:
    """One run in this process: load, build the batcher on this (the main) thread, warm up, time one request."""
    import hf_paged_cache.engine.batcher as batcher_module
    from hf_paged_cache import ContinuousBatcher
    from hf_paged_cache.bench.quantized import prompt_texts
    from hf_paged_cache.kernels import pack_linears
    from hf_paged_cache.models import load_model_and_tokenizer

    if variant == "kept":
        batcher_module.release_openmp_pool = lambda: False  # as before: the loading thread's workers stay
    model, tokenizer = load_model_and_tokenizer()
    pack_linears(model)
    prompt = tokenizer(prompt_texts(1)[0]).input_ids
    settings = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with ContinuousBatcher(model) as batcher:
        batcher.submit(prompt, max_new_tokens=8, do_sample=False).result(timeout=600)  # warm-up
        start = time.perf_counter()
        stamps = [time.perf_counter() - start for _ in batcher.submit(prompt, **settings)]
    return {"first_ms": 1000 * stamps[0], "step_ms": 1000 * (stamps[-1] - stamps[0]) / (len(stamps) - 1)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per variant (default: 3)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of each run (default: 2)")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.new_tokens)))
        return {}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in VARIANTS}
    for round_ in range(args.runs):
        for variant in (VARIANTS if round_ % 2 == 0 else VARIANTS[::-1]):
            command = [sys.executable, __file__, "--child", variant, "--new-tokens", str(args.new_tokens)]
            output = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            runs[variant].append(json.loads(output.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {variant}: {runs[variant][-1]}", flush=True)
    summary = {}
    for variant, measured in runs.items():
        summary[variant] = {key: {"median": statistics.median(m[key] for m in measured),
                                  "range": [min(m[key] for m in measured), max(m[key] for m in measured)]}
                            for key in ("first_ms", "step_ms")}
    ratio = summary["kept"]["step_ms"]["median"] / summary["released"]["step_ms"]["median"]
    result = {"threads": args.threads, "new_tokens": args.new_tokens, "runs": runs, "summary": summary,
              "step_ratio_kept_over_released": ratio}
    print(json.dumps(summary, indent=1))
    print(f"decode step: kept {summary['kept']['step_ms']['median']:.1f} ms, released "
          f"{summary['released']['step_ms']['median']:.1f} ms ({ratio:.2f}x)")
    if args.out:
        from hf_paged_cache.bench import write_json

        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
