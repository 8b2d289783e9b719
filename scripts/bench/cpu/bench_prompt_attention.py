"""Causal attention of one prompt on the CPU: SDPA's kernel against two ways around it, on SmolLM2's shapes.

A prompt step spends most of its time outside the linear layers in SDPA's causal CPU kernel (see
``profile_steps.py --steps prompt``). This script times, for one layer of a prompt of each ``--lengths``
(``--heads`` query heads sharing ``--kv-heads`` key/value heads of ``--head-dim`` channels, SmolLM2-135M's by
default), in each of ``--dtypes``:

- ``sdpa``: ``F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)``, what `paged_sdpa` runs
  for a prompt computed from an empty cache;
- ``products``: the same attention as oneDNN matrix products (``torch.ops.mkldnn._linear_pointwise``, the
  operator `PackedLinear` calls, with the keys in the place of a weight), one key/value head at a time: its
  query heads' scores ``[g * L, L]``, the causal mask added, a float32 softmax, then the values;
- ``flex``: ``flex_attention`` compiled by inductor with a causal block mask (``torch.compile``, one
  compilation per length and dtype, reported apart).

The heap is padded as the server pads it (`pad_heap`). Each variant is called ``--repeats`` times, the
variants alternated, after one untimed call each (the one checked against the reference); medians and ranges
are reported, the speed as GFLOP/s of the causal half (``2 x 2 x heads x L^2 x head_dim / 2``), the median of
the per-repeat ratios against ``sdpa``, and the largest absolute difference from a float64 reference.

Command (the numbers in docs/benchmarks.md)::

    python scripts/bench/cpu/bench_prompt_attention.py --threads 2 --out results/bench_prompt_attention.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hf_paged_cache.bench import format_table, write_json
from hf_paged_cache.heap import pad_heap
from hf_paged_cache.kernels.packed_linear import packed_linears_supported

VARIANTS = ("sdpa", "products", "flex")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="100,200,400,512,1024",
                        help="prompt tokens (default: 100,200,400,512,1024)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="dtypes to time (default: float32,bfloat16)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"sdpa and what to time against it (default: {','.join(VARIANTS)})")
    parser.add_argument("--heads", type=int, default=9, help="query heads (default: 9, SmolLM2-135M's)")
    parser.add_argument("--kv-heads", type=int, default=3, help="key/value heads (default: 3)")
    parser.add_argument("--head-dim", type=int, default=64, help="channels a head (default: 64)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per variant (default: 20)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random queries, keys and values (default: 0)")
    parser.add_argument("--out", default="results/bench_prompt_attention.json",
                        help="JSON output path (default: results/bench_prompt_attention.json)")
    args = parser.parse_args(argv)
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown or "sdpa" not in args.variants:
        parser.error(f"--variants: sdpa and any of {', '.join(VARIANTS[1:])}; got {args.variants}")
    if "products" in args.variants and not packed_linears_supported():
        parser.error("--variants products: this PyTorch build has no oneDNN (mkldnn) linear operators")
    if args.heads % args.kv_heads:
        parser.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    return args


def causal_products(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """``[1, Hq, L, D]``: causal attention of `query` ``[1, Hq, L, D]`` over `key` and `value` ``[1, H, L, D]``
    by oneDNN products, one key/value head at a time (its ``g = Hq / H`` query heads as rows of one product)."""
    _, query_heads, length, dim = query.shape
    heads = key.shape[1]
    groups = query_heads // heads
    linear = torch.ops.mkldnn._linear_pointwise
    mask = torch.full((length, length), float("-inf")).triu_(1)  # [L, L] additive: -inf above the diagonal
    outs = []
    for head in range(heads):
        rows = query[0, head * groups : (head + 1) * groups].reshape(groups * length, dim)  # [g * L, D]
        scores = linear(rows, key[0, head], None, "none", [], "")  # [g * L, L] = rows @ keys^T
        scores = scores.float().view(groups, length, length).mul_(scale).add_(mask)  # [g, L, L]
        weights = torch.softmax(scores, dim=-1).to(query.dtype).view(groups * length, length)
        values_t = value[0, head].t().contiguous()  # [D, L]: the product's "weight" is [out, in]
        outs.append(linear(weights, values_t, None, "none", [], "").view(groups, length, dim))  # [g, L, D]
    return torch.cat(outs).unsqueeze(0)  # [1, Hq, L, D]


def variant_functions(args: argparse.Namespace, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor) -> tuple[dict[str, Callable[[], torch.Tensor]], dict[str, float]]:
    """Each asked variant as a call on these tensors, and the seconds spent compiling (``flex``)."""
    scale = query.shape[-1] ** -0.5
    calls: dict[str, Callable[[], torch.Tensor]] = {
        "sdpa": lambda: F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True),
        "products": lambda: causal_products(query, key, value, scale),
    }
    compile_seconds = {}
    if "flex" in args.variants:
        from torch._inductor import config as inductor_config
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        length = query.shape[2]
        block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, length, length, device="cpu")
        compiled = torch.compile(flex_attention, dynamic=False)
        start = time.perf_counter()
        # compiled in this process: inductor's pool of compile workers would share the cores with the timed calls
        with inductor_config.patch(compile_threads=1):
            compiled(query, key, value, block_mask=block_mask, enable_gqa=True)
        compile_seconds["flex"] = time.perf_counter() - start
        calls["flex"] = lambda: compiled(query, key, value, block_mask=block_mask, enable_gqa=True)
    return {name: calls[name] for name in args.variants}, compile_seconds


def measure(args: argparse.Namespace, dtype: torch.dtype, length: int) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(args.seed)
    query = torch.randn(1, args.heads, length, args.head_dim, generator=generator).to(dtype)
    key = torch.randn(1, args.kv_heads, length, args.head_dim, generator=generator).to(dtype)
    value = torch.randn(1, args.kv_heads, length, args.head_dim, generator=generator).to(dtype)
    reference = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), is_causal=True,
                                               enable_gqa=True)
    calls, compile_seconds = variant_functions(args, query, key, value)
    errors = {name: (call().double() - reference).abs().max().item() for name, call in calls.items()}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(args.repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    flops = 2 * 2 * args.heads * length * length * args.head_dim / 2  # the causal half of QK^T and PV
    rows = []
    for name, seconds in times.items():
        median = statistics.median(seconds)
        rows.append({
            "dtype": str(dtype).removeprefix("torch."), "length": length, "variant": name,
            "median_us": median * 1e6, "range_us": [min(seconds) * 1e6, max(seconds) * 1e6],
            "gflops": flops / median / 1e9,
            "speedup_vs_sdpa": statistics.median(s / o for s, o in zip(times["sdpa"], seconds, strict=True)),
            "max_abs_error": errors[name], "compile_s": compile_seconds.get(name),
        })
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    pad_heap()  # as the server does at start-up: the score buffers come from the heap, not fresh mappings
    rows = [row for dtype in args.dtypes.split(",") for length in map(int, args.lengths.split(","))
            for row in measure(args, getattr(torch, dtype), length)]
    payload = {"benchmark": "bench_prompt_attention", "args": vars(args), "threads": torch.get_num_threads(),
               "rows": rows}
    print(format_table([{**row, "median_us": f"{row['median_us']:.0f}",
                         "range_us": "{:.0f}-{:.0f}".format(*row["range_us"]), "gflops": f"{row['gflops']:.0f}",
                         "speedup_vs_sdpa": f"{row['speedup_vs_sdpa']:.2f}x",
                         "max_abs_error": f"{row['max_abs_error']:.1e}"} for row in rows],
                       ["dtype", "length", "variant", "median_us", "range_us", "gflops", "speedup_vs_sdpa",
                        "max_abs_error"]))
    write_json(args.out, payload, "cpu")
    return payload


if __name__ == "__main__":
    main()
