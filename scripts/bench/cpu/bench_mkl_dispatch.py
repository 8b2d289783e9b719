"""MKL's own kernels against the ones it falls back to on a CPU that is not Intel's, on SmolLM2's shapes.

MKL chooses its kernels by the CPU's vendor (`hf_paged_cache.kernels.mkl_dispatch`). This script times the
calls of a serving step that PyTorch sends to MKL in child processes of two kinds, alternated round by round:
``stock`` (MKL as it loads) and ``preloaded`` (``LD_PRELOAD`` = ``--preload``, a library whose
``mkl_serv_intel_cpu_true`` returns 1; docs/serving.md, "MKL on AMD CPUs", builds one). Each child pads its heap as
the server does, warms every call up, times it ``--calls`` times and reports the medians and what
`mkl_takes_fast_path` says in it. The calls (SmolLM2-135M: 9 query heads sharing 3 key/value heads of 64):

- ``linear``: a float32 ``F.linear`` of 484 tokens by a ``[1536, 576]`` weight (unpacked: the stock kernels);
- ``prompt sdpa``: SDPA's causal attention of a 484-token prompt, float32 and bfloat16;
- ``decode sdpa``: one decode step's attention of 11 rows over 400 keys each, as `paged_sdpa` calls it (float32:
  ``[n, Hq, 1, D]`` queries with ``enable_gqa`` at two threads, else ``[n, H, g, D]``; bfloat16: ``[n, H, g, D]``).

Reported per call: both kinds' medians over the rounds and the median of the per-round ratios.

Command (the numbers in docs/benchmarks.md)::

    python scripts/bench/cpu/bench_mkl_dispatch.py --preload "$PWD/libmkl_any_cpu.so" --out results/bench_mkl_dispatch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hf_paged_cache.attention.decode import splits_query_heads
from hf_paged_cache.bench import format_table, write_json
from hf_paged_cache.heap import pad_heap
from hf_paged_cache.kernels import mkl_takes_fast_path

KINDS = ("stock", "preloaded")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
PROMPT, DECODE_ROWS, DECODE_KEYS = 484, 11, 400


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preload", default=None,
                        help="the library preloaded in the 'preloaded' children, required unless --child "
                             "(default: none)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads in every child (default: 2)")
    parser.add_argument("--rounds", type=int, default=5, help="child processes of each kind, alternated (default: 5)")
    parser.add_argument("--calls", type=int, default=20, help="timed calls of each kind per child (default: 20)")
    parser.add_argument("--child", action="store_true",
                        help="time the calls here and print them as JSON (what each child runs)")
    parser.add_argument("--out", default="results/bench_mkl_dispatch.json",
                        help="JSON output path (default: results/bench_mkl_dispatch.json)")
    args = parser.parse_args(argv)
    if not args.child and (args.preload is None or not os.path.isfile(args.preload)):
        parser.error(f"--preload: a library file to preload is required, got {args.preload!r}")
    return args


def calls() -> dict[str, Callable[[], torch.Tensor]]:
    """Each timed call on fixed random inputs."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    x, weight = randn(PROMPT, 576), randn(1536, 576)
    named = {"linear float32": lambda: F.linear(x, weight)}
    groups = HEADS // KV_HEADS
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        query, key, value = randn(1, HEADS, PROMPT, HEAD_DIM, dtype=dtype), *(
            randn(1, KV_HEADS, PROMPT, HEAD_DIM, dtype=dtype) for _ in range(2))
        named[f"prompt sdpa {name}"] = lambda q=query, k=key, v=value: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True)
        split = dtype == torch.float32 and splits_query_heads()
        # [n, Hq, 1, D] split or [n, H, g, D] grouped, over [n, H, kv, D] keys and values
        rows = randn(DECODE_ROWS, HEADS, 1, HEAD_DIM, dtype=dtype) if split else randn(
            DECODE_ROWS, KV_HEADS, groups, HEAD_DIM, dtype=dtype)
        keys, values = (randn(DECODE_ROWS, KV_HEADS, DECODE_KEYS, HEAD_DIM, dtype=dtype) for _ in range(2))
        named[f"decode sdpa {name}"] = lambda q=rows, k=keys, v=values, gqa=split: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=gqa)
    return named


def time_here(args: argparse.Namespace) -> dict[str, Any]:
    """This process's medians (us) of every call, and what MKL's vendor check says here."""
    torch.set_num_threads(args.threads)
    pad_heap()
    medians = {}
    for name, call in calls().items():
        for _ in range(3):
            call()
        seconds = []
        for _ in range(args.calls):
            start = time.perf_counter()
            call()
            seconds.append(time.perf_counter() - start)
        medians[name] = statistics.median(seconds) * 1e6
    return {"fast_path": mkl_takes_fast_path(), "median_us": medians}


def run_child(args: argparse.Namespace, kind: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    if kind == "preloaded":
        env["LD_PRELOAD"] = args.preload
    command = [sys.executable, __file__, "--child", "--threads", str(args.threads), "--calls", str(args.calls)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(time_here(args)))
        return {}
    rounds = [{kind: run_child(args, kind) for kind in KINDS} for _ in range(args.rounds)]
    rows = []
    for name in rounds[0]["stock"]["median_us"]:
        stock, preloaded = ([r[kind]["median_us"][name] for r in rounds] for kind in KINDS)
        ratios = [s / p for s, p in zip(stock, preloaded, strict=True)]  # per round
        rows.append({"call": name, "stock_us": statistics.median(stock), "preloaded_us": statistics.median(preloaded),
                     "speedup": statistics.median(ratios), "speedup_range": [min(ratios), max(ratios)]})
    fast_path = {kind: sorted({str(r[kind]["fast_path"]) for r in rounds}) for kind in KINDS}
    payload = {"benchmark": "bench_mkl_dispatch", "args": vars(args), "fast_path": fast_path, "rows": rows,
               "rounds": rounds}
    print(f"MKL's vendor check passes: stock {fast_path['stock']}, preloaded {fast_path['preloaded']}; "
          f"{args.threads} threads, {args.rounds} rounds")
    print(format_table([{**row, "stock_us": f"{row['stock_us']:.0f}", "preloaded_us": f"{row['preloaded_us']:.0f}",
                         "speedup": f"{row['speedup']:.2f}x",
                         "speedup_range": "{:.2f}-{:.2f}".format(*row["speedup_range"])} for row in rows],
                       ["call", "stock_us", "preloaded_us", "speedup", "speedup_range"]))
    write_json(args.out, payload, "cpu")
    return payload


if __name__ == "__main__":
    main()
