"""Log-probabilities of tokens, as a server reports them: the chosen token's and the most likely alternatives.

They are the log-softmax of the model's raw logits (before any logits processor: temperature, top-k or a
penalty changes how a token is picked, not what the model gave it), as OpenAI's and vLLM's ``logprobs`` are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_LOGPROBS = 20
"""The most alternatives a request may ask for (OpenAI's bound)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the `k` most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob) of the k most likely, most likely first


def token_logprobs(logits: torch.Tensor, targets: Sequence[int], k: int) -> list[TokenLogprob]:
    """The log-probability of ``targets[i]`` under ``logits[i]`` ``[P, V]``, with each row's `k` most likely."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
    index = torch.tensor(list(targets), device=logits.device).unsqueeze(1)  # [P, 1]
    chosen = logprobs.gather(1, index).squeeze(1).tolist()  # [P]
    if k:
        values, ids = logprobs.topk(k, dim=-1)  # [P, k] each
        tops = [tuple(zip(row_ids, row_values)) for row_ids, row_values in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(token, logprob, top) for token, logprob, top in zip(targets, chosen, tops)]


def check_logprobs(name: str, value: object) -> int | None:
    """`value` as a count of alternatives (None: not asked for); `ValueError` naming `name` outside 0..20."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer from 0 to {MAX_LOGPROBS}, got {value!r}")
    return value
