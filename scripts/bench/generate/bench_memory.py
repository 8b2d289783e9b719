"""KV memory of one ragged batch in DynamicCache, StaticCache and PagedCache, and concurrency under a budget.

Part 1 (measured): the first ``--num-requests`` requests of a seeded ShareGPT-like workload (see
`hf_paged_cache.bench`) go through one greedy ``model.generate`` call each, left-padded, every row
generating ``--new-tokens`` tokens (a static batch runs until its longest request ends, so every row gets
the same count), with:

- ``DynamicCache``: holds padding: left padding up to the longest prompt, so every row is as long as the
  longest, ``B x (max prompt + new - 1)`` positions;
- ``StaticCache`` sized as users size it: (a) ``max_cache_len`` = the model's context
  (``max_position_embeddings``), (b) ``max_cache_len`` = the batch's longest request (max prompt + new).
  With ``--static-context allocate`` (a) is allocated through ``early_initialization``, the very tensors
  ``generate`` would fill, but not run: attending over the whole context every step takes many minutes
  on a CPU, and its bytes do not depend on running it;
- ``PagedCache`` (blocks of ``--block-size`` tokens, padding takes no blocks).

For each: reserved = bytes of the cache's K/V tensors (Dynamic, Static; Static also checked against
``2 x layers x kv_heads x head_dim x max_cache_len x B x dtype bytes``) or ``stats().bytes_reserved``
(Paged: blocks in use x bytes per block); used = real tokens x bytes per token, real tokens per row =
``prompt + new - 1`` (generate never feeds back its last token); utilization = used / reserved;
waste = reserved - used. Every cache must produce the same tokens as DynamicCache (recorded).

Part 2 (computed, then Paged proven by running): under a KV budget ``--budget`` (default: 256MiB: 5825
tokens of SmolLM2-135M in float32, 46080 bytes each), the largest ``k`` such that the first ``k`` requests of
the same seeded stream, each generating ``--budget-new-tokens``, fit:

- Static (a): ``k = budget // (bytes_per_token x context)``;
- Static (b): largest ``k`` with ``k x max_{i<k}(prompt_i + new) x bytes_per_token <= budget`` (sized to the
  batch's longest request, the smallest static cache that can serve it);
- Dynamic: largest ``k`` with ``k x (max_{i<k} prompt_i + new - 1) x bytes_per_token <= budget``;
- Paged: largest ``k`` with ``sum_{i<k} ceil((prompt_i + new - 1) / block_size) <= budget // bytes_per_block - 1``
  (block 0 is the reserved null block).

Paged is then proven: a ``PagedCache(model, max_memory=budget)`` generates those ``k`` requests as ONE batch
and must finish without ``PoolExhaustedError``, holding exactly the predicted blocks. The proof run caps new
tokens at ``--budget-new-tokens`` so it stays affordable on a CPU; the same cap is used for every cache's
count, so the comparison stays like for like.

Command (the CPU run reported in docs/benchmarks.md; ``--device cuda`` works the same)::

    python scripts/bench/generate/bench_memory.py --threads 1 --max-prompt 512 --new-tokens 32 --static-context allocate \
        --out results/bench_memory.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, StaticCache

from hf_paged_cache import KVLayout, PagedCache, PoolExhaustedError, parse_memory
from hf_paged_cache.bench import (
    Timer,
    Workload,
    add_common_args,
    cache_tensor_bytes,
    format_table,
    kv_bytes_per_token,
    left_pad,
    load,
    mib,
    pad_token_id,
    paged_blocks,
    peak_memory,
    prompt_token_range,
    reset_peak_memory,
    sharegpt_workload,
    static_cache_reserved_bytes,
    stored_tokens,
    used_bytes,
    write_json,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_memory.json")
    parser.add_argument("--num-requests", type=int, default=16, help="requests in the measured batch (default: 16)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens each row generates (default: 32)")
    parser.add_argument(
        "--max-prompt", type=int, default=None,
        help="cap on prompt lengths (default: the model's context minus the new tokens)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    parser.add_argument(
        "--budget", default="256MiB",
        help="KV budget for part 2, bytes or e.g. 512MiB (default: 256MiB)",
    )
    parser.add_argument(
        "--budget-new-tokens", type=int, default=None,
        help="new tokens per request in part 2 and its proof run (default: --new-tokens)",
    )
    parser.add_argument(
        "--candidates", type=int, default=1024,
        help="length of the request stream part 2 admits from (default: 1024)",
    )
    parser.add_argument(
        "--static-context", choices=["run", "allocate"], default="run",
        help="run generate with the context-sized StaticCache, or only allocate it, much faster on CPU (default: run)",
    )
    parser.add_argument("--skip-proof", action="store_true", help="compute part 2 only, do not run the proof")
    return parser.parse_args(argv)


def context_length(model: PreTrainedModel) -> int:
    return int(getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 4096)


def generate(model: PreTrainedModel, batch: dict[str, torch.Tensor], cache: Any, new_tokens: int) -> torch.Tensor:
    """Greedy generate of exactly `new_tokens` tokens per row into `cache`; returns ``[B, S + new]`` ids."""
    with torch.inference_mode():
        return model.generate(
            **batch,
            cache=cache,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            disable_compile=True,  # no auto-compile of the StaticCache run on CUDA: we measure memory here
        )


def measure_caches(
    model: PreTrainedModel,
    workload: Workload,
    new_tokens: int,
    block_size: int,
    pad_id: int,
    device: torch.device,
    static_context: str = "run",
) -> list[dict[str, Any]]:
    """Part 1: run the batch through each cache; bytes reserved / used, utilization, waste, time.

    With ``static_context="allocate"`` the context-sized StaticCache is allocated (its real tensors, through
    ``early_initialization``) but not run: attending over the whole context at every step is very slow on a
    CPU, and the bytes do not depend on running it.
    """
    dtype = model.dtype
    per_token = kv_bytes_per_token(model.config, dtype)
    batch = left_pad(workload.prompts(), pad_id, device)  # [B, S] each
    rows, longest = len(workload), max(workload.prompt_lens)
    real = stored_tokens(workload.prompt_lens, new_tokens)  # per row, padding excluded
    used = used_bytes(real, per_token)
    context = context_length(model)
    static_lens = {"static_context": context, "static_workload_max": longest + new_tokens}
    specs = [
        ("dynamic", "DynamicCache (pads to the longest row)"),
        ("static_context", f"StaticCache max_cache_len={context} (model context)"),
        ("static_workload_max", f"StaticCache max_cache_len={longest + new_tokens} (longest request)"),
        ("paged", f"PagedCache block_size={block_size}"),
    ]
    reference: torch.Tensor | None = None
    results = []
    for name, label in tqdm(specs, desc="caches", unit="cache"):
        if name in static_lens and static_lens[name] > context:
            raise ValueError(f"{label}: longer than the model's context of {context} tokens; lower --max-prompt")
        reset_peak_memory(device)
        if name == "dynamic":
            cache: Any = DynamicCache(config=model.config)
        elif name == "paged":
            # A pool just large enough; its size is reported separately from the blocks in use.
            blocks = paged_blocks(real, block_size) + rows + 1
            cache = PagedCache(model, block_size=block_size, num_blocks=blocks)
        else:
            cache = StaticCache(config=model.config, max_cache_len=static_lens[name])
        out: torch.Tensor | None = None
        if name == "static_context" and static_context == "allocate":
            # Allocate exactly the tensors generate would write into, without running it (see --static-context).
            layout = KVLayout.from_config(model.config)
            heads = [layer.num_heads for layer in layout.layers]
            dims = [layer.key_dim for layer in layout.layers]
            cache.early_initialization(rows, heads, dims, dtype, device)
            row: dict[str, Any] = {"cache": name, "label": label, "seconds": None, "ran_generate": False}
        else:
            with Timer(device) as timer:
                out = generate(model, batch, cache, new_tokens)
            row = {"cache": name, "label": label, "seconds": timer.seconds, "ran_generate": True}
        if name == "paged":
            stats = cache.stats()
            row |= {
                "reserved_bytes": stats.bytes_reserved,
                "used_bytes": stats.bytes_used,
                "blocks_in_use": stats.blocks_in_use,
                "blocks_predicted": paged_blocks(real, block_size),
                "tokens_stored": stats.tokens_stored,
                "pool_bytes": cache.pool.storage_bytes(),
                "pool_blocks": cache.pool.num_blocks,
            }
            cache_bytes = cache.pool.storage_bytes()
            cache.release()
        else:
            measured = cache_tensor_bytes(cache)
            row |= {"reserved_bytes": measured, "used_bytes": used}
            cache_bytes = measured
            if name == "dynamic":
                positions = longest + new_tokens - 1
                row |= {
                    "positions_per_row": positions,
                    "padding_positions": rows * positions - sum(real),
                    "note": "holds padding: left padding to the longest prompt, every row as long as the longest",
                }
            else:
                formula = static_cache_reserved_bytes(model.config, static_lens[name], rows, dtype)
                row |= {"max_cache_len": static_lens[name], "reserved_bytes_formula": formula}
        row["utilization"] = row["used_bytes"] / row["reserved_bytes"]
        row["waste_bytes"] = row["reserved_bytes"] - row["used_bytes"]
        row["peak_memory"] = peak_memory(device, cache_bytes)
        if reference is None:
            reference = out
        row["tokens_match_dynamic"] = None if out is None else bool(torch.equal(out, reference))
        results.append(row)
        del cache, out
    return results


def largest_prefix(fits: Any, limit: int) -> int:
    """Largest ``k <= limit`` with ``fits(k)`` true, given that `fits` is monotone (true then false)."""
    k = 0
    while k < limit and fits(k + 1):
        k += 1
    return k


def admission(
    prompt_lens: list[int], new_tokens: int, budget: int, per_token: int, per_block: int, block_size: int, context: int
) -> list[dict[str, Any]]:
    """Part 2: how many requests of the stream each cache admits as one batch within `budget` bytes."""
    n = len(prompt_lens)
    totals = [p + new_tokens for p in prompt_lens]  # what a user sizes a static cache for
    stored = stored_tokens(prompt_lens, new_tokens)  # what each row's KV actually holds
    capacity = budget // per_block - 1  # as `memory.blocks_for_budget`, minus the null block

    def prefix_max(values: list[int], k: int) -> int:
        return max(values[:k])

    static_context = budget // (per_token * context)
    static_batch = largest_prefix(lambda k: k * prefix_max(totals, k) * per_token <= budget, n)
    dynamic = largest_prefix(lambda k: k * (max(prompt_lens[:k]) + new_tokens - 1) * per_token <= budget, n)
    paged = largest_prefix(lambda k: paged_blocks(stored[:k], block_size) <= capacity, n)

    def bytes_for(name: str, k: int) -> int:
        if k == 0:
            return 0
        if name == "static_context":
            return k * context * per_token
        if name == "static_batch_max":
            return k * prefix_max(totals, k) * per_token
        if name == "dynamic":
            return k * (max(prompt_lens[:k]) + new_tokens - 1) * per_token
        return paged_blocks(stored[:k], block_size) * per_block

    rows = [
        ("static_context", f"StaticCache max_cache_len={context} (model context)", static_context),
        ("static_batch_max", "StaticCache max_cache_len = longest admitted request", static_batch),
        ("dynamic", "DynamicCache (padded to the longest)", dynamic),
        ("paged", f"PagedCache block_size={block_size}", paged),
    ]
    out = []
    for name, label, k in rows:
        reserved = bytes_for(name, k)
        out.append({
            "cache": name,
            "label": label,
            "admitted": k,
            "reserved_bytes": reserved,
            "used_bytes": used_bytes(stored[:k], per_token),
            "limited_by_stream": k == n,
        })
    return out


def prove_paged(
    model: PreTrainedModel,
    workload: Workload,
    new_tokens: int,
    budget: int,
    block_size: int,
    pad_id: int,
    device: torch.device,
) -> dict[str, Any]:
    """Run the Paged admission as one batch on a pool of exactly `budget` bytes."""
    stored = stored_tokens(workload.prompt_lens, new_tokens)
    predicted = paged_blocks(stored, block_size)
    batch = left_pad(workload.prompts(), pad_id, device)
    cache = PagedCache(model, block_size=block_size, max_memory=budget)
    pool = cache.pool
    result: dict[str, Any] = {
        "requests": len(workload),
        "new_tokens": new_tokens,
        "pool_blocks": pool.num_blocks,
        "pool_capacity_blocks": pool.blocks.capacity,
        "pool_bytes": pool.num_blocks * pool.bytes_per_block,
        "blocks_predicted": predicted,
        "padded_batch_shape": list(batch["input_ids"].shape),
    }
    reset_peak_memory(device)
    try:
        with Timer(device) as timer:
            generate(model, batch, cache, new_tokens)
    except PoolExhaustedError as error:
        result |= {"ok": False, "error": str(error), "needed": error.needed, "free": error.free}
    else:
        stats = cache.stats()
        result |= {
            "ok": True,
            "seconds": timer.seconds,
            "blocks_in_use": stats.blocks_in_use,
            "blocks_free": pool.blocks.num_free,
            "tokens_stored": stats.tokens_stored,
            "bytes_reserved": stats.bytes_reserved,
            "utilization": stats.utilization,
            "pool_storage_bytes": pool.storage_bytes(),
            "peak_memory": peak_memory(device, pool.storage_bytes()),
        }
    finally:
        cache.release()
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    device = torch.device(args.device)
    model, tokenizer = load(args)
    pad_id = pad_token_id(model, tokenizer)
    context = context_length(model)
    budget_new = args.budget_new_tokens if args.budget_new_tokens is not None else args.new_tokens
    longest_new = max(args.new_tokens, budget_new)
    max_prompt = min(args.max_prompt or context, context - longest_new)
    if max_prompt < 1:
        raise ValueError(f"--new-tokens {longest_new} leaves no room for a prompt in a context of {context}")
    stream = sharegpt_workload(
        max(args.candidates, args.num_requests),
        seed=args.seed,
        max_prompt=max_prompt,
        max_output=context - max_prompt,
        token_range=prompt_token_range(model, tokenizer),
    )
    workload = stream.head(args.num_requests)
    per_token = kv_bytes_per_token(model.config, model.dtype)
    per_block = per_token * args.block_size
    budget = parse_memory(args.budget)

    caches = measure_caches(
        model, workload, args.new_tokens, args.block_size, pad_id, device, static_context=args.static_context
    )
    by_name = {row["cache"]: row for row in caches}

    budget_rows = admission(stream.prompt_lens, budget_new, budget, per_token, per_block, args.block_size, context)
    counts = {row["cache"]: row["admitted"] for row in budget_rows}
    if counts["paged"] == 0:
        raise ValueError(f"--budget {args.budget} holds no request of this workload; raise it")
    proof = None
    if not args.skip_proof:
        proof = prove_paged(model, stream.head(counts["paged"]), budget_new, budget, args.block_size, pad_id, device)

    def ratio(a: int, b: int) -> float | None:
        return a / b if b else None

    paged_util = by_name["paged"]["utilization"]
    vs_static = ratio(counts["paged"], counts["static_batch_max"])
    results: dict[str, Any] = {
        "benchmark": "memory",
        "command": "python scripts/bench/generate/bench_memory.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": vars(args),
        "model": model.name_or_path,
        "dtype": str(model.dtype),
        "bytes_per_token": per_token,
        "block_size": args.block_size,
        "bytes_per_block": per_block,
        "context": context,
        "new_tokens": args.new_tokens,
        "workload": workload.summary(),
        "caches": caches,
        "budget": {
            "budget": args.budget,
            "budget_bytes": budget,
            "new_tokens": budget_new,
            "candidates": len(stream),
            "rows": budget_rows,
            "paged_vs_static_batch_max": vs_static,
            "paged_vs_static_context": ratio(counts["paged"], counts["static_context"]),
            "paged_vs_dynamic": ratio(counts["paged"], counts["dynamic"]),
            "proof": proof,
        },
        "targets": {
            "paged_utilization": {"value": paged_util, "target": 0.96, "met": paged_util >= 0.96},
            "concurrency_vs_static": {
                "value": vs_static,
                "target": 2.5,
                "met": vs_static is None or vs_static >= 2.5,
            },
            "proof_ran_ok": None if proof is None else proof["ok"],
        },
    }
    write_json(args.out, results, device)
    print_report(results)
    return results


def print_report(results: dict[str, Any]) -> None:
    rows = [
        {
            "cache": r["label"],
            "reserved MiB": mib(r["reserved_bytes"]),
            "used MiB": mib(r["used_bytes"]),
            "utilization": r["utilization"],
            "waste MiB": mib(r["waste_bytes"]),
            "same tokens": "not run" if r["tokens_match_dynamic"] is None else r["tokens_match_dynamic"],
        }
        for r in results["caches"]
    ]
    w = results["workload"]
    print(
        f"\n{w['num_requests']} requests, prompts {w['prompt_stats']['min']}-{w['prompt_stats']['max']} tokens "
        f"(mean {w['prompt_stats']['mean']:.1f}), {results['new_tokens']} new tokens each, {results['dtype']}"
    )
    print(format_table(rows, list(rows[0])))
    b = results["budget"]
    print(f"\nConcurrency under a {b['budget']} KV budget ({b['new_tokens']} new tokens per request):")
    rows = [
        {"cache": r["label"], "requests admitted": r["admitted"], "KV MiB": mib(r["reserved_bytes"])}
        for r in b["rows"]
    ]
    print(format_table(rows, list(rows[0])))
    proof = b["proof"]
    if proof is not None:
        if proof["ok"]:
            print(
                f"Proof: PagedCache(max_memory={b['budget']}) ran {proof['requests']} requests as one batch, "
                f"{proof['blocks_in_use']} blocks in use (predicted {proof['blocks_predicted']}, pool capacity "
                f"{proof['pool_capacity_blocks']}), {proof['seconds']:.1f} s"
            )
        else:
            print(f"Proof FAILED: {proof['error']}")
    for name, target in results["targets"].items():
        print(f"target {name}: {target}")


if __name__ == "__main__":
    main()
