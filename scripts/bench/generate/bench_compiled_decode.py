"""Does a compiled decode forward (`hf_paged_cache.compiled.CompiledForward`, ``serve --compile``) beat the eager one?

Two caches of the same ``--rows`` rows (the offline Wikipedia excerpt's tokens, ``--context`` each), prefilled
eagerly; then decode steps alternated between the eager forward (the model's own, ``paged_sdpa``, packed linear
layers) on one and the compiled forward on the other, both fed the eager forward's greedy tokens; the first
``--warmup`` pairs untimed (the compiled forward's first call compiles it, timed apart). Reported: medians and
quartiles of ``--steps`` steps each, and how many steps' greedy tokens agreed.

Command (the numbers in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_compiled_decode.py --rows 1,16 \
        --out results/bench_compiled_decode.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_paged_cache import CompiledForward, PagedCache, set_paged_attention
from hf_paged_cache.bench import write_json
from hf_paged_cache.eval.corpora import load_corpus_text
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import add_model_arguments, load_model_and_tokenizer


def quartiles(values: list[float]) -> dict[str, float]:
    q1, median, q3 = statistics.quantiles(values, n=4)
    return {"median": median, "q1": q1, "q3": q3}


def run(model, compiled: CompiledForward, prompt: torch.Tensor, steps: int, warmup: int) -> dict:
    """Alternate eager and compiled decode steps on two caches of `prompt` ``[B, L]``."""
    caches = []
    for _ in range(2):
        cache = PagedCache(model, manual_commit=True)
        first = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        cache.commit()
        caches.append(cache)
    eager_cache, compiled_cache = caches
    tokens = first.argmax(-1, keepdim=True)  # [B, 1]
    times = {"eager": [], "compiled": []}
    agreed, first_call = 0, None
    for step in range(warmup + steps):
        positions = torch.full_like(tokens, prompt.shape[1] + step)
        start = time.perf_counter()
        eager = model(input_ids=tokens, position_ids=positions, cache=eager_cache, use_cache=True,
                      logits_to_keep=1).logits[:, -1]
        eager_cache.commit()
        middle = time.perf_counter()
        got = compiled(compiled_cache, tokens, positions)[:, -1]
        compiled_cache.commit()
        end = time.perf_counter()
        if step == 0:
            first_call = end - middle
        if step >= warmup:
            times["eager"].append((middle - start) * 1e3)
            times["compiled"].append((end - middle) * 1e3)
            agreed += int(torch.equal(eager.argmax(-1), got.argmax(-1)))
        tokens = eager.argmax(-1, keepdim=True)
    result = {name: quartiles(values) for name, values in times.items()}
    result["eager_over_compiled"] = result["eager"]["median"] / result["compiled"]["median"]
    result["steps_agreeing"], result["steps"], result["first_compiled_call_s"] = agreed, steps, first_call
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--rows", default="1,16", help="rows of each run, comma-separated (default: 1,16)")
    parser.add_argument("--context", type=int, default=300, help="prompt tokens per row (default: 300)")
    parser.add_argument("--steps", type=int, default=40, help="timed decode steps of each kind (default: 40)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (default: 3)")
    parser.add_argument("--out", default="results/bench_compiled_decode.json", help="JSON output "
                        "(default: results/bench_compiled_decode.json)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    set_paged_attention(model)
    pack_linears(model)
    compiled = CompiledForward(model)
    ids = tokenizer(load_corpus_text("offline").text, return_tensors="pt").input_ids[0]
    runs = {}
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            prompt = torch.stack([ids[i * args.context : (i + 1) * args.context] for i in range(rows)])  # [B, L]
            runs[rows] = run(model, compiled, prompt, args.steps, args.warmup)
            r = runs[rows]
            print(f"{rows} rows: eager {r['eager']['median']:.1f} ms, compiled {r['compiled']['median']:.1f} ms, "
                  f"{r['eager_over_compiled']:.3f}x; tokens agreed {r['steps_agreeing']}/{r['steps']}; first "
                  f"compiled call {r['first_compiled_call_s']:.1f} s", flush=True)
    write_json(args.out, {"threads": torch.get_num_threads(), "context": args.context, "runs": runs}, "cpu")


if __name__ == "__main__":
    main()
