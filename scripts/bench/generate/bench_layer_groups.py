"""KV memory of a hybrid model (sliding-window and full-attention layers) in DynamicCache and PagedCache.

Each scenario runs greedy (or seeded sampling) ``model.generate`` twice, with ``DynamicCache`` and with
``PagedCache(model)`` (elastic pool, ``paged_sdpa``), checks that the tokens are identical, and records
after every forward (a stopping criterion that never stops):

- held: the KV bytes the cache keeps between forwards. DynamicCache: ``keys.numel() + values.numel()`` of
  each layer, times the dtype size (a sliding layer keeps its last ``W - 1`` positions);
  PagedCache: ``stats().bytes_reserved`` (blocks in use x their group's bytes per block);
- storage: the bytes really allocated. DynamicCache: the distinct storages behind its tensors (right after
  a prefill, a sliding layer's last ``W - 1`` positions are a view of the whole prompt's tensor, so the
  whole prompt stays allocated until the next forward); PagedCache: ``pool.storage_bytes()`` (an elastic
  pool never shrinks, so its final size is its peak);
- the most blocks any row holds in a sliding group (bounded by ``ceil(W / block_size) + 1``).

Scenarios (``--scenarios``): ``one_prompt`` (one ``--long``-token prompt, ``--new-tokens`` new tokens),
``ragged`` (8 prompts spread evenly from ``--short`` to ``--long`` tokens, left-padded), ``long_decode``
(one ``--decode-prompt``-token prompt decoding ``--decode-tokens`` tokens), ``samples``
(``num_return_sequences=8`` sampled from one ``--samples-prompt``-token prompt; "one copy" is the KV that a
single row of the same tokens holds in PagedCache).

Command (the numbers in docs/benchmarks.md; Gemma-3-270m is fetched and converted on first use)::

    python scripts/bench/generate/bench_layer_groups.py --model gemma-3-270m --threads 2 --out results/bench_layer_groups.json
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, StoppingCriteria

from hf_paged_cache import KVLayout, PagedCache, set_paged_attention
from hf_paged_cache.bench import add_common_args, format_table, load, mib, write_json

SCENARIOS = ("one_prompt", "ragged", "long_decode", "samples")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/bench_layer_groups.json")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated (default: all of {SCENARIOS})")
    parser.add_argument("--long", type=int, default=3000, help="the long prompt's tokens (default: 3000)")
    parser.add_argument("--short", type=int, default=200, help="the ragged batch's shortest prompt (default: 200)")
    parser.add_argument("--new-tokens", type=int, default=8, help="new tokens per row (default: 8)")
    parser.add_argument("--decode-prompt", type=int, default=600, help="long_decode's prompt (default: 600)")
    parser.add_argument("--decode-tokens", type=int, default=600, help="long_decode's new tokens (default: 600)")
    parser.add_argument("--samples-prompt", type=int, default=500, help="samples' prompt (default: 500)")
    parser.add_argument("--block-size", type=int, default=16, help="PagedCache block size (default: 16)")
    return parser.parse_args(argv)


class Probe(StoppingCriteria):
    """Samples a cache's memory after every forward of `generate` (it never stops generation)."""

    def __init__(self, cache: Any):
        self.cache = cache
        self.held_peak = self.storage_peak = self.sliding_blocks_peak = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        held, storage, sliding = measure(self.cache)
        self.held_peak = max(self.held_peak, held)
        self.storage_peak = max(self.storage_peak, storage)
        self.sliding_blocks_peak = max(self.sliding_blocks_peak, sliding)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def measure(cache: Any) -> tuple[int, int, int]:
    """``(held bytes, allocated storage bytes, most blocks a row holds in a sliding group)`` right now."""
    if isinstance(cache, PagedCache):
        stats = cache.stats()
        sliding = [g.max_blocks_per_row for g in stats.groups if g.name.startswith("sliding")]
        return stats.bytes_reserved, cache.pool.storage_bytes(), max(sliding, default=0)
    held, storages = 0, {}
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor) and tensor.numel():
                held += tensor.numel() * tensor.element_size()
                storage = tensor.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return held, sum(storages.values()), 0


def prompts(vocab_size: int, lengths: list[int], seed: int, pad: int) -> dict[str, torch.Tensor]:
    """A left-padded batch of random token ids (from id 1000 up in a real vocabulary, past its special tokens)."""
    generator = torch.Generator().manual_seed(seed)
    low = 1000 if vocab_size > 10_000 else 3
    width = max(lengths)
    ids = torch.full((len(lengths), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, width - length :] = torch.randint(low, vocab_size, (length,), generator=generator)
        mask[row, width - length :] = 1
    return {"input_ids": ids, "attention_mask": mask}


def run(model: PreTrainedModel, batch: dict[str, torch.Tensor], block_size: int, **kwargs: Any) -> dict[str, Any]:
    """Generate with DynamicCache, then PagedCache (same seed); their memory and whether tokens match."""
    batch = {name: t.to(model.device) for name, t in batch.items()}
    out: dict[str, Any] = {}
    sequences, scores = [], []
    keep_scores = kwargs["max_new_tokens"] <= 16  # per-step logits of a large vocabulary add up fast
    for name, cache in (("dynamic", DynamicCache(config=model.config)),
                        ("paged", PagedCache(model, block_size=block_size))):
        probe = Probe(cache)
        torch.manual_seed(0)
        with torch.no_grad():
            result = model.generate(**batch, **kwargs, cache=cache, stopping_criteria=[probe],
                                    return_dict_in_generate=True, output_scores=keep_scores)
        sequences.append(result.sequences)
        scores.append(result.scores)
        held, storage, _ = measure(cache)
        out[name] = {"held_end": held, "held_peak": probe.held_peak, "storage_peak": probe.storage_peak,
                     "sliding_blocks_peak": probe.sliding_blocks_peak, "storage_end": storage}
        if isinstance(cache, PagedCache):
            out["paged"]["groups"] = [
                {"name": g.name, "layers": g.num_layers, "blocks": g.blocks_in_use, "bytes": g.bytes_reserved}
                for g in cache.stats().groups
            ]
            cache.release()
    out["tokens_identical"] = bool(torch.equal(sequences[0], sequences[1]))
    if keep_scores:  # the largest difference of any logit at any step
        out["max_logit_diff"] = max(float((a - b).abs().max()) for a, b in zip(*scores, strict=True))
    out["held_ratio"] = out["paged"]["held_end"] / out["dynamic"]["held_end"]
    out["peak_ratio"] = out["paged"]["storage_peak"] / out["dynamic"]["storage_peak"]
    return out


def one_copy(model: PreTrainedModel, batch: dict[str, torch.Tensor], block_size: int, new_tokens: int) -> int:
    """KV bytes one row of `batch` holds in PagedCache after `new_tokens` sampled tokens."""
    batch = {name: t.to(model.device) for name, t in batch.items()}
    with PagedCache(model, block_size=block_size) as cache, torch.no_grad():
        torch.manual_seed(0)
        model.generate(**batch, max_new_tokens=new_tokens, do_sample=True, cache=cache)
        return cache.stats().bytes_reserved


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer = load(args)
    set_paged_attention(model)
    text = model.config.get_text_config(decoder=True)
    windows = [group.window for group in KVLayout.from_config(model.config).groups if group.window is not None]
    vocab, pad = text.vocab_size, tokenizer.pad_token_id or 0
    chosen = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(SCENARIOS))
    if unknown:
        raise SystemExit(f"unknown scenarios {unknown}; choose from {SCENARIOS}")
    steps = {
        "one_prompt": lambda: run(model, prompts(vocab, [args.long], args.seed, pad), args.block_size,
                                  max_new_tokens=args.new_tokens, do_sample=False),
        "ragged": lambda: run(model, prompts(vocab, spread(args.short, args.long, 8), args.seed, pad), args.block_size,
                              max_new_tokens=args.new_tokens, do_sample=False),
        "long_decode": lambda: run(model, prompts(vocab, [args.decode_prompt], args.seed, pad), args.block_size,
                                   max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                                   do_sample=False),
        "samples": lambda: samples(model, prompts(vocab, [args.samples_prompt], args.seed, pad), args),
    }
    results: dict[str, Any] = {"benchmark": "layer_groups", "model": args.model, "dtype": str(model.dtype), "block_size": args.block_size,
                               "windows": windows, "scenarios": {}}
    for name in tqdm(chosen, desc="scenarios", unit="scenario"):
        results["scenarios"][name] = steps[name]()
    write_json(args.out, results, model.device)
    print_report(results)
    return results


def spread(short: int, long: int, rows: int) -> list[int]:
    """`rows` lengths evenly from `short` to `long`."""
    return [round(short + (long - short) * i / (rows - 1)) for i in range(rows)]


def samples(model: PreTrainedModel, batch: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    out = run(model, batch, args.block_size, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
              do_sample=True, num_return_sequences=8)
    out["one_copy"] = one_copy(model, batch, args.block_size, args.new_tokens)
    out["copies_ratio"] = out["paged"]["held_end"] / out["one_copy"]
    return out


def print_report(results: dict[str, Any]) -> None:
    rows = []
    for name, r in results["scenarios"].items():
        rows.append({
            "scenario": name,
            "Dynamic held MiB": mib(r["dynamic"]["held_end"]),
            "Paged held MiB": mib(r["paged"]["held_end"]),
            "held ratio": r["held_ratio"],
            "Dynamic peak MiB": mib(r["dynamic"]["storage_peak"]),
            "Paged peak MiB": mib(r["paged"]["storage_peak"]),
            "peak ratio": r["peak_ratio"],
            "sliding blocks/row max": r["paged"]["sliding_blocks_peak"],
            "x one copy": r.get("copies_ratio", float("nan")),
            "tokens identical": r["tokens_identical"],
            "max logit diff": r.get("max_logit_diff", float("nan")),
        })
    print(format_table(rows, list(rows[0])) if rows else "no scenarios")


if __name__ == "__main__":
    main()
    sys.exit(0)
