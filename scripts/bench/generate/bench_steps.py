"""Decode steps of one batch, the caches alternated step by step in one process: the finest A/B of paging.

`scripts/bench/generate/bench_decode.py` times whole ``generate`` runs, one cache after the other; on a shared CPU whose
speed drifts from minute to minute, a pair of runs seconds apart can differ by 10% or more for no reason of
their own. Here every variant holds its own cache of the same left-padded batch, prefilled once, and each
decode step runs the same new tokens through every variant in turn, the order rotated from step to step
(A, B, C; B, C, A; ...), so neighbouring forwards, milliseconds apart, meet the same machine. For each
variant against the first (``dynamic`` by default) the script reports the median of the per-step time
ratios with their quartiles, after ``--warmup-steps`` untimed steps.

The new tokens are the first variant's greedy choices (as ``generate`` would feed them), so every variant
computes exactly the same steps; each step's last-position logits are compared with the first variant's
(largest absolute difference, and whether every greedy choice agrees). Inputs are built as ``generate``
builds them: the attention mask grows by one column a step and each row's position is its count of real
tokens so far. Variants: ``dynamic``, ``paged``, ``paged_sdpa``, ``paged_bmm``, ``paged_flex``
(see `hf_paged_cache.bench.VARIANTS`; ``paged_flex`` compiles its kernel in the untimed warm-up steps).

``--prompt-lens`` gives the batch: lengths separated by commas, ``LxN`` for ``N`` rows of ``L`` tokens (e.g.
``512`` for batch 1, ``300x16`` for 16 equal rows, ``60,150,250,400,550,700,850,1000`` for a ragged batch).

``--fixed-cost`` times the model's architecture with its widths cut to a few units (`hf_paged_cache.bench.narrowed`:
the same layers, heads, vocabulary and caches, random weights): its products cost next to nothing, so each
variant's step time is what a step costs it beyond the math (Python, the cache's bookkeeping, op dispatch).

Commands (the CPU runs reported in docs/benchmarks.md)::

    python scripts/bench/generate/bench_steps.py --threads 1 --prompt-lens 512 --pad-heap --out results/bench_steps_b1_t1.json
    python scripts/bench/generate/bench_steps.py --threads 2 --prompt-lens 60,150,250,400,550,700,850,1000 --pad-heap \
        --out results/bench_steps_ragged8_t2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import (
    VARIANTS,
    add_common_args,
    fixed_length_workload,
    format_table,
    left_pad,
    load,
    median,
    narrowed,
    pad_token_id,
    paged_pool_blocks,
    percentile,
    prompt_token_range,
    synchronize,
    variant_attention,
    write_json,
)
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.serving.heap import pad_heap


def parse_prompt_lens(text: str) -> list[int]:
    """``"60,150"`` -> ``[60, 150]``; ``"300x3"`` -> ``[300, 300, 300]``; the two forms mix."""
    lens: list[int] = []
    for item in text.split(","):
        length, _, count = item.strip().partition("x")
        lens += [int(length)] * (int(count) if count else 1)
    return lens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_steps.json")
    parser.add_argument("--prompt-lens", default="512",
                        help="the batch's prompt lengths, e.g. 60,1000 or 300x16 (default: 512)")
    parser.add_argument("--steps", type=int, default=64, help="timed decode steps (default: 64)")
    parser.add_argument("--warmup-steps", type=int, default=8, help="untimed decode steps first (default: 8)")
    parser.add_argument("--variants", default="dynamic,paged_sdpa",
                        help=f"caches to compare, the first the reference, from {','.join(VARIANTS)} "
                        "(default: dynamic,paged_sdpa)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument("--pad-heap", action="store_true",
                        help="keep freed memory in the heap (pad_heap, as the server does) for every variant "
                        "alike (without it: glibc's own settings)")
    parser.add_argument("--fixed-cost", action="store_true",
                        help="time the model's architecture with its widths cut to a few units (random weights): "
                        "what a step costs beyond its products")
    parser.add_argument("--packed-linears", action="store_true",
                        help="multiply through oneDNN-packed weights (pack_linears, as the server does on a "
                        "CPU) for every variant alike (without it: the stock kernels)")
    args = parser.parse_args(argv)
    args.prompt_lens = parse_prompt_lens(args.prompt_lens)
    args.variants = [v for v in args.variants.split(",") if v]
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {VARIANTS}")
    if len(set(args.variants)) != len(args.variants) or len(args.variants) < 2:
        parser.error("--variants needs two or more different caches")
    if args.steps < 1 or args.warmup_steps < 0:
        parser.error("--steps must be >= 1 and --warmup-steps >= 0")
    return args


def new_cache(model: PreTrainedModel, variant: str, prompt_lens: list[int], steps: int, block_size: int) -> Any:
    if variant == "dynamic":
        return DynamicCache(config=model.config)
    # the prefill, then `steps` forwards of one token: as generate with steps + 1 new tokens stores
    blocks = paged_pool_blocks(prompt_lens, steps + 1, expand=1, block_size=block_size)
    return PagedCache(model, block_size=block_size, num_blocks=blocks)


def forward(model: PreTrainedModel, variant: str, cache: Any, input_ids: torch.Tensor,
            mask: torch.Tensor) -> tuple[torch.Tensor, float]:
    """One forward of `variant` over `input_ids` ``[B, q]``: its last-position logits ``[B, V]`` and its
    seconds."""
    # [B, q]: each new token's count of real tokens before it, as generate computes positions
    positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -input_ids.shape[1]:]
    with variant_attention(model, variant):
        synchronize(input_ids.device)
        start = time.perf_counter()
        out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                    use_cache=True, logits_to_keep=1)
        synchronize(input_ids.device)
        seconds = time.perf_counter() - start
    return out.logits[:, -1].float(), seconds


@dataclass
class LogitComparison:
    """Each variant's last-position logits against the first variant's, step after step."""

    variants: list[str]
    max_abs_logit: float = 0.0  # the first variant's largest |logit|: what the differences compare with
    max_diff: dict[str, float] = field(default_factory=dict)  # per other variant: its largest |difference|
    same_tokens: dict[str, bool] = field(default_factory=dict)  # per other variant: every greedy choice agreed

    def add(self, logits: dict[str, torch.Tensor]) -> None:
        """Compare one forward's logits ``[B, V]`` of every variant."""
        reference = logits[self.variants[0]]
        self.max_abs_logit = max(self.max_abs_logit, float(reference.abs().max()))
        for v in self.variants[1:]:
            self.max_diff[v] = max(self.max_diff.get(v, 0.0), float((logits[v] - reference).abs().max()))
            agree = bool(torch.equal(logits[v].argmax(-1), reference.argmax(-1)))
            self.same_tokens[v] = self.same_tokens.get(v, True) and agree


def run(model: PreTrainedModel, batch: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """Prefill every variant's cache, then alternate the decode steps: per variant its step times and how its
    logits compare with the first variant's (``variants``), and the largest |logit| seen (``max_abs_logit``)."""
    variants, total = args.variants, args.warmup_steps + args.steps
    caches = {v: new_cache(model, v, args.prompt_lens, total, args.block_size) for v in variants}
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    comparison = LogitComparison(variants)
    mask = batch["attention_mask"]  # [B, S]
    with torch.inference_mode():
        logits = {v: forward(model, v, caches[v], batch["input_ids"], mask)[0] for v in variants}  # prefill
        comparison.add(logits)
        for step in range(total):
            new_ids = logits[variants[0]].argmax(-1, keepdim=True)  # [B, 1]
            mask = torch.cat([mask, torch.ones_like(new_ids)], dim=1)  # [B, S + step + 1]
            turn = step % len(variants)
            for v in variants[turn:] + variants[:turn]:
                logits[v], took = forward(model, v, caches[v], new_ids, mask)
                if step >= args.warmup_steps:
                    seconds[v].append(took)
            comparison.add(logits)
    for cache in caches.values():
        if isinstance(cache, PagedCache):
            cache.release()
    return {"max_abs_logit": comparison.max_abs_logit, "variants": summarize(seconds, comparison)}


def summarize(seconds: dict[str, list[float]], comparison: LogitComparison) -> dict[str, Any]:
    """Per variant: median and quartiles of its step times; for the others, of the per-step ratios of the first
    variant's time to theirs (> 1: faster), and their logit comparison."""
    first = comparison.variants[0]
    results: dict[str, Any] = {}
    for v, own in seconds.items():
        step_ms = [s * 1e3 for s in own]
        results[v] = {"step_ms": median(step_ms),
                      "step_ms_quartiles": [percentile(step_ms, 0.25), percentile(step_ms, 0.75)],
                      "step_seconds": own}
        if v != first:
            speed = [b / s for b, s in zip(seconds[first], own, strict=True)]
            results[v] |= {"speed": median(speed),
                           "speed_quartiles": [percentile(speed, 0.25), percentile(speed, 0.75)],
                           "max_abs_logit_diff": comparison.max_diff[v],
                           "same_greedy_tokens": comparison.same_tokens[v]}
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.pad_heap and not pad_heap():
        print("--pad-heap: not glibc, malloc left as is", file=sys.stderr)
    model, tokenizer = load(args)
    if args.fixed_cost:
        model = narrowed(model, seed=args.seed)
    if args.packed_linears:
        pack_linears(model)
    workload = fixed_length_workload(args.prompt_lens, seed=args.seed, output_len=args.steps,
                                     token_range=prompt_token_range(model, tokenizer))
    batch = left_pad(workload.prompts(), pad_token_id(model, tokenizer), args.device)  # [B, S] each
    measured = run(model, batch, args)
    payload: dict[str, Any] = {
        "benchmark": "steps",
        "command": "python scripts/bench/generate/bench_steps.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "hidden_size": model.config.get_text_config(decoder=True).hidden_size,  # narrowed with --fixed-cost
        "threads": torch.get_num_threads(),
        "prompt_lens": args.prompt_lens,
        "reference": args.variants[0],
        **measured,  # max_abs_logit, and per variant its step times and logit comparison
    }
    write_json(args.out, payload, args.device)
    print_report(payload)
    return payload


def print_report(payload: dict[str, Any]) -> None:
    args = payload["args"]
    rows = []
    for variant, r in payload["variants"].items():
        rows.append({
            "cache": variant,
            "ms / step": r["step_ms"],
            "quartiles": "{:.1f}-{:.1f}".format(*r["step_ms_quartiles"]),
            f"speed vs {payload['reference']}": r.get("speed", ""),
            "quartiles of the ratio": "{:.3f}-{:.3f}".format(*r["speed_quartiles"]) if "speed" in r else "",
            "max |logit diff|": f"{r['max_abs_logit_diff']:.1e}" if "speed" in r else "",
            "same tokens": r.get("same_greedy_tokens", ""),
        })
    narrowed_to = f" narrowed to hidden size {payload['hidden_size']} (--fixed-cost)" if args["fixed_cost"] else ""
    print(f"\n{payload['model']}{narrowed_to} {payload['dtype']}, {payload['threads']} threads, "
          f"{len(payload['prompt_lens'])} rows, {args['steps']} decode steps alternated "
          f"(after {args['warmup_steps']} untimed)")
    print(format_table(rows, list(rows[0])))
    print(f"largest |logit| of {payload['reference']}: {payload['max_abs_logit']:.1f}")


if __name__ == "__main__":
    main()
