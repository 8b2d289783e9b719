"""Do lm-eval's per-sample loglikelihoods change with ``--batch_size``? Our server in the default mode and with
``--batch-invariant`` (lm-eval's ``local-completions``), and lm-eval's own ``hf`` model, on the default model.

A multiple-choice set from the offline English Wikipedia excerpt (`hf_paged_cache.eval.corpora`): ``--items``
contexts of 40 words, each with 4 endings of 6 words (the words that follow, and 3 spans from elsewhere in the
text). Every (context, ending) loglikelihood is asked at batch sizes 1, 8 and 32 of each contender; reported per
contender and batch size against batch size 1: how many of the loglikelihoods differ at all (bitwise), the
largest difference, how many items' chosen ending (the most likely of the 4) changes, and the accuracy (the
true continuation chosen). Each server runs alone, with ``--threads`` threads; the ``hf`` model runs in this
process afterwards.

Command (the run reported in docs/determinism.md)::

    python scripts/eval/lm_eval_batch_sizes.py --out results/lm_eval_batch_sizes.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

import torch

from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.server_process import running_process
from hf_paged_cache.eval.corpora import load_corpus_text
from hf_paged_cache.models import resolve_model_path

BATCH_SIZES = (1, 8, 32)
SERVERS = {"ours": [], "ours-invariant": ["--batch-invariant"]}


def multiple_choice(items: int, seed: int = 0) -> list[tuple[str, list[str]]]:
    """`items` (context, 4 endings): 40 words, then the 6 that follow them first and 3 spans of 6 from elsewhere."""
    words = load_corpus_text("offline").text.split()
    generator = random.Random(seed)
    chosen = []
    for _ in range(items):
        start = generator.randrange(0, len(words) - 100)
        context = " ".join(words[start : start + 40])
        others = [generator.randrange(0, len(words) - 6) for _ in range(3)]
        endings = [" " + " ".join(words[at : at + 6]) for at in (start + 40, *others)]
        chosen.append((context, endings))
    return chosen


def loglikelihoods(model, requests: list[tuple[str, str]]) -> list[float]:
    from lm_eval.api.instance import Instance

    instances = [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(requests)]
    return [float(ll) for ll, _ in model.loglikelihood(instances)]


def summary(runs: dict[int, list[float]]) -> dict:
    """Each batch size against batch size 1: loglikelihoods that differ, the largest difference, changed choices."""
    base = runs[BATCH_SIZES[0]]

    def choices(values: list[float]) -> list[int]:
        return [max(range(4), key=lambda j, i=i: values[4 * i + j]) for i in range(len(values) // 4)]

    entry = {}
    for size, values in runs.items():
        entry[str(size)] = {
            "differing": sum(a != b for a, b in zip(values, base, strict=True)),
            "max_difference": max(abs(a - b) for a, b in zip(values, base, strict=True)),
            "choices_changed": sum(a != b for a, b in zip(choices(values), choices(base), strict=True)),
            "accuracy": sum(choice == 0 for choice in choices(values)) / (len(values) // 4),
        }
    return entry


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=100, help="contexts of 4 endings (default: 100)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default: 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    from lm_eval.api.registry import get_model

    model = resolve_model_path(None)
    requests = [(context, ending) for context, endings in multiple_choice(args.items) for ending in endings]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "OPENAI_API_KEY": "unused"}
    os.environ["OPENAI_API_KEY"] = "unused"
    logs = Path(tempfile.mkdtemp(prefix="lm-eval-batch-sizes-"))
    result = {"items": args.items, "requests": len(requests), "threads": args.threads, "contenders": {}}
    for name, flags in SERVERS.items():
        command = [sys.executable, "-m", "hf_paged_cache.serve", model, "--served-model-name", "default",
                   "--max-memory", "1GiB", *flags]
        with running_process(lambda port, command=command: [*command, "--port", str(port)], env,
                             lambda port, name=name: logs / f"{name}-{port}.log", 600.0) as (url, _):
            runs = {}
            for size in BATCH_SIZES:
                arguments = ",".join([f"base_url={url}/v1/completions", "model=default", "tokenized_requests=True",
                                      f"tokenizer={model}", "tokenizer_backend=huggingface", f"batch_size={size}",
                                      "num_concurrent=1", "max_retries=1"])
                runs[size] = loglikelihoods(get_model("local-completions").create_from_arg_string(arguments), requests)
        result["contenders"][name] = summary(runs)
        print(name, result["contenders"][name], flush=True)
    torch.set_num_threads(args.threads)
    runs = {size: loglikelihoods(get_model("hf").create_from_arg_string(
        f"pretrained={model},dtype=float32,device=cpu,batch_size={size}"), requests) for size in BATCH_SIZES}
    result["contenders"]["hf"] = summary(runs)
    print("hf", result["contenders"]["hf"], flush=True)
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
