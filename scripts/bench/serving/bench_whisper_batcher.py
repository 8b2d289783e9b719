"""Whisper-shaped transcription of a folder of clips: the continuous batcher against a loop of `generate` calls
and against one `generate` batch.

A Whisper model of ``--preset`` dimensions with random weights (time depends on the shapes, not the weights)
transcribes ``--clips`` clips of random log-mel features (30 s windows: 3,000 frames, 1,500 encoder positions).
Transcripts differ in length, as real ones do: clip ``i`` says ``lengths[i]`` tokens (drawn from
``--min-tokens`` to ``--max-tokens``) and then its end (EOS), which a random model does not say by itself (if
it did, every mode would stop there alike), so:

- **loop**: one ``generate`` call a clip (``max_new_tokens=lengths[i]``): the encoder and every decoder step
  run for one clip at a time;
- **batch**: one ``generate`` call on all clips, each row made to say EOS after its length (a logits
  processor): the batch decodes until its longest clip ends, its finished rows padded meanwhile;
- **batcher**: every clip submitted at once to a `ContinuousBatcher` (``max_new_tokens=lengths[i]``): their
  encoders run in one batch when admitted, and each clip leaves the running batch when its transcript ends.

The three run alternated (loop, batch, batcher, then the order turned) for ``--repeats`` rounds after an untimed
warm-up of each. Reported: each mode's median seconds (min-max) and clips per second, the ratios of adjacent
runs, and how many clips got the same tokens in every mode (each clip's first ``lengths[i]``; float32 sums
taken in another order in a batch of other rows can flip a close call on random weights).

Command (the run reported in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/serving/bench_whisper_batcher.py --out results/bench_whisper_batcher.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.whisper import EOS, PRESETS, random_whisper

MODES = ("loop", "batch", "batcher")


class EndAt(LogitsProcessor):
    """Makes row ``b`` say EOS once it has said ``lengths[b]`` tokens (after the one-token decoder prompt)."""

    def __init__(self, lengths: list[int]):
        self.lengths = torch.tensor(lengths)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        said = input_ids.shape[1] - 1
        ending = self.lengths[: scores.shape[0]] == said
        scores[ending] = -torch.inf
        scores[ending, EOS] = 0.0
        return scores


def loop(model, features: torch.Tensor, lengths: list[int]) -> list[list[int]]:
    out = []
    for clip, length in zip(features, lengths):
        tokens = model.generate(input_features=clip[None], max_new_tokens=length, do_sample=False)
        out.append(tokens[0, -length:].tolist())
    return out


def batch(model, features: torch.Tensor, lengths: list[int]) -> list[list[int]]:
    tokens = model.generate(input_features=features, max_new_tokens=max(lengths) + 1, do_sample=False,
                            logits_processor=LogitsProcessorList([EndAt(lengths)]))
    return [row[:length].tolist() for row, length in zip(tokens, lengths)]  # Whisper returns no start token


def batcher(model, features: torch.Tensor, lengths: list[int]) -> list[list[int]]:
    with ContinuousBatcher(model, max_running=len(lengths)) as engine:
        handles = [engine.submit(input_features=clip, max_new_tokens=length, do_sample=False)
                   for clip, length in zip(features, lengths)]
        return [handle.result() for handle in handles]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="dimensions (default: tiny)")
    parser.add_argument("--clips", type=int, default=32, help="clips to transcribe (default: 32)")
    parser.add_argument("--min-tokens", type=int, default=16, help="shortest transcript (default: 16)")
    parser.add_argument("--max-tokens", type=int, default=96, help="longest transcript (default: 96)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)

    model = random_whisper(args.preset)
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(args.clips, 80, 3000, generator=generator)
    lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (args.clips,), generator=generator).tolist()
    runs = {"loop": loop, "batch": batch, "batcher": batcher}
    times: dict[str, list[float]] = {name: [] for name in MODES}
    answers: dict[str, list[list[int]]] = {}
    for round_ in range(args.repeats + 1):  # round 0 warms up
        for name in (MODES if round_ % 2 else MODES[::-1]):
            start = time.perf_counter()
            with torch.inference_mode():
                answers[name] = runs[name](model, features, lengths)
            if round_:
                times[name].append(time.perf_counter() - start)
            print(f"round {round_} {name}: {time.perf_counter() - start:.1f} s", flush=True)
    same = sum(len({tuple(answers[name][clip]) for name in MODES}) == 1 for clip in range(args.clips))
    result = {"preset": args.preset, "clips": args.clips, "tokens": sum(lengths), "lengths": lengths,
              "repeats": args.repeats, "threads": torch.get_num_threads(), "same_tokens": same, "modes": {}}
    for name in MODES:
        result["modes"][name] = {"median_s": statistics.median(times[name]), "min_s": min(times[name]),
                                 "max_s": max(times[name]),
                                 "clips_per_s": args.clips / statistics.median(times[name])}
    for other in ("loop", "batch"):
        ratios = [theirs / ours for theirs, ours in zip(times[other], times["batcher"])]
        result[f"{other}_over_batcher"] = statistics.median(ratios)
    for name, mode in result["modes"].items():
        print(f"{name}: {mode['median_s']:.1f} s ({mode['min_s']:.1f}-{mode['max_s']:.1f}), "
              f"{mode['clips_per_s']:.2f} clips/s")
    print(f"batcher {result['loop_over_batcher']:.2f}x the loop's speed, {result['batch_over_batcher']:.2f}x the "
          f"batch's; the same tokens in every mode for {same}/{args.clips} clips ({sum(lengths)} tokens)")
    if args.out:
        write_json(args.out, result, "cpu")  # with the machine it ran on
    return result


if __name__ == "__main__":
    main()
