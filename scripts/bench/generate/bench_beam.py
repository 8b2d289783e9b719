"""Beam search memory and speed: PagedCache against DynamicCache in the same run (issue #3's benchmark).

``--batch-size`` random-token prompts of exactly ``--prompt-len`` tokens (default: 1 x 512) generate
``--new-tokens`` tokens (default: 128, all of them: ``min_new_tokens`` = ``max_new_tokens``) by beam search
with ``--num-beams`` beams (default: 4), ``return_dict_in_generate=True``, once with a ``DynamicCache`` and
once with a ``PagedCache`` (default: attention; ``--paged-sdpa`` switches to ``paged_sdpa``), alternated
D, P, D, P, ... for ``--repeats`` rounds after one untimed warm-up of each.

Memory, read from the cache ``generate`` hands back (``out.cache``, the cache that was passed in):

- DynamicCache: bytes of its layers' key and value tensors (every beam holds a full private copy of the
  prompt and of its history: ``B x beams x (prompt + new - 1)`` positions);
- PagedCache: ``stats().bytes_reserved`` = distinct blocks in use x bytes per block (beams share the
  prompt's blocks and their common history by reference count);
- ratio = paged / dynamic (target <= 0.60); also the high-water mark of both, sampled after every step.

Speed: end-to-end tokens/s = ``B x N / seconds`` (returned sequences, one per request), decode tokens/s
from the per-step timestamps as in ``bench_decode.py``, and tokens per process-CPU second (steadier on a
shared CPU, see `hf_paged_cache.bench.timing.Timer`); each paged / dynamic ratio is taken between adjacent runs and its
median over repeats reported (target: PagedCache faster, ratio > 1).

Command (the CPU run reported in docs/benchmarks.md; defaults are issue #3's 512-token prompt and 128 tokens)::

    python scripts/bench/generate/bench_beam.py --threads 1 --out results/bench_beam.json
"""

from __future__ import annotations

import argparse
import random
import sys
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel

from hf_paged_cache import PagedCache, set_paged_attention
from hf_paged_cache.bench import (
    StepClock,
    Timer,
    add_common_args,
    cache_tensor_bytes,
    format_table,
    load,
    median,
    mib,
    paged_blocks,
    peak_memory,
    prompt_token_range,
    reset_peak_memory,
    write_json,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_beam.json")
    parser.add_argument("--prompt-len", type=int, default=512, help="prompt tokens (default: 512)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens (default: 128)")
    parser.add_argument("--num-beams", type=int, default=4, help="beams (default: 4)")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts in the batch (default: 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument("--paged-sdpa", action="store_true", help="run PagedCache with paged_sdpa attention")
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2")
    return args


def make_prompts(model: PreTrainedModel, tokenizer: Any, args: argparse.Namespace) -> torch.Tensor:
    """``[B, prompt_len]`` random token ids (no padding, no special tokens), seeded by ``--seed``."""
    low, high = prompt_token_range(model, tokenizer)
    rng = random.Random(args.seed)
    rows = [[rng.randrange(low, high) for _ in range(args.prompt_len)] for _ in range(args.batch_size)]
    return torch.tensor(rows, dtype=torch.long, device=args.device)


def run_once(
    model: PreTrainedModel, input_ids: torch.Tensor, variant: str, new_tokens: int, args: argparse.Namespace
) -> tuple[dict[str, Any], torch.Tensor]:
    device = torch.device(args.device)
    rows = args.batch_size * args.num_beams
    if variant == "dynamic":
        cache: Any = DynamicCache(config=model.config)
        probe = lambda: cache_tensor_bytes(cache)  # noqa: E731
    else:
        # Upper bound: every beam row with a private prompt + history, one copy-on-write block each, null block.
        blocks = rows * (paged_blocks([args.prompt_len + new_tokens], args.block_size) + 1) + 1
        cache = PagedCache(model, block_size=args.block_size, num_blocks=blocks)
        probe = lambda: cache.pool.blocks.num_used * cache.pool.bytes_per_block  # noqa: E731
    clock = StepClock(device, probe=probe)
    original = model.config._attn_implementation
    if variant == "paged" and args.paged_sdpa:
        set_paged_attention(model)
    reset_peak_memory(device)
    try:
        with torch.inference_mode(), Timer(device) as timer:
            out = model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                cache=cache,
                num_beams=args.num_beams,
                num_return_sequences=1,
                do_sample=False,
                early_stopping=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                return_dict_in_generate=True,
                logits_processor=LogitsProcessorList([clock]),
            )
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)
    returned = out.cache if getattr(out, "cache", None) is not None else cache
    if returned is not cache:
        raise RuntimeError("generate returned a different cache from the one passed in")
    if variant == "dynamic":
        kv_bytes = cache_tensor_bytes(cache)
        extra: dict[str, Any] = {"positions_per_row": cache.get_seq_length(), "rows": rows}
        peak = peak_memory(device, clock.high_water)
    else:
        stats = cache.stats()
        kv_bytes = stats.bytes_reserved
        extra = {
            "blocks_in_use": stats.blocks_in_use,
            "tokens_stored": stats.tokens_stored,
            "utilization": stats.utilization,
            "pool_bytes": cache.pool.storage_bytes(),
        }
        peak = peak_memory(device, cache.pool.storage_bytes())
        cache.release()
    steps = len(clock.stamps)
    decode = clock.stamps[-1] - clock.stamps[0]
    result = {
        "variant": variant,
        "kv_bytes_end": kv_bytes,
        "kv_high_water_bytes": clock.high_water,
        "seconds": timer.seconds,
        "ttft_seconds": clock.stamps[0] - timer.start,
        "decode_seconds": decode,
        "tokens_per_s": args.batch_size * new_tokens / timer.seconds,
        "decode_tokens_per_s": args.batch_size * (steps - 1) / decode if steps > 1 else float("nan"),
        "cpu_seconds": timer.cpu_seconds,
        "tokens_per_cpu_s": args.batch_size * new_tokens / max(timer.cpu_seconds, 1e-9),
        "peak_memory": peak,
    } | extra
    return result, out.sequences


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer = load(args)
    input_ids = make_prompts(model, tokenizer, args)  # [B, prompt_len]
    variants = ("dynamic", "paged")
    for variant in variants:  # warm-up, not timed
        run_once(model, input_ids, variant, min(4, args.new_tokens), args)
    runs: list[dict[str, Any]] = []
    sequences: dict[str, torch.Tensor] = {}
    plan = [(r, v) for r in range(args.repeats) for v in variants]
    for repeat, variant in tqdm(plan, desc="beam search", unit="run"):
        result, seqs = run_once(model, input_ids, variant, args.new_tokens, args)
        result["repeat"] = repeat
        runs.append(result)
        sequences.setdefault(variant, seqs)

    def of(variant: str) -> list[dict[str, Any]]:
        return [r for r in runs if r["variant"] == variant]

    pairs = list(zip(of("paged"), of("dynamic"), strict=True))
    paged_bytes, dynamic_bytes = of("paged")[0]["kv_bytes_end"], of("dynamic")[0]["kv_bytes_end"]
    memory_ratio = paged_bytes / dynamic_bytes
    speed_ratio = median([p["tokens_per_s"] / d["tokens_per_s"] for p, d in pairs])
    decode_ratio = median([p["decode_tokens_per_s"] / d["decode_tokens_per_s"] for p, d in pairs])
    cpu_ratio = median([p["tokens_per_cpu_s"] / d["tokens_per_cpu_s"] for p, d in pairs])
    summary = {
        variant: {
            "kv_bytes_end": of(variant)[0]["kv_bytes_end"],
            "kv_high_water_bytes": max(r["kv_high_water_bytes"] for r in of(variant)),
            "tokens_per_s": median([r["tokens_per_s"] for r in of(variant)]),
            "tokens_per_s_range": [min(r["tokens_per_s"] for r in of(variant)),
                                   max(r["tokens_per_s"] for r in of(variant))],
            "tokens_per_cpu_s": median([r["tokens_per_cpu_s"] for r in of(variant)]),
            "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in of(variant)]),
            "ttft_seconds": median([r["ttft_seconds"] for r in of(variant)]),
            "peak_memory_bytes": max(r["peak_memory"]["bytes"] for r in of(variant)),
        }
        for variant in variants
    }
    payload: dict[str, Any] = {
        "benchmark": "beam",
        "command": "python scripts/bench/generate/bench_beam.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "paged_attention": "paged_sdpa" if args.paged_sdpa else model.config._attn_implementation,
        "runs": runs,
        "summary": summary,
        "kv_bytes_ratio": memory_ratio,
        "kv_high_water_ratio": summary["paged"]["kv_high_water_bytes"] / summary["dynamic"]["kv_high_water_bytes"],
        "speed_ratio": speed_ratio,
        "decode_speed_ratio": decode_ratio,
        "cpu_time_speed_ratio": cpu_ratio,
        "same_tokens": bool(torch.equal(sequences["paged"], sequences["dynamic"])),
        "targets": {
            "kv_bytes_ratio": {"value": memory_ratio, "target": 0.60, "met": memory_ratio <= 0.60},
            "speed_ratio": {"value": speed_ratio, "target": ">1", "met": speed_ratio > 1},
        },
    }
    write_json(args.out, payload, args.device)
    print_report(payload)
    return payload


def print_report(payload: dict[str, Any]) -> None:
    a = payload["args"]
    rows = [
        {
            "cache": variant,
            "KV MiB at end": mib(s["kv_bytes_end"]),
            "KV MiB peak": mib(s["kv_high_water_bytes"]),
            "tok/s": s["tokens_per_s"],
            "decode tok/s": s["decode_tokens_per_s"],
            "TTFT s": s["ttft_seconds"],
        }
        for variant, s in payload["summary"].items()
    ]
    print(
        f"\nbeam search, {a['num_beams']} beams, {a['batch_size']} x {a['prompt_len']}-token prompt(s), "
        f"{a['new_tokens']} new tokens, {payload['dtype']}; medians of {a['repeats']} alternated repeats"
    )
    print(format_table(rows, list(rows[0])))
    print(
        f"paged / dynamic: KV bytes {payload['kv_bytes_ratio']:.3f} (target <= 0.60), "
        f"tokens/s {payload['speed_ratio']:.3f}, decode tokens/s {payload['decode_speed_ratio']:.3f} "
        f"(target > 1), tokens per CPU second {payload['cpu_time_speed_ratio']:.3f}; "
        f"same tokens: {payload['same_tokens']}"
    )


if __name__ == "__main__":
    main()
