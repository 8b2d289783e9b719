"""Decode speed of PagedCache against DynamicCache in the same process, at two granularities: whole
``generate`` runs (the default), or decode steps alternated step by step (``--per-step``).

**Whole runs** (the default).

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

**Steps alternated** (``--per-step``): the finest A/B of paging.

The default mode times whole ``generate`` runs, one cache after the other; on a shared CPU whose
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
tokens so far. The variants are those above (``dynamic,paged_sdpa`` by default; ``paged_flex`` compiles its
kernel in the untimed warm-up steps).

``--prompt-lens`` gives the batch: lengths separated by commas, ``LxN`` for ``N`` rows of ``L`` tokens (e.g.
``512`` for batch 1, ``300x16`` for 16 equal rows, ``60,150,250,400,550,700,850,1000`` for a ragged batch).

``--fixed-cost`` times the model's architecture with its widths cut to a few units (`hf_paged_cache.bench.narrowed`:
the same layers, heads, vocabulary and caches, random weights): its products cost next to nothing, so each
variant's step time is what a step costs it beyond the math (Python, the cache's bookkeeping, op dispatch).

Commands (the CPU runs reported in docs/benchmarks.md; on a GPU drop the size flags of the whole-run
commands to get the defaults: batch sizes 1,8,32, prompts up to 1024, 128 new tokens)::

    python scripts/bench/generate/bench_decode.py --threads 1 --prompt-lens 60,150,250,400,550,700,850,1000 \
        --new-tokens 64 --modes greedy --variants dynamic,paged_sdpa --out results/bench_decode_ragged8_t1.json
    python scripts/bench/generate/bench_decode.py --threads 2 --prompt-lens 60,150,250,400,550,700,850,1000 \
        --new-tokens 64 --modes greedy --variants dynamic,paged_sdpa --out results/bench_decode_ragged8_t2.json
    python scripts/bench/generate/bench_decode.py --threads 1 --prompt-lens 512 --new-tokens 64 --modes greedy \
        --out results/bench_decode_b1_512.json
    python scripts/bench/generate/bench_decode.py --per-step --threads 1 --prompt-lens 512 --pad-heap \
        --out results/bench_steps_b1_t1.json
    python scripts/bench/generate/bench_decode.py --per-step --threads 2 --prompt-lens 60,150,250,400,550,700,850,1000 \
        --pad-heap --out results/bench_steps_ragged8_t2.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, LogitsProcessorList, PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import (
    VARIANTS,
    StepClock,
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
    narrowed,
    pad_token_id,
    paged_pool_blocks,
    peak_memory,
    percentile,
    prompt_token_range,
    reset_peak_memory,
    sharegpt_workload,
    synchronize,
    variant_attention,
    write_json,
)
from hf_paged_cache.heap import pad_heap
from hf_paged_cache.kernels import pack_linears

DEFAULT_VARIANTS = ("dynamic", "paged", "paged_sdpa")  # paged_bmm, paged_flex when asked: not the library's default
STEP_VARIANTS = ("dynamic", "paged_sdpa")  # --per-step's default: the first is the reference
MODES = ("greedy", "beam", "sample")
OUT = "results/bench_decode.json"
STEPS_OUT = "results/bench_steps.json"  # --per-step's (plot_bench reads bench_decode*.json as whole runs)

EPILOG = (
    "Two granularities of one A/B. Whole generate runs (without --per-step): greedy, beam and sample scenarios, each "
    "variant's generate timed in alternated rounds (end-to-end and decode tokens/s, time to first token, KV "
    "high-water). --per-step: every variant holds the same batch and the decode steps alternate among them, "
    "step by step (median per-step speed ratio with its quartiles, logits compared)."
)


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


def parse_prompt_lens(text: str) -> list[int]:
    """``"60,150"`` -> ``[60, 150]``; ``"300x3"`` -> ``[300, 300, 300]``; the two forms mix; ``""`` -> ``[]``."""
    lens: list[int] = []
    for item in filter(str.strip, text.split(",")):
        length, _, count = item.strip().partition("x")
        lens += [int(length)] * (int(count) if count else 1)
    return lens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=EPILOG)
    add_common_args(parser, out=None, out_help=f"JSON output path (default: {OUT}; with --per-step {STEPS_OUT})")
    parser.add_argument("--per-step", action="store_true",
                        help="alternate the variants step by step on one batch instead of timing whole generate runs")
    parser.add_argument("--prompt-lens", default=None,
                        help="exact prompt lengths of the batch, e.g. 60,1000 or 300x16, instead of --batch-sizes and "
                        "the ShareGPT draw (default: none; with --per-step 512)")
    parser.add_argument("--variants", default=None,
                        help=f"caches to compare (per step: the first is the reference), from {','.join(VARIANTS)} "
                        f"(default: {','.join(DEFAULT_VARIANTS)}; with --per-step {','.join(STEP_VARIANTS)})")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument("--pad-heap", action="store_true",
                        help="keep freed memory in the heap (hf_paged_cache.heap.pad_heap, as the server does) "
                        "for every variant alike (without it: glibc's own settings)")
    runs = parser.add_argument_group("whole generate runs")
    runs.add_argument("--batch-sizes", default="1,8,32", help="greedy batch sizes (default: 1,8,32)")
    runs.add_argument("--max-prompt", type=int, default=1024, help="cap on prompt lengths (default: 1024)")
    runs.add_argument("--new-tokens", type=int, default=128, help="tokens generated per row (default: 128)")
    runs.add_argument("--repeats", type=int, default=3, help="timed rounds per scenario (default: 3)")
    runs.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the warm-up runs (default: 4)")
    runs.add_argument("--modes", default="greedy,beam,sample", help="scenarios to run (default: greedy,beam,sample)")
    runs.add_argument("--num-beams", type=int, default=4, help="beams of the beam scenario (default: 4)")
    runs.add_argument("--beam-batch-size", type=int, default=8, help="prompts of the beam scenario (default: 8)")
    runs.add_argument("--num-return-sequences", type=int, default=8,
                      help="samples per prompt of the sample scenario (default: 8)")
    runs.add_argument("--sample-batch-size", type=int, default=4, help="prompts of the sample scenario (default: 4)")
    steps = parser.add_argument_group("steps alternated (--per-step)")
    steps.add_argument("--steps", type=int, default=64, help="timed decode steps (default: 64)")
    steps.add_argument("--warmup-steps", type=int, default=8, help="untimed decode steps first (default: 8)")
    steps.add_argument("--fixed-cost", action="store_true",
                       help="time the model's architecture with its widths cut to a few units (random weights): "
                       "what a step costs beyond its products")
    steps.add_argument("--packed-linears", action="store_true",
                       help="multiply through oneDNN-packed weights (pack_linears, as the server does on a CPU) for "
                       "every variant alike (without it: the stock kernels)")
    args = parser.parse_args(argv)
    check_args(parser, args)
    return args


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fill in the defaults that depend on ``--per-step`` and refuse what cannot run."""
    args.out = args.out or (STEPS_OUT if args.per_step else OUT)
    args.variants = parse_list(args.variants or ",".join(STEP_VARIANTS if args.per_step else DEFAULT_VARIANTS))
    args.prompt_lens = parse_prompt_lens(args.prompt_lens or ("512" if args.per_step else "")) or None
    args.modes = parse_list(args.modes)
    args.batch_sizes = [len(args.prompt_lens)] if args.prompt_lens else parse_list(args.batch_sizes, int)
    for variant in args.variants:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r}; choose from {VARIANTS}")
    if args.per_step:
        if len(set(args.variants)) != len(args.variants) or len(args.variants) < 2:
            parser.error("--variants needs two or more different caches")
        if args.steps < 1 or args.warmup_steps < 0:
            parser.error("--steps must be >= 1 and --warmup-steps >= 0")
        return
    for mode in args.modes:
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {MODES}")
    if args.new_tokens < 2:
        parser.error("--new-tokens must be >= 2 (decode time needs a step after prefill)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.pad_heap and not pad_heap():
        print("--pad-heap: not glibc, malloc left as is", file=sys.stderr)
    model, tokenizer = load(args)
    command = "python scripts/bench/generate/bench_decode.py " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.per_step:
        payload = per_step(model, tokenizer, args)
    else:
        payload = whole_runs(model, tokenizer, args)
    payload = {"benchmark": payload.pop("benchmark"), "command": command, "args": vars(args)} | payload
    write_json(args.out, payload, args.device)
    (print_steps_report if args.per_step else print_runs_report)(payload)
    return payload


def whole_runs(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> dict[str, Any]:
    """Every scenario's alternated ``generate`` runs: the payload's fields but its command and arguments."""
    pad_id = pad_token_id(model, tokenizer)
    context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 4096))
    plan = scenarios(args)
    token_range = prompt_token_range(model, tokenizer)
    if args.prompt_lens:
        workload = fixed_length_workload(args.prompt_lens, seed=args.seed, output_len=args.new_tokens,
                                         token_range=token_range)
    else:
        workload = sharegpt_workload(max(s.batch_size for s in plan), seed=args.seed,
                                     max_prompt=min(args.max_prompt, context - args.new_tokens),
                                     max_output=args.new_tokens, token_range=token_range)
    results = [run_scenario(model, s, workload, pad_id, args) for s in tqdm(plan, desc="scenarios", unit="scenario")]
    return {
        "benchmark": "decode",
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "attn_implementation": model.config._attn_implementation,
        "workload": workload.summary(),
        "scenarios": results,
        "targets": targets(results),
    }


def per_step(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> dict[str, Any]:
    """The decode steps of one batch alternated among the variants: the payload's fields but its command and
    arguments."""
    if args.fixed_cost:
        model = narrowed(model, seed=args.seed)
    if args.packed_linears:
        pack_linears(model)
    workload = fixed_length_workload(args.prompt_lens, seed=args.seed, output_len=args.steps,
                                     token_range=prompt_token_range(model, tokenizer))
    batch = left_pad(workload.prompts(), pad_token_id(model, tokenizer), args.device)  # [B, S] each
    return {
        "benchmark": "steps",
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "hidden_size": model.config.get_text_config(decoder=True).hidden_size,  # narrowed with --fixed-cost
        "threads": torch.get_num_threads(),
        "prompt_lens": args.prompt_lens,
        "reference": args.variants[0],
        **alternate_steps(model, batch, args),  # max_abs_logit, and per variant its step times and logit comparison
    }


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


def print_runs_report(payload: dict[str, Any]) -> None:
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


def alternate_steps(model: PreTrainedModel, batch: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
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
    return {"max_abs_logit": comparison.max_abs_logit, "variants": summarize_steps(seconds, comparison)}


def summarize_steps(seconds: dict[str, list[float]], comparison: LogitComparison) -> dict[str, Any]:
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


def print_steps_report(payload: dict[str, Any]) -> None:
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
