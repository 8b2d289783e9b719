"""One request of a `ContinuousBatcher`: its prompt, how to pick its tokens, and the handle its caller holds.

Token choice and stopping come from transformers, built from a `GenerationConfig` exactly as ``generate``
builds them (its logits processors and stopping criteria), so a request means what the same arguments mean
to ``model.generate``. Sampling draws from the request's own `torch.Generator` (seeded by ``seed=``), so a
sampled request gives the same tokens whatever else runs beside it.
"""

from __future__ import annotations

import copy
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from transformers import (
    LogitsProcessorList,
    PreTrainedModel,
    StoppingCriteriaList,
)

_DONE = object()  # ends a handle's token stream
_UNSUPPORTED = {"num_beams": 1, "num_return_sequences": 1}  # arguments the batcher keeps at these values


class RequestHandle:
    """What `ContinuousBatcher.submit` returns: iterate it for new tokens as they come, or call `result()`."""

    def __init__(self, request_id: int):
        self.request_id = request_id
        self._tokens: queue.Queue[object] = queue.Queue()
        self._done = threading.Event()
        self._output: list[int] = []
        self._error: BaseException | None = None
        self.first_token_time: float | None = None  # time.perf_counter() when its first token came
        self.finish_time: float | None = None  # time.perf_counter() when it finished

    def __iter__(self) -> Iterator[int]:
        """Each new token id as soon as it is generated; raises the request's error, if it failed."""
        while True:
            item = self._tokens.get()
            if item is _DONE:
                break
            yield item  # type: ignore[misc]
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request is done; its generated token ids (the prompt not included)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return list(self._output)

    def done(self) -> bool:
        return self._done.is_set()

    # ------------------------------------------------------------------ called by the batcher

    def _emit(self, token: int) -> None:
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        self._output.append(token)
        self._tokens.put(token)

    def _finish(self, error: BaseException | None = None) -> None:
        if not self._done.is_set():
            self.finish_time = time.perf_counter()
            self._error = error
            self._done.set()
            self._tokens.put(_DONE)


class Request:
    """A prompt, its generation settings (transformers' processors and criteria) and what it generated so far."""

    def __init__(
        self,
        request_id: int,
        prompt: Sequence[int],
        model: PreTrainedModel,
        generation_kwargs: dict[str, Any],
        tokenizer: Any = None,
    ):
        kwargs = dict(generation_kwargs)
        seed = kwargs.pop("seed", None)
        config = copy.deepcopy(model.generation_config)
        unused = config.update(**kwargs)
        if unused:
            raise TypeError(f"unknown generation argument(s) {sorted(unused)} (GenerationConfig has no such field)")
        for name, allowed in _UNSUPPORTED.items():
            if getattr(config, name, allowed) not in (None, allowed):
                raise ValueError(f"the continuous batcher does not do {name}={getattr(config, name)}; use generate()")
        if config.max_new_tokens is not None:
            config.max_length = len(prompt) + config.max_new_tokens  # what generate does with max_new_tokens
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
        self.id = request_id
        self.prompt = list(prompt)
        self.config = config
        self.processors: LogitsProcessorList = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=len(prompt), device=model.device
        )
        self.criteria: StoppingCriteriaList = model._get_stopping_criteria(
            generation_config=config, stopping_criteria=StoppingCriteriaList(), tokenizer=tokenizer
        )
        self.generator = torch.Generator(device=model.device)
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()  # a fresh random seed, leaving torch's global generator alone
        self.generated: list[int] = []
        self.handle = RequestHandle(request_id)

    @property
    def max_length(self) -> int:
        """Most tokens (prompt and generated) it can reach: ``max_length``, or prompt + ``max_new_tokens``."""
        return self.config.max_length

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what its cache must hold to compute the next token."""
        return self.prompt + self.generated

    def choose(self, logits: torch.Tensor) -> tuple[int, bool]:
        """Pick the next token from the last position's `logits` ``[V]``; returns ``(token, finished)``."""
        ids = torch.tensor([self.tokens], device=logits.device)  # [1, n]
        scores = self.processors(ids, logits.unsqueeze(0).float())  # [1, V]
        if self.config.do_sample:
            probs = torch.softmax(scores, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=self.generator))
        else:
            token = int(scores.argmax(dim=-1))
        self.generated.append(token)
        self.handle._emit(token)
        full = torch.tensor([self.tokens], device=logits.device)
        finished = bool(self.criteria(full, scores).any())
        return token, finished
