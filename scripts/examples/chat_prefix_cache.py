"""A multi-turn chat where each turn reuses the previous turns' KV blocks through the prefix cache.

Every turn's prompt is the whole conversation so far, chat-templated. With the prefix cache, a fresh
`PagedCache` on the shared pool first takes the longest cached prefix of that prompt
(`cache.reuse_prefix`), so `generate` computes only the tokens after it; without, the whole prompt is
prefilled again. Both paths must produce the same tokens; the script prints, per turn, the tokens reused
and computed and the time to first token (TTFT) of each path (one run each per turn, alternating which
goes first; turn 1, where both paths compute everything, shows the timing noise).

    python scripts/examples/chat_prefix_cache.py                 # SmolLM2-135M-Instruct, offline if needed
    python scripts/examples/chat_prefix_cache.py --turns 4 --max-new-tokens 48 --json results/chat.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_paged_cache import KVPool, PagedCache
from hf_paged_cache.bench import FirstTokenTimer
from hf_paged_cache.models import add_model_arguments, load_model_and_tokenizer

SYSTEM = (
    "You are a patient assistant for a small bakery. You know its opening hours (8am to 6pm, closed on "
    "Mondays), its bread (sourdough, rye, baguette, brioche) and its pastries (croissants, eclairs, "
    "cinnamon rolls). Answer in two or three sentences."
)
USER_TURNS = [
    "Hello! What bread do you bake?",
    "Which one would you pick for sandwiches, and why?",
    "Are you open on Monday morning?",
    "What pastry goes well with coffee?",
    "Thanks. Can you summarise our conversation in one sentence?",
]


def run_turn(model, input_ids: torch.Tensor, pool: KVPool, *, reuse: bool, max_new_tokens: int) -> dict:
    """Generate one turn on a fresh cache over `pool`; return tokens, reuse count and TTFT."""
    with PagedCache(model, pool=pool) as cache:
        reused = cache.reuse_prefix(input_ids) if reuse else 0
        timer = FirstTokenTimer()
        output = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            cache=cache,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=timer,
        )
    return {"new_tokens": output[0, input_ids.shape[1] :], "reused": reused, "ttft_s": timer.seconds}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--turns", type=int, default=len(USER_TURNS), help="user turns to run (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="tokens per answer (default: 40)")
    parser.add_argument("--num-blocks", type=int, default=512, help="blocks in each of the two pools (default: 512)")
    parser.add_argument(
        "--json", type=Path, default=None,
        help="write the per-turn results to this JSON file (default: none)",
    )
    args = parser.parse_args(argv)

    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    cached_pool = KVPool.for_config(model.config, num_blocks=args.num_blocks, dtype=model.dtype)
    plain_pool = KVPool.for_config(model.config, num_blocks=args.num_blocks, dtype=model.dtype)
    messages = [{"role": "system", "content": SYSTEM}]
    # warm-up, so that the first turn's timing is not the first forward's
    warm = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    run_turn(model, warm["input_ids"].to(args.device), plain_pool, reuse=False, max_new_tokens=2)

    turns = []
    header = ("turn", "prompt", "reused", "computed", "TTFT cached", "TTFT full", "speed-up")
    print("{:>4} {:>7} {:>7} {:>9} {:>12} {:>10} {:>9}".format(*header))
    for turn, user in enumerate(USER_TURNS[: args.turns], start=1):
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(args.device)
        # alternate which path runs first, so neither always gets the warmer machine
        order = [(True, cached_pool), (False, plain_pool)][:: 1 if turn % 2 else -1]
        runs = {
            reuse: run_turn(model, prompt, pool, reuse=reuse, max_new_tokens=args.max_new_tokens)
            for reuse, pool in order
        }
        cached, full = runs[True], runs[False]
        if not torch.equal(cached["new_tokens"], full["new_tokens"]):
            raise RuntimeError(f"turn {turn}: the prefix-cached answer differs from the fully computed one")
        answer = tokenizer.decode(cached["new_tokens"], skip_special_tokens=True)
        messages.append({"role": "assistant", "content": answer})
        row = {
            "turn": turn,
            "prompt_tokens": prompt.shape[1],
            "reused_tokens": cached["reused"],
            "computed_tokens": prompt.shape[1] - cached["reused"],
            "ttft_cached_s": cached["ttft_s"],
            "ttft_full_s": full["ttft_s"],
            "answer": answer,
        }
        turns.append(row)
        print(
            f"{turn:>4} {row['prompt_tokens']:>7} {row['reused_tokens']:>7} {row['computed_tokens']:>9} "
            f"{row['ttft_cached_s'] * 1e3:>10.1f}ms {row['ttft_full_s'] * 1e3:>8.1f}ms "
            f"{row['ttft_full_s'] / row['ttft_cached_s']:>8.2f}x"
        )
    stats = cached_pool.blocks.prefix_stats()
    results = {
        "answers_identical": True,  # a differing turn raised above
        "turns": turns,
        "prefix_cache": {"hits": stats.hits, "misses": stats.misses, "evictions": stats.evictions},
    }
    print(f"answers identical: all {len(turns)} turns gave the same tokens with and without prefix reuse")
    print(f"prefix cache: {stats.hits} block hits, {stats.misses} misses, {stats.evictions} evictions")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
