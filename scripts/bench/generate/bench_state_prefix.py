"""Time to first token of a follow-up turn on a model with conv / recurrent states: from a state snapshot, or anew.

Turn 1 is a document of ``--document`` random tokens (a multiple of 16) and ``--answer`` generated tokens on a
`PagedCache` of a pool; turn 2 is turn 1's prompt and answer and ``--question`` new tokens. Contenders, each on
turn 2, alternated, ``--repeats`` times after a warm-up, greedy, ``--max-new-tokens`` new tokens:

- ``snapshot``: a fresh `PagedCache` on turn 1's pool calls ``reuse_prefix(turn2)``, which starts it from the
  blocks and the state snapshot of the longest cached prefix (a block boundary turn 1's forwards ended at), so
  ``generate`` computes only the tokens after it;
- ``anew``: a fresh `PagedCache` on a pool of its own computes the whole prompt.

Both must give the same tokens. Prints the medians (with min-max) of each contender's time to first token and
the ratio.

Command (the run reported in docs/benchmarks.md; the model from ``random_model.py lfm2-350m``)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_state_prefix.py /tmp/lfm2-350m-random \
        --out results/bench_state_prefix_lfm2.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hf_paged_cache import KVPool, PagedCache
from hf_paged_cache.bench import FirstTokenTimer, write_json


def ask(model, pool: KVPool, prompt: torch.Tensor, new_tokens: int, reuse: bool) -> tuple[torch.Tensor, float, int]:
    """Greedy `new_tokens` after `prompt` ``[1, S]`` on a fresh cache of `pool`: the new tokens, the time to the
    first of them and the prompt tokens taken from the prefix cache."""
    with PagedCache(model, pool=pool) as cache:
        reused = cache.reuse_prefix(prompt) if reuse else 0
        timer = FirstTokenTimer()
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), cache=cache,
                             max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, streamer=timer)
    return out[0, prompt.shape[1]:], timer.seconds, reused


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a saved model with conv / recurrent states (e.g. from random_model.py)")
    parser.add_argument("--document", type=int, default=1024, help="turn 1's prompt tokens (default: 1024)")
    parser.add_argument("--answer", type=int, default=32, help="turn 1's generated tokens (default: 32)")
    parser.add_argument("--question", type=int, default=24, help="turn 2's new tokens (default: 24)")
    parser.add_argument("--max-new-tokens", type=int, default=4, help="turn 2's generated tokens (default: 4)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each contender (default: 5)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    if args.document % 16:
        parser.error("--document must be a multiple of 16 (its prompt then ends at a block boundary)")

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    document = torch.randint(3, vocab, (1, args.document))
    shared = KVPool.for_config(model.config)
    with PagedCache(model, pool=shared) as cache:
        turn1 = model.generate(input_ids=document, attention_mask=torch.ones_like(document), cache=cache,
                               max_new_tokens=args.answer, min_new_tokens=args.answer, do_sample=False)
    turn2 = torch.cat([turn1, torch.randint(3, vocab, (1, args.question))], dim=1)

    times: dict[str, list[float]] = {"snapshot": [], "anew": []}
    answers, reused = {}, 0
    for run in range(args.repeats + 1):  # run 0 warms up
        for name in (("snapshot", "anew") if run % 2 else ("anew", "snapshot")):
            pool = shared if name == "snapshot" else KVPool.for_config(model.config)
            tokens, seconds, hit = ask(model, pool, turn2, args.max_new_tokens, reuse=name == "snapshot")
            answers[name] = tokens
            if name == "snapshot":
                reused = hit
            if run:
                times[name].append(seconds)
    if not torch.equal(answers["snapshot"], answers["anew"]):
        raise RuntimeError("the answer from the snapshot differs from the answer computed anew")

    summary = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for name, t in times.items()}
    result = {
        "model": str(args.model), "threads": torch.get_num_threads(), "turn2_prompt_tokens": turn2.shape[1],
        "reused_tokens": reused, "computed_tokens": turn2.shape[1] - reused, "repeats": args.repeats,
        "ttft": summary, "speedup": summary["anew"]["median_s"] / summary["snapshot"]["median_s"],
    }
    print(f"turn 2: {turn2.shape[1]} prompt tokens, {reused} from the snapshot, {turn2.shape[1] - reused} computed; "
          f"{torch.get_num_threads()} threads")
    for name, row in summary.items():
        print(f"  {name:8s} TTFT {row['median_s'] * 1e3:8.1f} ms (min {row['min_s'] * 1e3:.1f}, "
              f"max {row['max_s'] * 1e3:.1f})")
    print(f"  speed-up {result['speedup']:.2f}x, answers identical")
    if args.out:
        write_json(args.out, result, "cpu")  # with the machine it ran on
    return result


if __name__ == "__main__":
    main()
