"""OpenAI's presence and frequency penalties as a transformers `LogitsProcessor`.

OpenAI defines them on the tokens generated so far (not the prompt): with ``c[j]`` the times token ``j`` was
generated, ``logit[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty``. transformers has
neither (its ``repetition_penalty`` divides, and counts the prompt too), hence this processor.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor


class PresenceFrequencyPenalty(LogitsProcessor):
    """Lower the logits of tokens already generated: by `presence` once, and by `frequency` per occurrence.

    Args:
        prompt_length: tokens of the prompt at the start of each row of ``input_ids`` (not counted).
        presence: OpenAI's ``presence_penalty`` (-2 to 2; negative values favour repeats).
        frequency: OpenAI's ``frequency_penalty`` (-2 to 2).
    """

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_length = prompt_length
        self.presence = presence
        self.frequency = frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_length:]  # [B, G]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)  # [B, V]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)
