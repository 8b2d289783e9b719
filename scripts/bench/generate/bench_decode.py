"""Decode throughput of ``model.generate`` with PagedCache against DynamicCache, in the same process.

Scenarios (``--modes``), each on ragged left-padded batches of the seeded ShareGPT-like workload
(`hf_paged_cache.bench`; prompts capped at ``--max-prompt``, every row generating exactly
``--new-tokens``):

- ``greedy``: greedy search at each batch size of ``--batch-sizes``;
- ``beam``: beam search with ``--num-beams`` beams on ``--beam-batch-size`` requests;
- ``sample``: sampling with ``num_return_sequences=--num-return-sequences`` on ``--sample-batch-size``
  requests (the same seed before every run).

Variants (``--variants``): ``dynamic`` (DynamicCache, the model's attention, sdpa by default), ``paged``
(PagedCache, same attention), ``paged_sdpa`` (PagedCache with ``set_paged_attention``) and, when asked,
``paged_bmm`` (the same with ``decode="products"``: float32 decode steps by batched products) and ``paged_flex``
(``decode="flex"``: float32 decode steps read the blocks in place by a compiled ``flex_attention``; its compile
falls in the untimed warm-up). Each
scenario first runs every variant once with ``--warmup-tokens`` new tokens (not timed), then ``--repeats`` rounds
of D, P, P_sdpa, D, P, ... so that slow drifts of a shared machine hit all variants alike.

Timing (CUDA is synchronized around every timestamp): a pass-through logits processor (`StepClock`)
stamps each step right after its forward, so with ``t0`` = start, ``t1`` = first stamp (prefill done),
``tn`` = last stamp, ``t_end`` = generate returned, ``R`` = returned rows (batch x num_return_sequences, or
batch for beam search, whose beams are extra work, not extra output) and ``N`` = new tokens:

- end-to-end tokens/s = ``R x N / (t_end - t0)``;
- time to first token (prefill) = ``t1 - t0``;
- decode tokens/s = ``R x (N - 1) / (tn - t1)`` (the ``N - 1`` forwards after prefill);
- decode tokens per CPU second: the same with process CPU time (`time.process_time`) in place of wall
  time: on a CPU shared with other work it leaves out the time spent waiting for a core, so it is the
  steadier measure there (on CUDA it measures only the host).

Per repeat the ratio ``paged / dynamic`` is taken between adjacent runs; the median over repeats is
reported. Memory: ``torch.cuda.max_memory_allocated`` on CUDA; on every device the KV high-water mark,
sampled after every step (Dynamic: its tensor bytes; Paged: blocks in use x bytes per block), and for
Paged the pool's allocated bytes (sized to an upper bound of what the scenario needs).

``--prompt-lens`` pins the greedy batch to exact prompt lengths instead (e.g. 8 rows of 60 to 1,000
tokens), so that a batch's raggedness is chosen, not drawn.

Commands (the CPU runs reported in docs/benchmarks.md; on a GPU drop the size flags to get the defaults: batch
sizes 1,8,32, prompts up to 1024, 128 new tokens)::

    python scripts/bench/generate/bench_decode.py --threads 1 --prompt-lens 60,150,250,400,550,700,850,1000 --new-tokens 64 \
        --modes greedy --variants dynamic,paged_sdpa --out results/bench_decode_ragged8_t1.json
    python scripts/bench/generate/bench_decode.py --threads 2 --prompt-lens 60,150,250,400,550,700,850,1000 --new-tokens 64 \
        --modes greedy --variants dynamic,paged_sdpa --out results/bench_decode_ragged8_t2.json
    python scripts/bench/generate/bench_decode.py --threads 1 --prompt-lens 512 --new-tokens 64 --modes greedy \
        --out results/bench_decode_b1_512.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel

from hf_paged_cache import PagedCache
from hf_paged_cache.serving.heap import pad_heap
from hf_paged_cache.bench import (
    StepClock,
    VARIANTS,
    Timer,
    Workload,
    add_common_args,
    cache_tensor_bytes,
    fixed_length_workload,
    format_table,
    left_pad,
    load,
    median,
    mib,
    pad_token_id,
    paged_pool_blocks,
    peak_memory,
    prompt_token_range,
    reset_peak_memory,
    sharegpt_workload,
    variant_attention,
    write_json,
)

DEFAULT_VARIANTS = ("dynamic", "paged", "paged_sdpa")  # paged_bmm, paged_flex when asked: not the library's default
MODES = ("greedy", "beam", "sample")


@dataclass(frozen=True)
class Scenario:
    """One generate configuration: `batch_size` requests, expanded `expand` times (beams or samples)."""

    name: str
    mode: str
    batch_size: int
    expand: int  # rows per request inside generate (num_beams or num_return_sequences)
    returned: int  # rows generate returns per request
    kwargs: dict[str, Any]


def parse_list(text: str, cast: Callable[[str], Any] = str) -> list[Any]:
    return [cast(item) for item in text.split(",") if item.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_decode.json")
    parser.add_argument("--batch-sizes", default="1,8,32", help="greedy batch sizes (default: 1,8,32)")
    parser.add_argument(
        "--prompt-lens", default=None,
        help="exact prompt lengths of one greedy batch, e.g. 60,200,1000, instead of --batch-sizes and the "
        "ShareGPT draw (default: none)",
    )
    parser.add_argument("--max-prompt", type=int, default=1024, help="cap on prompt lengths (default: 1024)")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds per scenario (default: 3)")
    parser.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the warm-up runs (default: 4)")
    parser.add_argument("--modes", default="greedy,beam,sample", help="scenarios to run (default: greedy,beam,sample)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"caches to compare, from {','.join(VARIANTS)} (default: %(default)s)")
    parser.add_argument("--num-beams", type=int, default=4, help="beams of the beam scenario (default: 4)")
    parser.add_argument("--beam-batch-size", type=int, default=8, help="prompts of the beam scenario (default: 8)")
    parser.add_argument(
        "--num-return-sequences", type=int, default=8, help="samples per prompt of the sample scenario (default: 8)"
    )
    parser.add_argument(
        "--sample-batch-size", type=int, default=4, help="prompts of the sample scenario (default: 4)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument(
        "--pad-heap", action="store_true",
        help="keep freed memory in the heap (hf_paged_cache.serving.heap.pad_heap, as the server does) for every "
        "variant alike (without it: glibc's own settings)",
    )
    args = parser.parse_args(argv)
    args.modes = parse_list(args.modes)
    args.variants = parse_list(args.variants)
    args.batch_sizes = parse_list(args.batch_sizes, int)
    args.prompt_lens = parse_list(args.prompt_lens, int) if args.prompt_lens else None
    if args.prompt_lens:
        args.batch_sizes = [len(args.prompt_lens)]
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {MODES}")
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {VARIANTS}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode time needs a step after prefill)")
    return args


def scenarios(args: argparse.Namespace) -> list[Scenario]:
    out = []
    if "greedy" in args.modes:
        out += [Scenario(f"greedy_b{b}", "greedy", b, 1, 1, {"do_sample": False}) for b in args.batch_sizes]
    if "beam" in args.modes:
        k = args.num_beams
        out.append(Scenario(
            f"beam{k}_b{args.beam_batch_size}", "beam", args.beam_batch_size, k, 1,
            {"do_sample": False, "num_beams": k, "num_return_sequences": 1, "early_stopping": False},
        ))
    if "sample" in args.modes:
        k = args.num_return_sequences
        out.append(Scenario(
            f"sample{k}_b{args.sample_batch_size}", "sample", args.sample_batch_size, k, k,
            {"do_sample": True, "num_return_sequences": k},
        ))
    return out


def run_once(
    model: PreTrainedModel,
    scenario: Scenario,
    variant: str,
    batch: dict[str, torch.Tensor],
    prompt_lens: list[int],
    new_tokens: int,
    args: argparse.Namespace,
) -> tuple[dict[str, Any], torch.Tensor]:
    """One timed ``generate``; returns its measurements and the generated ids ``[R, S + N]``."""
    device = torch.device(args.device)
    if variant == "dynamic":
        cache: Any = DynamicCache(config=model.config)
        probe: Callable[[], int] = lambda: cache_tensor_bytes(cache)  # noqa: E731
    else:
        blocks = paged_pool_blocks(prompt_lens, new_tokens, scenario.expand, args.block_size)
        cache = PagedCache(model, block_size=args.block_size, num_blocks=blocks)
        probe = lambda: cache.pool.blocks.num_used * cache.pool.bytes_per_block  # noqa: E731
    clock = StepClock(device, probe=probe)
    if scenario.mode == "sample":
        torch.manual_seed(args.seed)
    reset_peak_memory(device)
    with variant_attention(model, variant), torch.inference_mode(), Timer(device) as timer:
        out = model.generate(
            **batch,
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            logits_processor=LogitsProcessorList([clock]),
            **scenario.kwargs,
        )
    rows = scenario.batch_size * scenario.returned
    first, last = clock.stamps[0], clock.stamps[-1]
    steps = len(clock.stamps)
    result = {
        "variant": variant,
        "seconds": timer.seconds,
        "ttft_seconds": first - timer.start,
        "decode_seconds": last - first,
        "steps": steps,
        "generated_tokens": rows * new_tokens,
        "tokens_per_s": rows * new_tokens / timer.seconds,
        "decode_tokens_per_s": rows * (steps - 1) / (last - first) if steps > 1 else float("nan"),
        "cpu_seconds": timer.cpu_seconds,
        "decode_cpu_seconds": clock.cpu_stamps[-1] - clock.cpu_stamps[0],
        "decode_tokens_per_cpu_s": rows * (steps - 1) / max(clock.cpu_stamps[-1] - clock.cpu_stamps[0], 1e-9),
        "kv_high_water_bytes": clock.high_water,
    }
    if variant == "dynamic":
        result["peak_memory"] = peak_memory(device, clock.high_water)
    else:
        result["pool_bytes"] = cache.pool.storage_bytes()
        result["kv_bytes_end"] = cache.stats().bytes_reserved
        result["peak_memory"] = peak_memory(device, cache.pool.storage_bytes())
        cache.release()
    return result, out


def run_scenario(
    model: PreTrainedModel, scenario: Scenario, workload: Workload, pad_id: int, args: argparse.Namespace
) -> dict[str, Any]:
    requests = workload.head(scenario.batch_size)
    batch = left_pad(requests.prompts(), pad_id, args.device)  # [B, S] each
    for variant in args.variants:  # warm-up, not timed
        run_once(model, scenario, variant, batch, requests.prompt_lens, args.warmup_tokens, args)
    runs: list[dict[str, Any]] = []
    outputs: dict[str, torch.Tensor] = {}
    plan = [(r, v) for r in range(args.repeats) for v in args.variants]
    for repeat, variant in tqdm(plan, desc=scenario.name, unit="run", leave=False):
        result, out = run_once(model, scenario, variant, batch, requests.prompt_lens, args.new_tokens, args)
        result["repeat"] = repeat
        runs.append(result)
        outputs.setdefault(variant, out)
    summary: dict[str, Any] = {}
    for variant in args.variants:
        mine = [r for r in runs if r["variant"] == variant]
        summary[variant] = {
            "tokens_per_s": median([r["tokens_per_s"] for r in mine]),
            "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in mine]),
            "decode_tokens_per_s_range": [min(r["decode_tokens_per_s"] for r in mine),
                                          max(r["decode_tokens_per_s"] for r in mine)],
            "decode_tokens_per_cpu_s": median([r["decode_tokens_per_cpu_s"] for r in mine]),
            "ttft_seconds": median([r["ttft_seconds"] for r in mine]),
            "kv_high_water_bytes": max(r["kv_high_water_bytes"] for r in mine),
            "peak_memory_bytes": max(r["peak_memory"]["bytes"] for r in mine),
        }
        if variant != "dynamic" and "dynamic" in args.variants:
            pairs = [
                (p, d) for p in mine for d in runs if d["variant"] == "dynamic" and d["repeat"] == p["repeat"]
            ]
            summary[variant] |= {
                "ratio_tokens_per_s": median([p["tokens_per_s"] / d["tokens_per_s"] for p, d in pairs]),
                "ratio_decode_tokens_per_s": median(
                    [p["decode_tokens_per_s"] / d["decode_tokens_per_s"] for p, d in pairs]
                ),
                "ratio_decode_tokens_per_cpu_s": median(
                    [p["decode_tokens_per_cpu_s"] / d["decode_tokens_per_cpu_s"] for p, d in pairs]
                ),
                "ratio_kv_high_water": summary[variant]["kv_high_water_bytes"]
                / summary["dynamic"]["kv_high_water_bytes"],
                "same_tokens_as_dynamic": bool(torch.equal(outputs[variant], outputs["dynamic"])),
            }
    return {
        "scenario": scenario.name,
        "mode": scenario.mode,
        "batch_size": scenario.batch_size,
        "rows_in_generate": scenario.batch_size * scenario.expand,
        "returned_rows": scenario.batch_size * scenario.returned,
        "prompt_lens": requests.prompt_lens,
        "padded_prompt_len": int(batch["input_ids"].shape[1]),
        "new_tokens": args.new_tokens,
        "generate_kwargs": scenario.kwargs,
        "runs": runs,
        "summary": summary,
    }


def targets(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Greedy decode >= 0.95x DynamicCache at every batch size (aim 1.0x); beam search faster than Dynamic."""
    out: dict[str, Any] = {}
    for res in results:
        for variant, s in res["summary"].items():
            if "ratio_decode_tokens_per_s" not in s:
                continue
            key = f"{res['scenario']}/{variant}"
            if res["mode"] == "greedy":
                value = s["ratio_decode_tokens_per_s"]
                out[key] = {"metric": "decode tok/s ratio", "value": value, "target": 0.95, "met": value >= 0.95}
            elif res["mode"] == "beam":
                value = s["ratio_tokens_per_s"]
                out[key] = {"metric": "end-to-end tok/s ratio", "value": value, "target": ">1", "met": value > 1}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.pad_heap and not pad_heap():
        print("--pad-heap: not glibc, malloc left as is", file=sys.stderr)
    model, tokenizer = load(args)
    pad_id = pad_token_id(model, tokenizer)
    context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 4096))
    plan = scenarios(args)
    largest = max(s.batch_size for s in plan)
    if args.prompt_lens:
        token_range = prompt_token_range(model, tokenizer)
        workload = fixed_length_workload(
            args.prompt_lens, seed=args.seed, output_len=args.new_tokens, token_range=token_range
        )
    else:
        workload = sharegpt_workload(
            largest,
            seed=args.seed,
            max_prompt=min(args.max_prompt, context - args.new_tokens),
            max_output=args.new_tokens,
            token_range=prompt_token_range(model, tokenizer),
        )
    results = [run_scenario(model, s, workload, pad_id, args) for s in tqdm(plan, desc="scenarios", unit="scenario")]
    payload: dict[str, Any] = {
        "benchmark": "decode",
        "command": "python scripts/bench/generate/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "attn_implementation": model.config._attn_implementation,
        "workload": workload.summary(),
        "scenarios": results,
        "targets": targets(results),
    }
    write_json(args.out, payload, args.device)
    print_report(payload)
    return payload


def print_report(payload: dict[str, Any]) -> None:
    rows = []
    for res in payload["scenarios"]:
        for variant, s in res["summary"].items():
            rows.append({
                "scenario": res["scenario"],
                "cache": variant,
                "tok/s": s["tokens_per_s"],
                "decode tok/s": s["decode_tokens_per_s"],
                "TTFT s": s["ttft_seconds"],
                "x dyn (e2e)": s.get("ratio_tokens_per_s", ""),
                "x dyn (decode)": s.get("ratio_decode_tokens_per_s", ""),
                "x dyn (decode, CPU time)": s.get("ratio_decode_tokens_per_cpu_s", ""),
                "KV peak MiB": mib(s["kv_high_water_bytes"]),
                "same tokens": s.get("same_tokens_as_dynamic", ""),
            })
    print(f"\n{payload['model']} {payload['dtype']}, medians of {payload['args']['repeats']} alternated repeats")
    print(format_table(rows, list(rows[0])))
    for key, target in payload["targets"].items():
        print(f"target {key}: {target}")


if __name__ == "__main__":
    main()
