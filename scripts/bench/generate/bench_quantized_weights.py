"""Quantized weights (`quantize_weights`) against float32 on the default model: decode steps and first tokens, at 1
and 16 rows, and how long the greedy answers agree.

Models from one float32 load (``--models``), each then packed for oneDNN as the server packs it (`pack_linears`:
the layers left in float): **float32**; **int8**, every linear layer but the output head as int8 codes
(``serve --quantize int8``); **int8-all**, the output head too; **int4** and **int4-all**, the same at 4 bits
(groups of 32). Each generates ``--new-tokens`` greedy tokens with a `PagedCache` for ``--rows`` prompts (one
text behind a different first line each, about 55 tokens, left-padded), alternated (every model in turn, then
the order turned) for ``--repeats`` rounds after a warm-up. Reported per model and row
count: the first token's time (the prompt's forward), the decode time a step (``(whole - first) / (new - 1)``),
medians (min-max), the linear weights' bytes, and the first new token where its greedy answer leaves
float32's (the answers agree before it).

Commands (the runs reported in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_quantized_weights.py --models float32,int8,int8-all \
        --out results/bench_int8_weights.json
    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_quantized_weights.py --models float32,int8,int4,int4-all \
        --out results/bench_int4_weights.json
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.quantized import (
    agreeing_tokens,
    alternated_runs,
    prompt_texts,
    quantized_models,
    timing_summary,
    weight_bytes,
)
from hf_paged_cache.kernels import QUANTIZE_CHOICES
from hf_paged_cache.models import load_model_and_tokenizer

MODELS = ("float32", *QUANTIZE_CHOICES)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="float32,int8,int8-all",
                        help=f"comma-separated, float32 first, from {', '.join(MODELS)} "
                             "(default: float32,int8,int8-all)")
    parser.add_argument("--rows", default="1,16", help="row counts (default: 1,16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    names = tuple(args.models.split(","))
    if names[0] != "float32" or not set(names) <= set(MODELS):
        parser.error(f"--models: float32 first, then any of {', '.join(MODELS[1:])}")

    base, tokenizer = load_model_and_tokenizer()
    models = quantized_models(base, names)
    result = {"models": list(names), "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "weight_bytes": {n: weight_bytes(m) for n, m in models.items()},
              "rows": {}}
    for rows in (int(r) for r in args.rows.split(",")):
        batch = tokenizer(prompt_texts(rows), return_tensors="pt", padding=True)  # [rows, P], left-padded
        ids, mask = batch.input_ids, batch.attention_mask
        firsts, steps, answers = alternated_runs(models, ids, mask, args.new_tokens, args.repeats)
        entry = {}
        for name in names:
            agree = agreeing_tokens(answers[name][0], answers["float32"][0])  # the first prompt's answer
            entry[name] = {**timing_summary(firsts[name], steps[name]), "agrees_for": agree}
            print(f"rows {rows} {name}: first token {entry[name]['first_ms']:.0f} ms, decode "
                  f"{entry[name]['step_ms']:.1f} ms a step ({1000 * min(steps[name]):.1f}-"
                  f"{1000 * max(steps[name]):.1f}), greedy answer as float32's for {agree} tokens", flush=True)
        result["rows"][str(rows)] = entry
    for name, size in result["weight_bytes"].items():
        print(f"{name}: linear weights {size / 2**20:.1f} MiB")
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
