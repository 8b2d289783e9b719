"""How a step's rows pick their tokens from its logits: each request's choice its own, tried twice.

A request picks with `Request.pick` (its processors, sampling and stopping criteria). The decode rows of plain
greedy requests (`Request.greedy`) take the first maximum of their logits in one reduction for all of them; a
row whose maximum is not finite goes through `Request.pick`, which fails it alone with the reason. A pick that
fails twice (`attempts`) fails its request alone; the other rows keep their tokens.

With speculative decoding a row also has draft tokens to verify (`verify_rows`): it keeps the drafts the
model picks too, then its own token where it first differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from ..errors import PoolExhaustedError
from ..speculative.speculator import Drafts
from ..speculative.verification import kept_picks
from .logprobs import token_logprobs
from .plan import Chunk
from .request import Choice, Request
from .step_result import StepResult

T = TypeVar("T")
ATTEMPTS = 2  # tries of each forward and token choice before a failure is taken to be the request's own


def attempts(run: Callable[[], T]) -> T:
    """`run()`, tried up to `ATTEMPTS` times; the last failure propagates. `PoolExhaustedError` is not retried
    (the pool is as full the second time)."""
    for _ in range(ATTEMPTS - 1):
        try:
            return run()
        except PoolExhaustedError:
            raise
        except Exception:  # noqa: BLE001 (tried again)
            pass
    return run()


def choose_rows(requests: list[Request], logits: torch.Tensor, result: StepResult) -> None:
    """Each request's next token from its row of `logits` ``[B, V]`` into `result`: the plain greedy rows'
    by one reduction for all (their first maximum, as ``argmax`` takes it), the others one by one (`choose`)."""
    picked: dict[int, int] = {}  # row -> its token, for plain greedy rows whose maximum is finite
    plain = [row for row, request in enumerate(requests) if request.greedy is not None]
    if plain:
        rows = logits if len(plain) == len(requests) else logits[plain]  # [n, V]
        best, tokens = rows.max(dim=-1)  # [n] each: the first maximum's value and index
        found = zip(plain, best.tolist(), tokens.tolist())
        picked = {row: token for row, value, token in found if math.isfinite(value)}
    for row, request in enumerate(requests):
        if row in picked:
            result.choices[request] = request.greedy_choice(picked[row])
        else:
            choose(request, logits[row], result)


def choose(request: Request, logits: torch.Tensor, result: StepResult) -> None:
    """`request`'s next token from `logits` ``[V]`` into `result`, or its failure (after `ATTEMPTS` tries)."""
    try:
        result.choices[request] = attempts(lambda: request.pick(logits))
    except Exception as error:  # noqa: BLE001 (its own settings or processors: it fails alone)
        result.failures[request] = error


def choose_for_chunk(chunk: Chunk, logits: torch.Tensor, result: StepResult) -> None:
    """What a computed chunk gives, from its logits ``[r, V]`` at `logit_offsets`: its prompt's
    log-probabilities when asked for, then the first token of each choice of the prompt when it finishes."""
    request = chunk.request
    if request.needs_prompt_logprobs:
        first, targets = request.prompt_targets(chunk.start, len(chunk.tokens))
        computed = token_logprobs(logits[: len(targets)], targets, request.prompt_logprobs_k)
        result.prompt_logprobs[request] = (first, computed)
    if chunk.finishes:
        for member in request.group:  # the choices of one prompt pick from the same logits
            choose(member, logits[-1], result)
    else:
        result.kept.add(request)


def verify_rows(requests: list[Request], logits: torch.Tensor, drafts: Drafts) -> list[list[Choice]]:
    """Each row's kept tokens from its `logits` ``[B, 1 + k, V]`` by the verification rule (`kept_picks`): the
    drafts the request picks too (greedy or sampled, each position picked as it would be without drafts), then
    its own token where it first differs (or after the last draft), ending early at a token that stops the row.
    A pick that fails twice propagates (the step is then dropped and run without drafts)."""
    rows = []
    best, firsts = (values.tolist() for values in logits.max(dim=-1))  # [B][1 + k]: plain greedy rows' picks
    for row, request in enumerate(requests):

        def pick(position: int, kept: Sequence[Choice], row: int = row, request: Request = request) -> Choice:
            if request.greedy is not None and math.isfinite(best[row][position]):
                return request.greedy_choice(firsts[row][position], position)
            after = [choice.token for choice in kept]
            return attempts(lambda: request.pick(logits[row, position], after))

        rows.append(kept_picks(drafts.tokens[row], pick))
    return rows
