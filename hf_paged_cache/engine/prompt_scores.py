"""`PromptScores`: the prompt log-probabilities a batcher has computed, kept by block for the prompts that follow.

Scoring asks for every prompt token's log-probability (``prompt_logprobs``, an ``echo`` with ``logprobs``), and the
pool's prefix cache holds keys and values, not logits: so a scored prompt used to be computed whole even when its
blocks were cached. lm-eval's multiple-choice tasks send one context with four endings, and the context was
computed four times. Here the log-probabilities of a prompt's tokens are kept per full block, keyed like the pool's
blocks by a chained digest of every token up to the block's end (`prefix_index.block_keys`: a token's
log-probability depends on the tokens before it and on itself, all inside that key). A later prompt that starts
with the same blocks takes their log-probabilities, reuses their keys and values from the prefix cache, and
computes only the rest, starting one position early: the log-probability of its first new token comes from the
logits of the position before it.

Exact in batch-invariant mode: the stored numbers are the bits a computation would give again. In the default
mode they are the numbers the first computation gave, which a second one, in other company, may round
differently in the last bits (docs/determinism.md). Kept for the `capacity` blocks used last; a block's entry
records the most likely alternatives it was computed with (``k``) and serves requests asking as many or fewer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ..pool.prefix_index import block_keys
from .logprobs import TokenLogprob

if TYPE_CHECKING:
    from .request import Request
    from .step_result import StepResult


class PromptScores:
    """Prompt log-probabilities by block: `lookup` what a prompt's leading blocks hold, `store` what was computed."""

    def __init__(self, block_size: int, capacity: int):
        self.block_size = block_size
        self.capacity = capacity
        # block b's key (`block_keys`: tokens [0, (b + 1) * block_size)) -> (k, log-probabilities of the block's
        # tokens, those after the first in block 0)
        self._blocks: OrderedDict[bytes, tuple[int, tuple[TokenLogprob, ...]]] = OrderedDict()

    def lookup(self, tokens: Sequence[int], k: int) -> list[TokenLogprob]:
        """The log-probabilities of tokens ``1 .. n - 1`` of `tokens` (n a multiple of the block size: the leading
        blocks held with at least `k` alternatives each), their alternatives cut to `k`; empty when none."""
        found: list[TokenLogprob] = []
        for key in block_keys(tokens, self.block_size):
            entry = self._blocks.get(key)
            if entry is None or entry[0] < k:
                break
            self._blocks.move_to_end(key)
            found.extend(entry[1] if entry[0] == k else (replace(lp, top=lp.top[:k]) for lp in entry[1]))
        return found

    def store(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob], k: int) -> None:
        """Keep the log-probabilities of `tokens` ``1 .. len(logprobs)`` (`logprobs[i]` is token ``i + 1``'s,
        with its `k` most likely alternatives) for every full block they cover."""
        size = self.block_size
        for index, key in enumerate(block_keys(tokens[: len(logprobs) + 1], size)):
            entry = self._blocks.get(key)
            if entry is None or entry[0] < k:
                first = max(index * size - 1, 0)  # logprobs[i] is token i + 1's; token 0 has none
                self._blocks[key] = (k, tuple(logprobs[first : (index + 1) * size - 1]))
            self._blocks.move_to_end(key)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


def record_prompt_logprobs(request: Request, result: StepResult, scores: PromptScores | None) -> None:
    """Add the prompt log-probabilities `result` computed for `request` to it, and keep them in `scores` (when
    given, for a prompt without images) for the prompts that follow."""
    if request in result.prompt_logprobs:
        first, computed = result.prompt_logprobs[request]
        request.add_prompt_logprobs(computed, first)
        if scores is not None and request.media is None:
            scores.store(request.prompt, request.prompt_logprobs, request.prompt_logprobs_k)

