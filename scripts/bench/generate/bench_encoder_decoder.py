"""Whisper-shaped transcription through `generate`: PagedCache against the default `EncoderDecoderCache`.

A Whisper model of ``--preset`` dimensions with random weights (speed and memory depend on the shapes, not the
weights) transcribes ``--clips`` clips of random log-mel features (30 s each: 3,000 frames, 1,500 encoder
positions) in one ``generate`` call, ``--new-tokens`` tokens each (all of them), greedy and with ``--num-beams``
beams, once with the model's default cache and once with ``PagedCache(model)``, alternated D, P, D, P, ... for
``--repeats`` rounds after an untimed warm-up of each. The tokens must be the same.

Reported per mode: the median seconds of each (min-max), the paged / default ratio of adjacent runs (median), and
each cache's peak bytes, sampled after every step: the default cache's tensors (self- and cross-attention: every
beam holds a copy of its request's cross-attention keys and values) and PagedCache's blocks in use in both pools
(one copy of the cross-attention per request; what attention reads of it for beams is gathered per read, not
kept).

Command (the run reported in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_encoder_decoder.py --out results/bench_encoder_decoder.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import (
    DynamicCache,
    EncoderDecoderCache,
    LogitsProcessor,
    LogitsProcessorList,
)

from hf_paged_cache import PagedCache
from hf_paged_cache.bench import cache_tensor_bytes, write_json
from hf_paged_cache.bench.whisper import PRESETS, random_whisper


def paged_bytes(cache) -> int:
    """Blocks in use in the decoder's pool and in the cross-attention's (one copy a request)."""
    return cache.pool.blocks.num_used * cache.pool.bytes_per_block + cache.cross_attention_cache.nbytes()


def default_bytes(cache: EncoderDecoderCache) -> int:
    """The default cache's self- and cross-attention tensors (a copy per row: per beam)."""
    return cache_tensor_bytes(cache.self_attention_cache) + cache_tensor_bytes(cache.cross_attention_cache)


class PeakBytes(LogitsProcessor):
    """Samples a cache's bytes after every forward (a logits processor runs once a step), keeping the most."""

    def __init__(self, cache, measure):
        self.cache, self.measure, self.peak = cache, measure, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.peak = max(self.peak, self.measure(self.cache))
        return scores


def run(model, features: torch.Tensor, new_tokens: int, beams: int, paged: bool) -> tuple[float, torch.Tensor, int]:
    """One generate call: its seconds, its tokens and its cache's peak bytes."""
    if paged:
        cache, measure = PagedCache(model), paged_bytes
    else:
        text = model.config.get_text_config(decoder=True)
        cache, measure = EncoderDecoderCache(DynamicCache(config=text), DynamicCache(config=text)), default_bytes
    peak = PeakBytes(cache, measure)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_features=features, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             num_beams=beams, do_sample=False, cache=cache, logits_processor=LogitsProcessorList([peak]))
    seconds = time.perf_counter() - start
    if paged:
        cache.release()
    return seconds, out, peak.peak


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base", help="dimensions (default: base)")
    parser.add_argument("--clips", type=int, default=4, help="clips in the batch (default: 4)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per clip (default: 32)")
    parser.add_argument("--num-beams", type=int, default=4, help="beams of the beam-search mode (default: 4)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)

    model = random_whisper(args.preset)
    features = torch.randn(args.clips, 80, 3000, generator=torch.Generator().manual_seed(1))
    result = {"preset": args.preset, "clips": args.clips, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "threads": torch.get_num_threads(), "modes": {}}
    for beams in (1, args.num_beams):
        times: dict[str, list[float]] = {"default": [], "paged": []}
        held, sequences = {}, {}
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name in (("default", "paged") if round_ % 2 else ("paged", "default")):
                seconds, tokens, held[name] = run(model, features, args.new_tokens, beams, name == "paged")
                sequences[name] = tokens
                if round_:
                    times[name].append(seconds)
        if not torch.equal(sequences["paged"], sequences["default"]):
            raise RuntimeError(f"num_beams={beams}: PagedCache's tokens differ from the default cache's")
        ratios = [p / d for p, d in zip(times["paged"], times["default"])]
        mode = {name: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t)} for name, t in times.items()}
        mode |= {"time_ratio": statistics.median(ratios), "bytes": held}
        result["modes"][f"beams={beams}"] = mode
        print(f"num_beams={beams}: default {mode['default']['median_s']:.2f} s ({mode['default']['min_s']:.2f}-"
              f"{mode['default']['max_s']:.2f}), paged {mode['paged']['median_s']:.2f} s ({mode['paged']['min_s']:.2f}-"
              f"{mode['paged']['max_s']:.2f}), paged/default {mode['time_ratio']:.3f}; cache memory default "
              f"{held['default'] / 2**20:.1f} MiB, paged {held['paged'] / 2**20:.1f} MiB; tokens identical")
    if args.out:
        write_json(args.out, result, "cpu")  # with the machine it ran on
    return result


if __name__ == "__main__":
    main()
