"""The benchmark workloads: a seeded stream of ragged requests shaped like ShareGPT, or of uniform lengths.

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

`uniform_workload` draws prompt and output lengths uniformly from given ranges instead (a batch of requests
of one kind, e.g. 50-250 prompt tokens and 32-93 new ones).
"""

from __future__ import annotations

import copy
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
SHAREGPT_DISTRIBUTION = {
    "input": {"mean": SHAREGPT_INPUT.mean, "sigma": SHAREGPT_INPUT.sigma, "mu": SHAREGPT_INPUT.mu},
    "output": {"mean": SHAREGPT_OUTPUT.mean, "sigma": SHAREGPT_OUTPUT.sigma, "mu": SHAREGPT_OUTPUT.mu},
    "source": SOURCE,
}


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
    distribution: dict[str, Any] = field(default_factory=lambda: copy.deepcopy(SHAREGPT_DISTRIBUTION))  # how drawn

    def __len__(self) -> int:
        return len(self.requests)

    def head(self, n: int) -> Workload:
        """The first `n` requests (the same requests a smaller draw with the same seed gives)."""
        if n > len(self.requests):
            raise ValueError(f"asked for {n} requests but the workload holds {len(self.requests)}")
        return replace(self, requests=self.requests[:n])

    @property
    def prompt_lens(self) -> list[int]:
        return [r.prompt_len for r in self.requests]

    @property
    def output_lens(self) -> list[int]:
        return [r.output_len for r in self.requests]

    def prompts(self) -> list[list[int]]:
        return [list(r.prompt_ids) for r in self.requests]

    def scaled_output_lens(self, scale: float, cap: int) -> list[int]:
        """Each output length times `scale`, rounded, at least 1 and at most `cap`: the share of ShareGPT's long
        answers a CPU run affords (the benchmarks' ``--output-scale`` and ``--max-new``)."""
        return [min(max(round(n * scale), 1), cap) for n in self.output_lens]

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
            "distribution": self.distribution,
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


def fixed_length_workload(
    prompt_lens: Sequence[int], *, seed: int = 0, output_len: int, token_range: tuple[int, int]
) -> Workload:
    """Requests with exactly these prompt lengths (random tokens, seeded as `sharegpt_workload`'s)."""
    low, high = token_range
    requests = []
    for i, prompt_len in enumerate(prompt_lens):
        tokens = random.Random(f"{seed}/{i}")
        requests.append(Request(tuple(tokens.randrange(low, high) for _ in range(prompt_len)), output_len))
    return Workload(tuple(requests), seed, max(prompt_lens), output_len)


def uniform_workload(
    num_requests: int,
    *,
    seed: int = 0,
    prompt_lens: tuple[int, int],
    output_lens: tuple[int, int],
    token_range: tuple[int, int],
) -> Workload:
    """Draw `num_requests` requests whose prompt and output lengths are uniform integers in the inclusive ranges
    `prompt_lens` and `output_lens` (random prompt tokens from ``[low, high)`` = `token_range`).

    One generator seeded with `seed` draws, request after request, the prompt's length, its tokens and the
    output's length.
    """
    low, high = token_range
    if not 0 <= low < high:
        raise ValueError(f"token_range must be [low, high) with 0 <= low < high, got {token_range}")
    if not 1 <= prompt_lens[0] <= prompt_lens[1] or not 1 <= output_lens[0] <= output_lens[1]:
        raise ValueError(f"length ranges must be (low, high) with 1 <= low <= high, got {prompt_lens} and "
                         f"{output_lens}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = tuple(rng.randrange(low, high) for _ in range(rng.randint(*prompt_lens)))
        requests.append(Request(prompt, rng.randint(*output_lens)))
    distribution = {"input": {"uniform": list(prompt_lens)}, "output": {"uniform": list(output_lens)},
                    "source": "uniform integer lengths in the inclusive ranges"}
    return Workload(tuple(requests), seed, prompt_lens[1], output_lens[1], distribution)


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
