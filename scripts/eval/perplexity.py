"""Strided perplexity of a causal LM over a corpus, scored through PagedCache, DynamicCache or no cache.

The method is the transformers guide's "Perplexity of fixed-length models" (windows of --max-length
tokens every --stride tokens, context tokens labelled -100), with the NLL averaged over all counted tokens
(token-weighted sum, not the mean of per-window means); see hf_paged_cache/eval/perplexity.py.

Examples:
    python scripts/eval/perplexity.py --max-tokens 4096 --compare --json results/ppl.json
    python scripts/eval/perplexity.py --corpus tests/data/perplexity_corpus.txt --cache dynamic
    python scripts/eval/perplexity.py --corpus wikitext:wikitext-2-raw-v1        # Hub dataset, when online
    python scripts/eval/perplexity.py --caches paged,paged:int8,paged:bfloat16   # keys and values stored as int8 ...
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import transformers

import hf_paged_cache
from hf_paged_cache.eval.corpora import load_corpus_text
from hf_paged_cache.eval.perplexity import (
    CACHE_MODES,
    CacheMode,
    encode_corpus,
    score_windows,
    strided_windows,
)
from hf_paged_cache.kernels import QUANTIZE_CHOICES, quantize_by_name
from hf_paged_cache.models import add_model_arguments, load_model_and_tokenizer


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--max-length", type=int, default=512, help="window length in tokens (default: 512)")
    parser.add_argument("--stride", type=int, default=256, help="tokens between window starts (default: 256)")
    parser.add_argument("--batch-size", type=int, default=2, help="windows per left-padded batch (default: 2)")
    parser.add_argument(
        "--cache", default="paged", choices=CACHE_MODES, help="how windows are fed, ignored with --compare (default: paged)"
    )
    parser.add_argument(
        "--chunk-size", type=int, default=128, help="tokens per cached forward (chunked prefill); 0 = whole window (default: 128)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per PagedCache block (default: 16)")
    parser.add_argument(
        "--corpus",
        default=None,
        help="text file, folder of *.txt, Hub dataset name[:config], or 'offline' "
        "(default: WikiText-2 raw test when the Hub is reachable, else the offline Wikipedia excerpt)",
    )
    parser.add_argument("--split", default="test", help="split of a Hub dataset corpus (default: test)")
    parser.add_argument(
        "--max-tokens", type=int, default=None,
        help="use only the first N corpus tokens (default: all)",
    )
    parser.add_argument("--compare", action="store_true", help="run 'paged' and 'none' and report the difference")
    parser.add_argument(
        "--caches", default=None,
        help="comma-separated caches to run in turn in this process, e.g. dynamic,paged; paged:KV_DTYPE stores "
        "keys and values as KV_DTYPE (paged:int8, paged:bfloat16, ...; the first paged run is the reference of "
        "the others); overrides --cache and --compare (default: none)",
    )
    parser.add_argument(
        "--repeats", type=int, default=1,
        help="rounds over the caches (alternated: A, B, A, B, ...); times are medians (default: 1)",
    )
    parser.add_argument("--quantize", choices=QUANTIZE_CHOICES, default=None,
                        help="weight-only int8 or int4 linear layers (hf_paged_cache.kernels.quantize_weights): "
                             "all but the output head, or int8-all / int4-all (default: off)")
    parser.add_argument("--json", type=Path, default=None, help="write the results to this JSON file (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument(
        "--attn-implementation", choices=["sdpa", "eager", "paged_sdpa"], default=None,
        help="attention of the paged runs: paged_sdpa reads keys and values straight from a PagedCache's "
        "blocks; dynamic and none runs keep the model's own (default: the model's own)",
    )
    return parser


def format_table(runs: dict[str, dict[str, Any]]) -> str:
    """A small fixed-width table of the runs."""
    header = (
        f"{'cache':<14} {'perplexity':>12} {'nll':>9} {'tokens':>8} {'windows':>8} {'seconds':>8} {'CPU s':>8} "
        f"{'peak KV MiB':>12}"
    )
    lines = [header, "-" * len(header)]
    for name, run in runs.items():
        peak = run["peak_cache_bytes"]
        peak_text = f"{peak / 2**20:.2f}" if peak is not None else "-"
        lines.append(
            f"{name:<14} {run['perplexity']:>12.4f} {run['nll']:>9.5f} {run['tokens']:>8d} {run['windows']:>8d} "
            f"{run['seconds']:>8.1f} {run['cpu_seconds']:>8.1f} {peak_text:>12}"
        )
    return "\n".join(lines)


def _cache_and_kv_dtype(mode: str) -> tuple[str, str | None]:
    """``"paged:int8"`` -> ``("paged", "int8")``; ``"dynamic"`` -> ``("dynamic", None)``."""
    cache, _, kv_dtype = mode.partition(":")
    return cache, kv_dtype or None


def _use_attention(model: torch.nn.Module, attention: str | None, own: str) -> None:
    """Switch `model` to `attention` (``paged_sdpa`` through `set_paged_attention`), or back to `own`."""
    wanted = attention or own
    if model.config._attn_implementation == wanted:
        return
    if wanted == hf_paged_cache.ATTENTION_NAME:
        hf_paged_cache.set_paged_attention(model)
    else:
        model.set_attn_implementation(wanted)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the evaluation described by `argv` (default: ``sys.argv``); print a table and return the results."""
    args = build_parser().parse_args(argv)
    chunk_size = args.chunk_size or None
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    if args.quantize:
        quantize_by_name(model, args.quantize)
    own_attention = model.config._attn_implementation
    corpus = load_corpus_text(args.corpus, split=args.split)
    ids = encode_corpus(tokenizer, corpus.text, args.max_tokens)  # [N]
    windows = strided_windows(ids, args.max_length, args.stride)
    modes: list[str] = ["paged", "none"] if args.compare else [args.cache]
    if args.caches:
        modes = [m for m in args.caches.split(",") if m]
        unknown = sorted({m for m in modes if _cache_and_kv_dtype(m)[0] not in CACHE_MODES or
                          (":" in m and not m.startswith("paged:"))})
        if unknown:
            raise SystemExit(f"unknown caches {unknown}; choose from {CACHE_MODES} or paged:KV_DTYPE")

    runs: dict[str, dict[str, Any]] = {}
    timings: dict[str, list[tuple[float, float]]] = {mode: [] for mode in modes}
    for mode in [m for _ in range(max(args.repeats, 1)) for m in modes]:
        cache, kv_dtype = _cache_and_kv_dtype(mode)
        _use_attention(model, args.attn_implementation if cache == "paged" else None, own_attention)
        result = score_windows(
            model,
            windows,
            cache=cast(CacheMode, cache),
            kv_dtype=kv_dtype,
            batch_size=args.batch_size,
            chunk_size=chunk_size,
            block_size=args.block_size,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0,
            progress=not args.no_progress,
        )
        runs[mode] = result.to_dict()
        timings[mode].append((result.seconds, result.cpu_seconds))
    for mode, times in timings.items():  # medians over the repeats
        runs[mode]["seconds"] = statistics.median(t for t, _ in times)
        runs[mode]["cpu_seconds"] = statistics.median(c for _, c in times)
        runs[mode]["cpu_seconds_runs"] = [c for _, c in times]
        paged_attention = args.attn_implementation if _cache_and_kv_dtype(mode)[0] == "paged" else None
        runs[mode]["attn_implementation"] = paged_attention or own_attention

    results: dict[str, Any] = {
        "model": args.model or "HuggingFaceTB/SmolLM2-135M-Instruct",
        "quantize": args.quantize,
        "model_path": getattr(model, "name_or_path", None),
        "corpus": {"name": corpus.name, "source": corpus.source, "tokens": int(ids.numel())},
        "settings": {
            "max_length": args.max_length,
            "stride": args.stride,
            "batch_size": args.batch_size,
            "chunk_size": chunk_size,
            "block_size": args.block_size,
            "dtype": str(model.dtype).removeprefix("torch."),
            "device": args.device,
            "attn_implementation": model.config._attn_implementation,
            "max_tokens": args.max_tokens,
            "averaging": "token-weighted: sum of NLL over counted tokens / counted tokens",
        },
        "versions": {
            "hf_paged_cache": hf_paged_cache.__version__,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "runs": runs,
    }
    print(f"corpus: {corpus.name} ({ids.numel()} tokens), windows: {len(windows)}, "
          f"max_length {args.max_length}, stride {args.stride}")
    print(format_table(runs))
    if "paged" in runs and "none" in runs:
        reference = runs["none"]["perplexity"]
        rel = abs(runs["paged"]["perplexity"] - reference) / reference
        results["relative_difference"] = rel
        print(f"relative difference paged vs none: {rel:.3e}")
    reference = next((m for m in runs if _cache_and_kv_dtype(m)[0] == "paged"), None)
    stored = {m: run for m, run in runs.items() if _cache_and_kv_dtype(m)[1] is not None and m != reference}
    if reference is not None and stored:
        base = runs[reference]["perplexity"]
        results["relative_to_" + reference] = {m: (run["perplexity"] - base) / base for m, run in stored.items()}
        for m, rel in results["relative_to_" + reference].items():
            print(f"perplexity {m} vs {reference}: {rel:+.3e} relative")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
