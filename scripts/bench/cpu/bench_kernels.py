"""Packed linear layers (`hf_paged_cache.kernels.pack_linears`) against the model's stock kernels, on the CPU.

Two copies of the same model in one process, ``stock`` (PyTorch's ``F.linear``: MKL for float32) and
``packed`` (oneDNN on weights packed once). For each batch size of ``--batch-sizes``:

- ``decode``: one decode step (a forward of one new token per row) on a ``DynamicCache`` holding
  ``--context`` tokens per row, the new token's K/V cropped off again after each step;
- ``head``: the output head alone (``lm_head``, the largest single product), on that many rows.

Each measurement is taken ``--repeats`` times, alternating stock and packed (S, P, S, P, ...) after one
warm-up call of each; medians and ranges are reported, and the per-pair ratio ``stock / packed`` (its median
over pairs).

**The memory floor.** A decode step reads every weight at least once, so no step can be faster than reading
them at the machine's read bandwidth. The script copies the model's parameters (each tied one once: SmolLM2's
output head is its embedding) into one buffer and sums it ``--repeats`` times after one untimed pass, at the
same threads: that time is the floor (and bytes / time the read bandwidth); each decode step is also
reported as a multiple of it. The logits of both copies on the same decode step are compared: their largest absolute
difference and whether every row's greedy token agrees.

Command (the numbers in docs/benchmarks.md)::

    python scripts/bench/cpu/bench_kernels.py --threads 2 --batch-sizes 1,4,16 --out results/bench_kernels.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache, PreTrainedModel

from hf_paged_cache.bench import add_common_args, format_table, load, write_json
from hf_paged_cache.kernels import pack_linears


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_kernels.json")
    parser.add_argument("--batch-sizes", default="1,4,16", help="rows per decode step (default: 1,4,16)")
    parser.add_argument("--context", type=int, default=300, help="tokens each row holds (default: 300)")
    parser.add_argument("--repeats", type=int, default=9, help="timed calls per variant (default: 9)")
    return parser.parse_args(argv)


def timed_pairs(stock: Callable[[], Any], packed: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Milliseconds of `stock` and `packed`, alternated after a warm-up call of each."""
    stock(), packed()
    times: dict[str, list[float]] = {"stock": [], "packed": []}
    for _ in range(repeats):
        for name, fn in (("stock", stock), ("packed", packed)):
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    ratios = [s / p for s, p in zip(times["stock"], times["packed"], strict=True)]
    return {
        **{f"{name}_ms": statistics.median(t) for name, t in times.items()},
        **{f"{name}_ms_range": [min(t), max(t)] for name, t in times.items()},
        "speedup": statistics.median(ratios),
    }


def weight_read(model: PreTrainedModel, repeats: int) -> dict[str, Any]:
    """Milliseconds to read every weight of `model` once: its parameters copied into one buffer, summed."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])  # [n], the model's dtype
    flat.sum()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flat.sum()
        times.append((time.perf_counter() - start) * 1e3)
    read_ms = statistics.median(times)
    size = flat.numel() * flat.element_size()
    return {"weight_bytes": size, "read_ms": read_ms, "read_ms_range": [min(times), max(times)],
            "read_gb_s": size / read_ms / 1e6}


def decode_step(model: PreTrainedModel, prompt: torch.Tensor, new: torch.Tensor) -> Callable[[], torch.Tensor]:
    """A decode step on a cache of `prompt` (filled once); each call adds `new`'s K/V and crops them off again."""
    cache = DynamicCache(config=model.config)
    model(prompt, cache=cache)

    def step() -> torch.Tensor:
        logits = model(new, cache=cache).logits[:, -1]  # [B, vocab]
        cache.crop(-1)
        return logits

    return step


@torch.inference_mode()
def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    stock_model, _ = load(args)
    packed_model, _ = load(args)
    packed_count = pack_linears(packed_model)
    generator = torch.Generator().manual_seed(args.seed)
    vocab = stock_model.config.vocab_size
    floor = weight_read(stock_model, args.repeats)
    rows = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        prompt = torch.randint(vocab, (batch_size, args.context), generator=generator, device=args.device)
        new = torch.randint(vocab, (batch_size, 1), generator=generator, device=args.device)
        stock_step, packed_step = decode_step(stock_model, prompt, new), decode_step(packed_model, prompt, new)
        stock_logits, packed_logits = stock_step(), packed_step()
        hidden = torch.randn(batch_size, stock_model.config.hidden_size, generator=generator,
                             dtype=stock_model.dtype).to(args.device)
        rows.append({
            "batch_size": batch_size,
            "decode": timed_pairs(stock_step, packed_step, args.repeats),
            "head": timed_pairs(lambda: stock_model.lm_head(hidden), lambda: packed_model.lm_head(hidden),
                                args.repeats),
            "max_abs_logit_diff": (stock_logits - packed_logits).abs().max().item(),
            "greedy_tokens_agree": bool((stock_logits.argmax(-1) == packed_logits.argmax(-1)).all()),
        })
    results = {"benchmark": "kernels", "model": args.model, "dtype": str(stock_model.dtype),
               "threads": torch.get_num_threads(), "context": args.context, "repeats": args.repeats,
               "packed_linears": packed_count, "floor": floor, "rows": rows}
    for row in rows:
        row["decode"] |= {f"{name}_over_floor": row["decode"][f"{name}_ms"] / floor["read_ms"]
                          for name in ("stock", "packed")}
    write_json(args.out, results, args.device)
    print(format_table([{
        "rows": r["batch_size"],
        "decode step stock / packed ms": _pair(r["decode"]),
        "decode speedup": f"{r['decode']['speedup']:.2f}x",
        "lm_head stock / packed ms": _pair(r["head"]),
        "lm_head speedup": f"{r['head']['speedup']:.2f}x",
        "max logit diff": f"{r['max_abs_logit_diff']:.1e}",
        "greedy agrees": r["greedy_tokens_agree"],
        "step / floor, stock / packed": "{:.2f} / {:.2f}".format(r["decode"]["stock_over_floor"],
                                                                r["decode"]["packed_over_floor"]),
    } for r in rows], ["rows", "decode step stock / packed ms", "decode speedup", "lm_head stock / packed ms",
                       "lm_head speedup", "max logit diff", "greedy agrees", "step / floor, stock / packed"]))
    print(f"floor: every weight read once ({floor['weight_bytes'] / 1e6:.0f} MB) in {floor['read_ms']:.1f} ms "
          f"({floor['read_ms_range'][0]:.1f}-{floor['read_ms_range'][1]:.1f}), {floor['read_gb_s']:.1f} GB/s")
    return results


def _pair(timing: dict[str, Any]) -> str:
    (s_lo, s_hi), (p_lo, p_hi) = timing["stock_ms_range"], timing["packed_ms_range"]
    return (f"{timing['stock_ms']:.1f} ({s_lo:.1f}-{s_hi:.1f}) / "
            f"{timing['packed_ms']:.1f} ({p_lo:.1f}-{p_hi:.1f})")


if __name__ == "__main__":
    main()
