"""The same workload through ``generate`` (DynamicCache, PagedCache) and transformers' continuous batching.

transformers 5.24 ships its own paged KV cache inside a continuous-batching engine
(``model.init_continuous_batching``: a background thread that schedules requests, prefills them
unpadded, and admits/retires requests at every step). This script runs the same requests through it and
through plain ``model.generate`` with a DynamicCache and with a PagedCache, side by side.

Workload: ``--num-requests`` requests of the seeded ShareGPT-like stream (`hf_paged_cache.bench`),
prompts capped at ``--max-prompt``. Output lengths (``--outputs``):

- ``fixed``: every request generates ``--new-tokens`` tokens (the engines' raw speed on equal work);
- ``sharegpt``: request ``i`` generates its drawn output length (log-normal, mean 337.99) times
  ``--output-scale``, capped at ``--new-tokens``: ``o_i = clamp(round(draw_i x scale), 1, new_tokens)``.
  The scale keeps the distribution's shape while shrinking it to what a CPU run affords (scale 1 with a
  cap far below the draws would make every output hit the cap, i.e. not ragged at all).
  ``generate`` batches cannot stop rows independently, so a batch runs until its longest request is
  done and rows that finished early keep computing: tokens/s counts only the useful ``sum(o_i)`` tokens.

``generate`` processes the requests in order, ``--batch-size`` per left-padded batch (default: all in one),
each batch with ``max_new_tokens = min_new_tokens = max(o_i)``. Continuous batching gets each request with
its own ``max_new_tokens = o_i`` (EOS disabled so that lengths are exact) and a cache of ``--budget`` bytes
(``num_blocks = budget // (page_size x bytes per token)``, page size ``--cb-page-size``, transformers'
default 256 if not given). The PagedCache pool is sized to exactly what each batch needs (greedy
rows store ``prompt + new - 1`` tokens in ``ceil(tokens / block_size)`` blocks, plus the null block).

Reported per engine, medians over ``--repeats`` alternated rounds (one untimed warm-up of each first):
useful tokens/s = ``sum(o_i) / wall seconds`` (prefill included), the same per process-CPU second (all
threads; steadier on a shared CPU), computed tokens, and memory: the KV
bytes allocated (Dynamic: its tensors at their high-water mark; Paged: pool bytes and blocks-in-use
high-water; CB: its cache tensor, ``(num_sectors + 2 trash sectors) x bytes_per_sector``, and the used
high-water polled from the main thread, approximate since the engine runs in another thread), and
``torch.cuda.max_memory_allocated`` on CUDA. In ``fixed`` mode the share of CB requests whose greedy
tokens equal DynamicCache's is recorded (float rounding differs between padded and unpadded batches, so
a few may diverge).

Command (the CPU run reported in docs/benchmarks.md)::

    python scripts/bench/serving/bench_cb.py --threads 1 --num-requests 16 --max-prompt 256 --new-tokens 32 \
        --outputs fixed --out results/bench_cb_fixed.json
    python scripts/bench/serving/bench_cb.py --threads 1 --num-requests 16 --max-prompt 256 --new-tokens 96 \
        --outputs sharegpt --output-scale 0.125 --out results/bench_cb_sharegpt.json
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, GenerationConfig, LogitsProcessorList, PreTrainedModel
from transformers.generation.configuration_utils import ContinuousBatchingConfig

from hf_paged_cache import PagedCache, parse_memory
from hf_paged_cache.bench import (
    StepClock,
    Workload,
    add_common_args,
    cache_tensor_bytes,
    format_table,
    kv_bytes_per_token,
    left_pad,
    load,
    median,
    mib,
    pad_token_id,
    paged_blocks,
    prompt_token_range,
    reset_peak_memory,
    sharegpt_workload,
    stored_tokens,
    synchronize,
    write_json,
)

ENGINES = ("dynamic", "paged", "cb")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_cb.json")
    parser.add_argument("--num-requests", type=int, default=32, help="requests (default: 32)")
    parser.add_argument("--max-prompt", type=int, default=1024, help="cap on prompt lengths (default: 1024)")
    parser.add_argument("--new-tokens", type=int, default=128, help="new tokens, or their cap (default: 128)")
    parser.add_argument(
        "--outputs", choices=["fixed", "sharegpt"], default="fixed",
        help="every request generates --new-tokens, or ShareGPT-shaped lengths capped there (default: fixed)",
    )
    parser.add_argument(
        "--output-scale", type=float, default=1.0,
        help="multiply the drawn ShareGPT output lengths by this before capping, with --outputs sharegpt (default: 1.0)",
    )
    parser.add_argument("--batch-size", type=int, default=None, help="generate batch size (default: all)")
    parser.add_argument("--budget", default="256MiB", help="continuous batching KV cache size (default: 256MiB)")
    parser.add_argument("--cb-page-size", type=int, default=None, help="CB page size (default: transformers')")
    parser.add_argument("--cb-max-batch-tokens", type=int, default=None, help="CB tokens per step (default: its own)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds (default: 2)")
    parser.add_argument("--engines", default=",".join(ENGINES), help="engines to run (default: all)")
    args = parser.parse_args(argv)
    args.engines = [e for e in args.engines.split(",") if e]
    for engine in args.engines:
        if engine not in ENGINES:
            parser.error(f"unknown engine {engine!r}; choose from {ENGINES}")
    return args


def output_lengths(workload: Workload, args: argparse.Namespace) -> list[int]:
    """Tokens each request generates: ``--new-tokens``, or its scaled, capped ShareGPT draw."""
    if args.outputs == "fixed":
        return [args.new_tokens] * len(workload)
    return [max(1, min(args.new_tokens, round(o * args.output_scale))) for o in workload.output_lens]


def run_generate(
    model: PreTrainedModel, engine: str, workload: Workload, outputs: list[int], pad_id: int, args: argparse.Namespace
) -> dict[str, Any]:
    """All requests through ``generate``, batch after batch; returns timing, memory and the new tokens."""
    device = torch.device(args.device)
    size = args.batch_size or len(workload)
    new_tokens: list[list[int]] = []
    computed = high_water = pool_bytes = 0
    reset_peak_memory(device)
    synchronize(device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for first in range(0, len(workload), size):
        part = workload.head(min(first + size, len(workload))).requests[first:]
        lens = [r.prompt_len for r in part]
        steps = max(outputs[first : first + len(part)])
        batch = left_pad([list(r.prompt_ids) for r in part], pad_id, device)  # [b, S] each
        if engine == "dynamic":
            cache: Any = DynamicCache(config=model.config)
            probe = lambda c=cache: cache_tensor_bytes(c)  # noqa: E731
        else:
            blocks = paged_blocks(stored_tokens(lens, steps), args.block_size) + 1  # exact for greedy, + null
            cache = PagedCache(model, block_size=args.block_size, num_blocks=blocks)
            probe = lambda c=cache: c.pool.blocks.num_used * c.pool.bytes_per_block  # noqa: E731
        clock = StepClock(device, probe=probe)
        with torch.inference_mode():
            out = model.generate(
                **batch, cache=cache, max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                logits_processor=LogitsProcessorList([clock]),
            )
        high_water = max(high_water, clock.high_water)
        if engine == "paged":
            pool_bytes = max(pool_bytes, cache.pool.storage_bytes())
            cache.release()
        computed += len(part) * steps
        width = batch["input_ids"].shape[1]
        wanted = outputs[first : first + len(part)]
        new_tokens += [row[width : width + n].tolist() for row, n in zip(out, wanted, strict=True)]
    synchronize(device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    result = {
        "engine": engine,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": sum(outputs) / cpu_seconds,
        "useful_tokens": sum(outputs),
        "computed_tokens": computed,
        "tokens_per_s": sum(outputs) / seconds,
        "kv_high_water_bytes": high_water,
        "kv_allocated_bytes": pool_bytes if engine == "paged" else high_water,
        "batches": -(-len(workload) // size),
    }
    if device.type == "cuda":
        result["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return result | {"new_tokens": new_tokens}


def cb_config(model: PreTrainedModel, args: argparse.Namespace) -> ContinuousBatchingConfig:
    """A CB config whose cache holds ``--budget`` bytes (rounded down to whole pages of every layer)."""
    kwargs: dict[str, Any] = {}
    if args.cb_page_size is not None:
        kwargs["page_size"] = args.cb_page_size
    if args.cb_max_batch_tokens is not None:
        kwargs["max_batch_tokens"] = args.cb_max_batch_tokens
    config = ContinuousBatchingConfig(**kwargs)
    per_block = kv_bytes_per_token(model.config, model.dtype) * config.page_size
    config.num_blocks = max(1, parse_memory(args.budget) // per_block)
    return config


def run_cb(
    model: PreTrainedModel, workload: Workload, outputs: list[int], args: argparse.Namespace, warmup: bool = False
) -> dict[str, Any]:
    """All requests through a fresh continuous-batching manager; only the requests' service is timed."""
    device = torch.device(args.device)
    generation_config = GenerationConfig(
        max_new_tokens=max(outputs), do_sample=False, eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id
    )
    config = cb_config(model, args)
    with torch.inference_mode():
        manager = model.init_continuous_batching(generation_config=generation_config, continuous_batching_config=config)
        manager.start()
        try:
            if warmup:  # one short request so the timed run finds the engine (and its cache) ready
                manager.add_request(list(workload.requests[0].prompt_ids[:8]), max_new_tokens=2, eos_token_id=-1)
                _collect(manager, 1, None)
            reset_peak_memory(device)
            synchronize(device)
            start, cpu_start = time.perf_counter(), time.process_time()
            ids = [
                manager.add_request(list(r.prompt_ids), max_new_tokens=n, eos_token_id=-1)
                for r, n in zip(workload.requests, outputs, strict=True)
            ]
            results, used_high_water = _collect(manager, len(ids), manager)
            synchronize(device)
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            cache = manager.batch_processor.cache
            allocated = cache.cache_tensor.numel() * cache.cache_tensor.element_size()
            layout = {
                "page_size": config.page_size,
                "num_blocks": cache.num_blocks,
                "num_sectors": cache.num_sectors,
                "bytes_per_sector": cache.bytes_per_sector,
                "max_batch_tokens": cache.max_batch_tokens,
                "attn_implementation": model.config._attn_implementation,
            }
        finally:
            manager.stop(block=True)
            manager.destroy()
    errors = [r.error for r in results.values() if r.error is not None]
    if errors:
        raise RuntimeError(f"continuous batching failed {len(errors)} requests: {errors[0]}")
    result = {
        "engine": "cb",
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "tokens_per_cpu_s": sum(outputs) / cpu_seconds,
        "useful_tokens": sum(outputs),
        "computed_tokens": sum(len(results[i].generated_tokens) for i in ids),
        "tokens_per_s": sum(outputs) / seconds,
        "kv_allocated_bytes": allocated,
        "kv_high_water_bytes": used_high_water,
        "cb_cache": layout,
    }
    if device.type == "cuda":
        result["cuda_max_memory_allocated"] = int(torch.cuda.max_memory_allocated(device))
    return result | {"new_tokens": [list(results[i].generated_tokens) for i in ids]}


def _collect(manager: Any, count: int, watch: Any) -> tuple[dict[str, Any], int]:
    """Wait for `count` finished requests; if `watch`, poll its cache's used bytes (approximate high-water)."""
    results: dict[str, Any] = {}
    high_water = 0
    while len(results) < count:
        result = manager.get_result(timeout=0.05)
        if watch is not None and watch.batch_processor is not None:
            cache = watch.batch_processor.cache
            used = (1 - cache.compute_free_capacity(relative=True)) * cache.num_sectors * cache.bytes_per_sector
            high_water = max(high_water, int(used))
        if result is not None and result.is_finished():
            results[result.request_id] = result
        elif result is None and not manager.is_running():
            raise RuntimeError("the continuous batching thread stopped before every request finished")
    return results, high_water


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer = load(args)
    pad_id = pad_token_id(model, tokenizer)
    context = int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", 4096))
    workload = sharegpt_workload(
        args.num_requests,
        seed=args.seed,
        max_prompt=min(args.max_prompt, context - args.new_tokens),
        max_output=context,  # uncapped draws; `output_lengths` scales and caps them
        token_range=prompt_token_range(model, tokenizer),
    )
    outputs = output_lengths(workload, args)
    warm = workload.head(min(2, len(workload)))
    for engine in args.engines:  # warm-up, not timed
        if engine == "cb":
            run_cb(model, warm, [2] * len(warm), args, warmup=True)
        else:
            run_generate(model, engine, warm, [2] * len(warm), pad_id, args)
    runs: list[dict[str, Any]] = []
    tokens: dict[str, list[list[int]]] = {}
    plan = [(r, e) for r in range(args.repeats) for e in args.engines]
    for repeat, engine in tqdm(plan, desc="engines", unit="run"):
        if engine == "cb":
            result = run_cb(model, workload, outputs, args, warmup=True)
        else:
            result = run_generate(model, engine, workload, outputs, pad_id, args)
        tokens.setdefault(engine, result.pop("new_tokens"))
        result.pop("new_tokens", None)
        runs.append(result | {"repeat": repeat})
    summary: dict[str, Any] = {}
    for engine in args.engines:
        mine = [r for r in runs if r["engine"] == engine]
        summary[engine] = {
            "tokens_per_s": median([r["tokens_per_s"] for r in mine]),
            "tokens_per_cpu_s": median([r["tokens_per_cpu_s"] for r in mine]),
            "seconds": median([r["seconds"] for r in mine]),
            "computed_tokens": mine[0]["computed_tokens"],
            "kv_allocated_bytes": mine[0]["kv_allocated_bytes"],
            "kv_high_water_bytes": max(r["kv_high_water_bytes"] for r in mine),
        }
        if "dynamic" in args.engines and engine != "dynamic":
            pairs = [(r, d) for r in mine for d in runs if d["engine"] == "dynamic" and d["repeat"] == r["repeat"]]
            summary[engine]["ratio_tokens_per_s_vs_dynamic"] = median(
                [r["tokens_per_s"] / d["tokens_per_s"] for r, d in pairs]
            )
            same = sum(a == b for a, b in zip(tokens[engine], tokens["dynamic"], strict=True))
            summary[engine]["requests_with_same_tokens_as_dynamic"] = f"{same}/{len(workload)}"
    payload: dict[str, Any] = {
        "benchmark": "continuous_batching",
        "command": "python scripts/bench/serving/bench_cb.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "workload": workload.summary(),
        "outputs": outputs,
        "runs": runs,
        "summary": summary,
        "cb_cache": next((r["cb_cache"] for r in runs if r["engine"] == "cb"), None),
    }
    write_json(args.out, payload, args.device)
    print_report(payload)
    return payload


def print_report(payload: dict[str, Any]) -> None:
    a = payload["args"]
    rows = [
        {
            "engine": engine,
            "useful tok/s": s["tokens_per_s"],
            "x dynamic": s.get("ratio_tokens_per_s_vs_dynamic", ""),
            "useful tok per CPU s": s["tokens_per_cpu_s"],
            "computed tokens": s["computed_tokens"],
            "KV allocated MiB": mib(s["kv_allocated_bytes"]),
            "KV used peak MiB": mib(s["kv_high_water_bytes"]),
            "same tokens": s.get("requests_with_same_tokens_as_dynamic", ""),
        }
        for engine, s in payload["summary"].items()
    ]
    print(
        f"\n{a['num_requests']} requests, outputs {a['outputs']} (sum {sum(payload['outputs'])} tokens, "
        f"{min(payload['outputs'])}-{max(payload['outputs'])} each), "
        f"generate batch size {a['batch_size'] or a['num_requests']}; medians of {a['repeats']} rounds"
    )
    print(format_table(rows, list(rows[0])))


if __name__ == "__main__":
    main()
