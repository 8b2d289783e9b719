"""Shared helpers for the benchmark scripts in ``scripts/``: workload, KV byte accounting, timing, JSON.

Nothing here is imported by the library itself; the scripts (``scripts/bench_*.py``) and their tests use it.

Workload
--------
`sharegpt_workload` draws a seeded stream of ragged requests whose prompt and output lengths follow
log-normal distributions matched to the ShareGPT statistics published in the vLLM paper (Kwon et al.,
"Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Fig. 11):
mean input 161.31 tokens and mean output 337.99 tokens, both with long right tails.

What is and is not fitted, honestly: the paper gives the means and histograms, not the raw data or the
log-space spread. Only the means are matched. The log-space standard deviations are *our assumption*
(``sigma = 1.0`` for inputs, ``0.8`` for outputs), chosen to give the long right tail of those histograms
(median / mean = exp(-sigma^2 / 2) = 0.61 for inputs and 0.73 for outputs). A log-normal with mean ``m`` and
log-space deviation ``sigma`` has ``mu = ln(m) - sigma^2 / 2``, so:

==========  ======  =====  ======  ===============
length      mean    sigma  mu      median (e^mu)
==========  ======  =====  ======  ===============
input       161.31  1.0    4.583   97.8
output      337.99  0.8    5.503   245.6
==========  ======  =====  ======  ===============

Draws are rounded, clamped to at least 1 token and capped: prompts at ``min(max_prompt, context - new
tokens)``, outputs at ``max_output``. Capping shortens the tail and lowers the mean; `Workload.summary`
reports the realised statistics, which is what the JSON files record. Prompts are random token ids (no
special tokens), drawn per request from their own seeded generator: the first ``k`` requests of a stream
do not depend on how many are drawn, so a 16-request workload is the head of a 500-request one.

KV bytes
--------
For a model with ``L`` layers, ``H`` KV heads of width ``D`` and a dtype of ``s`` bytes one token costs
``2 x L x H x D x s`` bytes (`kv_bytes_per_token`; 46080 bytes for SmolLM2-135M in float32). Then

- DynamicCache reserved = sum over layers of ``keys.numel() * element_size`` + values likewise
  (`cache_tensor_bytes`): ``B x (longest prompt + new tokens - 1)`` positions, padding included;
- StaticCache reserved = ``2 x L x H x D x max_cache_len x B x s`` (`static_cache_reserved_bytes`);
- used bytes (any cache) = ``real tokens x bytes per token`` (`used_bytes`), padding excluded;
- PagedCache: ``stats().bytes_reserved`` (blocks in use) and ``stats().bytes_used``; a row storing ``t``
  tokens needs ``ceil(t / block_size)`` blocks (`paged_blocks`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import LogitsProcessor, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from .memory import KVLayout

SHAREGPT_INPUT_MEAN = 161.31
"""Mean ShareGPT prompt length in tokens (vLLM paper, Fig. 11)."""
SHAREGPT_OUTPUT_MEAN = 337.99
"""Mean ShareGPT output length in tokens (vLLM paper, Fig. 11)."""
INPUT_SIGMA = 1.0
"""Assumed log-space standard deviation of prompt lengths (not published; see the module docstring)."""
OUTPUT_SIGMA = 0.8
"""Assumed log-space standard deviation of output lengths (not published; see the module docstring)."""
SOURCE = (
    "log-normal lengths; means from Kwon et al. 2023 (vLLM paper, Fig. 11: ShareGPT mean input 161.31, "
    "mean output 337.99 tokens); log-space sigmas 1.0 (input) and 0.8 (output) are assumed, not fitted"
)


# ---------------------------------------------------------------------------------------------- workload


@dataclass(frozen=True)
class LogNormalLengths:
    """Token lengths ``round(exp(N(mu, sigma^2)))`` with a given arithmetic mean, clamped to ``[1, cap]``."""

    mean: float
    sigma: float

    @property
    def mu(self) -> float:
        """Log-space mean: ``ln(mean) - sigma^2 / 2``."""
        return math.log(self.mean) - self.sigma**2 / 2

    def sample(self, rng: random.Random, cap: int) -> int:
        return max(1, min(cap, round(rng.lognormvariate(self.mu, self.sigma))))


SHAREGPT_INPUT = LogNormalLengths(SHAREGPT_INPUT_MEAN, INPUT_SIGMA)
SHAREGPT_OUTPUT = LogNormalLengths(SHAREGPT_OUTPUT_MEAN, OUTPUT_SIGMA)


@dataclass(frozen=True)
class Request:
    """One request: its prompt token ids and how many tokens it wants generated."""

    prompt_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class Workload:
    """A seeded stream of ragged requests (see the module docstring for the distribution)."""

    requests: tuple[Request, ...]
    seed: int
    max_prompt: int
    max_output: int

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> Workload:
        """The first `n` requests (the same requests a smaller draw with the same seed gives)."""
        if n > len(self.requests):
            raise ValueError(f"asked for {n} requests but the workload holds {len(self.requests)}")
        return Workload(self.requests[:n], self.seed, self.max_prompt, self.max_output)

    @property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    def prompts(self) -> list[list[int]]:
        return [list(r.prompt_ids) for r in self.requests]

    def summary(self) -> dict[str, Any]:
        """Realised length statistics (after capping), for the JSON files."""

        def stats(values: list[int]) -> dict[str, float]:
            return {
                "mean": statistics.fmean(values),
                "median": statistics.median(values),
                "min": min(values),
                "max": max(values),
            }

        return {
            "num_requests": len(self.requests),
            "seed": self.seed,
            "max_prompt": self.max_prompt,
            "max_output": self.max_output,
            "prompt_lens": self.prompt_lens,
            "output_lens": self.output_lens,
            "prompt_stats": stats(self.prompt_lens),
            "output_stats": stats(self.output_lens),
            "distribution": {
                "input": {"mean": SHAREGPT_INPUT.mean, "sigma": SHAREGPT_INPUT.sigma, "mu": SHAREGPT_INPUT.mu},
                "output": {"mean": SHAREGPT_OUTPUT.mean, "sigma": SHAREGPT_OUTPUT.sigma, "mu": SHAREGPT_OUTPUT.mu},
                "source": SOURCE,
            },
        }


def sharegpt_workload(
    num_requests: int,
    *,
    seed: int = 0,
    max_prompt: int,
    max_output: int,
    token_range: tuple[int, int],
) -> Workload:
    """Draw `num_requests` requests with ShareGPT-like lengths and random prompt tokens.

    Args:
        num_requests: how many requests.
        seed: seeds both the lengths and the token ids; request ``i`` is the same for any `num_requests > i`.
        max_prompt: cap on prompt lengths (pass ``min(cli cap, context - new tokens)``).
        max_output: cap on output lengths.
        token_range: prompt token ids are drawn uniformly from ``[low, high)`` (keep special tokens out).
    """
    low, high = token_range
    if not 0 <= low < high:
        raise ValueError(f"token_range must be [low, high) with 0 <= low < high, got {token_range}")
    if max_prompt < 1 or max_output < 1:
        raise ValueError(f"max_prompt and max_output must be >= 1, got {max_prompt} and {max_output}")
    lengths = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt_len = SHAREGPT_INPUT.sample(lengths, max_prompt)
        output_len = SHAREGPT_OUTPUT.sample(lengths, max_output)
        tokens = random.Random(f"{seed}/{i}")
        prompt = tuple(tokens.randrange(low, high) for _ in range(prompt_len))
        requests.append(Request(prompt, output_len))
    return Workload(tuple(requests), seed, max_prompt, max_output)


def prompt_token_range(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> tuple[int, int]:
    """``[low, high)`` ids for random prompts: above every special token, inside both vocabularies."""
    high = min(len(tokenizer), model.config.get_text_config(decoder=True).vocab_size)
    low = max(tokenizer.all_special_ids, default=-1) + 1
    if low >= high:
        low = 0
    return low, high


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> dict[str, torch.Tensor]:
    """A left-padded batch: ``input_ids`` and ``attention_mask``, both ``[B, longest prompt]``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [B, S]
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, S]
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


# -------------------------------------------------------------------------------------------- KV bytes


def kv_bytes_per_token(config: transformers.PreTrainedConfig, dtype: torch.dtype) -> int:
    """``2 x layers x kv_heads x head_dim x dtype bytes``: the K/V one token costs over all layers."""
    return KVLayout.from_config(config).bytes_per_token(dtype)


def cache_tensor_bytes(cache: transformers.Cache) -> int:
    """Bytes of the key and value tensors a dense cache (Dynamic or Static) holds right now."""
    total = 0
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def static_cache_reserved_bytes(
    config: transformers.PreTrainedConfig, max_cache_len: int, batch_size: int, dtype: torch.dtype
) -> int:
    """``2 x layers x kv_heads x head_dim x max_cache_len x batch x dtype bytes`` (the formula, not a tensor)."""
    return kv_bytes_per_token(config, dtype) * max_cache_len * batch_size


def used_bytes(real_tokens: Iterable[int], bytes_per_token: int) -> int:
    """Bytes holding real (non-padding) tokens: ``sum(real_tokens) x bytes_per_token``."""
    return sum(real_tokens) * bytes_per_token


def paged_blocks(tokens_per_row: Iterable[int], block_size: int) -> int:
    """``sum(ceil(t / block_size))``: blocks a paged cache needs for rows storing these token counts."""
    return sum(-(-t // block_size) for t in tokens_per_row)


def stored_tokens(prompt_lens: Iterable[int], new_tokens: int) -> list[int]:
    """Real tokens each row's KV cache holds after ``generate(max_new_tokens=new_tokens)``.

    ``generate`` never feeds its last token back, so a row stores ``prompt + new_tokens - 1`` tokens.
    """
    return [p + new_tokens - 1 for p in prompt_lens]


# ---------------------------------------------------------------------------------- timing and memory


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels on CUDA (timers must not stop while work is still in flight)."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Timer:
    """``with Timer(device) as t: ...`` then ``t.seconds``; synchronizes CUDA on entry and exit.

    Also records ``cpu_seconds``, the process CPU time (`time.process_time`, all threads) over the same
    span. On a CPU shared with other work, wall time includes waiting for a core while CPU time does not,
    so CPU time is the steadier measure of the work done (on CUDA it only measures the host side).
    """

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.start = float("nan")  # time.perf_counter() on entry, after synchronizing
        self.cpu_start = float("nan")  # time.process_time() on entry
        self.seconds = float("nan")
        self.cpu_seconds = float("nan")

    def __enter__(self) -> Timer:
        synchronize(self.device)
        self.start = time.perf_counter()
        self.cpu_start = time.process_time()
        return self

    def __exit__(self, *exc_info: object) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self.start
        self.cpu_seconds = time.process_time() - self.cpu_start


class StepClock(LogitsProcessor):
    """A pass-through logits processor that timestamps every decoding step.

    ``generate`` calls logits processors once per step, right after that step's forward (greedy, sampling
    and beam search alike), so ``stamps[0]`` marks the end of prefill (time to first token, minus the token
    choice) and ``stamps[-1] - stamps[0]`` spans the remaining ``len(stamps) - 1`` decode forwards.

    `probe`, if given, is called at every step, after the stamp (its cost, microseconds for the probes the
    scripts use, falls inside the decode span), and the largest value it returns is kept in `high_water`:
    e.g. the KV bytes a cache holds.
    """

    def __init__(self, device: torch.device | str, probe: Callable[[], int] | None = None):
        self.device = torch.device(device)
        self.stamps: list[float] = []  # time.perf_counter() at each step
        self.cpu_stamps: list[float] = []  # time.process_time() at each step (see `Timer`)
        self.probe = probe
        self.high_water = 0

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        synchronize(self.device)
        self.stamps.append(time.perf_counter())
        self.cpu_stamps.append(time.process_time())
        if self.probe is not None:
            self.high_water = max(self.high_water, self.probe())
        return scores


def reset_peak_memory(device: torch.device | str) -> None:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device | str, cache_bytes: int) -> dict[str, Any]:
    """Peak memory of the last run: ``torch.cuda.max_memory_allocated`` on CUDA; elsewhere the cache's own
    tensor bytes (`cache_bytes`), since CPU allocators expose no comparable peak counter."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"kind": "cuda_max_memory_allocated", "bytes": int(torch.cuda.max_memory_allocated(device))}
    return {"kind": "cache_tensor_bytes", "bytes": int(cache_bytes)}


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


# ------------------------------------------------------------------------------------- CLI and output


def add_common_args(parser: argparse.ArgumentParser, *, out: str) -> None:
    """``--model --device --dtype --threads --seed --out``, shared by every script."""
    parser.add_argument("--model", default=None, help="Hub id or local path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch.set_num_threads (default: torch's choice); on a shared CPU 1 thread is far less noisy",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--out", default=out, help=f"JSON output path (default: {out})")


def load(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Apply ``--threads`` and load ``--model`` on ``--device`` / ``--dtype`` (left padding, pad token set)."""
    from .default_model import load_model_and_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model, device=args.device, dtype=args.dtype)
    return model, tokenizer


def pad_token_id(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> int:
    pad = tokenizer.pad_token_id
    if pad is None:
        pad = model.generation_config.pad_token_id
    return int(pad) if pad is not None else 0


def machine_info(device: torch.device | str) -> dict[str, Any]:
    """CPU model, cores, library versions, device name, date: what a reader needs to weigh the numbers."""
    device = torch.device(device)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if hasattr(os, "getloadavg"):
        info["load_average_1m"] = os.getloadavg()[0]
    return info


def write_json(path: str | os.PathLike[str], payload: dict[str, Any], device: torch.device | str) -> Path:
    """Write `payload` plus ``machine`` (see `machine_info`) to `path`, creating its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(payload)
    data["machine"] = machine_info(device)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
    return path


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    """A markdown table of `rows` (floats to 3 significant decimals)."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 1000 else f"{value:,.0f}"
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10_000:
            return f"{value:,}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(" --- " for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def mib(num_bytes: float) -> float:
    return num_bytes / 2**20


class FirstTokenTimer(BaseStreamer):
    """Time to first token of one `generate` call, as a streamer: `generate`'s first `put` is the prompt,
    its second the first new token. Create it right before calling `generate`."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass

    @property
    def seconds(self) -> float:
        """Seconds from construction to the first new token (to now if none came yet)."""
        return (self.first_token_at or time.perf_counter()) - self.start
