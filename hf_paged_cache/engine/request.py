"""One request of a `ContinuousBatcher`: its prompt, how to pick its tokens, and the handle its caller holds.

Token choice and stopping come from transformers, built from a `GenerationConfig` exactly as ``generate``
builds them (its logits processors and stopping criteria), so a request means what the same arguments mean
to ``model.generate``. Sampling draws from the request's own `torch.Generator` (seeded by ``seed=``), so a
sampled request gives the same tokens whatever else runs beside it.

Picking a token (`Request.pick`) changes nothing but the generator, and puts that back when it raises: the
token joins the request (`Request.accept`) only once the step that computed it is kept for every request.
A logits processor that is a `Constraint` (a structured output's grammar, `engine.constraints`) is asked for
its mask first, through that interface, and kept in step with the tokens each step keeps (`follow`).
A plain greedy request (no processors or constraints, no log-probabilities, stopped only by its length or an EOS id:
`GreedyStops`) needs none of that machinery: the batcher takes the first maximum of many such rows' logits at
once and asks the request only whether that token stops it (`Request.greedy_choice`).

A request can also record log-probabilities (``logprobs=k``: each new token's, with the `k` most likely;
``prompt_logprobs=k``: the same for each prompt token after the first), and be one of a group of choices of
one prompt (`ContinuousBatcher.submit_group`): the first member, the leader, prefills the prompt once, and the
others (its followers) pick their first tokens from the same logits and share its blocks.
"""

from __future__ import annotations

import inspect
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from ..errors import RequestCancelled
from .constraints import Constraint
from .encoder_inputs import EncoderInput
from .media import MediaInput
from .logprobs import TokenLogprob, check_logprobs, token_logprobs
from .validation import REQUEST_ARGUMENTS, check_request, flat_token_ids, generation_config_for

_BIAS = torch.tensor([-torch.inf, 0.0])  # added to a score: banned (mask False), allowed (mask True)


class RequestHandle:
    """What `ContinuousBatcher.submit` returns: iterate it for new tokens as they come, or call `result()`.

    Any number of threads may iterate one handle: each iteration streams every token from the first. All
    methods are safe from any thread.
    """

    def __init__(self, request_id: int, on_cancel: Callable[[], None] = lambda: None):
        self.request_id = request_id
        self._changed = threading.Condition()  # guards the fields below; notified on each token and at the end
        self._output: list[int] = []
        self._logprobs: list[TokenLogprob] = []  # one per token of _output, when the request records them
        self._prompt_logprobs: list[TokenLogprob] | None = None  # set with the first token, when recorded
        self._finish_reason: str | None = None
        self._finished = False
        self._error: BaseException | None = None
        self._cancel_requested = False
        self._on_cancel = on_cancel  # wakes the batcher's loop
        self.first_token_time: float | None = None  # time.perf_counter() when its first token came
        self.finish_time: float | None = None  # time.perf_counter() when it finished

    def __iter__(self) -> Iterator[int]:
        """Each new token id as soon as it is generated; then raises the request's error, if it failed
        (`RequestCancelled` once it was cancelled, after the tokens generated before)."""
        seen = 0
        while True:
            with self._changed:
                self._changed.wait_for(lambda: len(self._output) > seen or self._finished)
                new, finished, error = self._output[seen:], self._finished, self._error
            yield from new
            seen += len(new)
            if finished and not new:
                break
        if error is not None:
            raise error

    def with_logprobs(self, logprobs: bool) -> Iterator[tuple[int, TokenLogprob | None]]:
        """As iterating the handle, each token with its log-probability (None unless `logprobs`: a request
        submitted with ``logprobs=k``)."""
        recorded: list[TokenLogprob] = []
        for count, token in enumerate(self):
            if logprobs and count >= len(recorded):
                recorded = self.logprobs  # a copy of all so far: taken again only when used up
            yield token, recorded[count] if logprobs else None

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until the request is done; its generated token ids (the prompt not included).

        Raises the request's error if it failed (`RequestCancelled` if it was cancelled), `TimeoutError`
        if it is not done after `timeout` seconds.
        """
        with self._changed:
            if not self._changed.wait_for(lambda: self._finished, timeout):
                raise TimeoutError(f"request {self.request_id} not done after {timeout} s")
            if self._error is not None:
                raise self._error
            return list(self._output)

    def done(self) -> bool:
        with self._changed:
            return self._finished

    @property
    def logprobs(self) -> list[TokenLogprob]:
        """Each token's log-probability so far (``submit(..., logprobs=k)``; empty otherwise), in token order."""
        with self._changed:
            return list(self._logprobs)

    @property
    def prompt_logprobs(self) -> list[TokenLogprob] | None:
        """The prompt's tokens after the first, with their log-probabilities (``submit(..., prompt_logprobs=k)``);
        None until the first new token comes, or when not asked for."""
        with self._changed:
            return None if self._prompt_logprobs is None else list(self._prompt_logprobs)

    @property
    def finish_reason(self) -> str | None:
        """``"length"`` when it reached ``max_new_tokens`` (or ``max_length``), ``"stop"`` when a stopping
        criterion (EOS, a stop string, ...) ended it first; None until it finishes, or when it failed."""
        with self._changed:
            return self._finish_reason

    def cancel(self) -> None:
        """Ask the batcher to drop this request at its next step boundary; its blocks then go back.

        The handle then ends with `RequestCancelled` (iterating it first yields the tokens it had). Safe from
        any thread, at any moment, any number of times; a no-op once the request is done.
        """
        with self._changed:
            if self._finished or self._cancel_requested:
                return
            self._cancel_requested = True
        self._on_cancel()

    @property
    def cancel_requested(self) -> bool:
        with self._changed:
            return self._cancel_requested and not self._finished

    # ------------------------------------------------------------------ called by what produces the tokens
    # (the batcher's loop; for a server on Ray Serve replicas, the ingress's stream from a replica)

    def _emit(
        self, token: int, logprob: TokenLogprob | None = None, prompt_logprobs: list[TokenLogprob] | None = None
    ) -> None:
        with self._changed:
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()
                self._prompt_logprobs = prompt_logprobs
            self._output.append(token)
            if logprob is not None:
                self._logprobs.append(logprob)
            self._changed.notify_all()

    def _finish(self, error: BaseException | None = None, reason: str | None = None) -> None:
        with self._changed:
            if self._finished:
                return
            if error is None and self._cancel_requested:
                error = RequestCancelled(f"request {self.request_id} was cancelled")
            self.finish_time = time.perf_counter()
            self._error, self._finished = error, True
            self._finish_reason = reason if error is None else None
            self._changed.notify_all()


@dataclass(frozen=True)
class Choice:
    """The token a request picked from one step's logits, and whether it stops there."""

    token: int
    finished: bool
    logprob: TokenLogprob | None = None  # when the request records log-probabilities


@dataclass(frozen=True)
class GreedyStops:
    """How a plain greedy request stops: at `max_length` tokens (prompt and new), or on an id of `eos_ids`."""

    max_length: int
    eos_ids: frozenset[int]

    def stop(self, length: int, token: int) -> bool:
        """Whether a request that reaches `length` tokens by picking `token` stops there (as transformers'
        `MaxLengthCriteria` and `EosTokenCriteria` decide)."""
        return length >= self.max_length or token in self.eos_ids


def greedy_stops(
    config: Any, processors: LogitsProcessorList, criteria: StoppingCriteriaList, logprobs: int | None
) -> GreedyStops | None:
    """`GreedyStops` for a request that picks the first maximum of its raw logits and records nothing else: greedy,
    no logits processor, no log-probabilities, and no stopping criterion but the length and the EOS ids. None
    for any other (sampling, penalties, stop strings, a criterion of the caller's: `Request.pick` runs them)."""
    if config.do_sample or len(processors) or logprobs is not None:
        return None
    max_length, eos_ids = None, frozenset()
    for criterion in criteria:
        if type(criterion) is MaxLengthCriteria:
            max_length = criterion.max_length if max_length is None else min(max_length, criterion.max_length)
        elif type(criterion) is EosTokenCriteria:
            eos_ids |= frozenset(flat_token_ids(criterion.eos_token_id))
        else:
            return None
    return None if max_length is None else GreedyStops(max_length, eos_ids)


class Request:
    """A prompt, its generation settings (transformers' processors and criteria) and what it generated so far.

    Built on the submitting thread: every argument is checked here (`engine.validation`), so a request that
    is queued can only fail later on what no check can see.
    """

    def __init__(
        self,
        request_id: int,
        prompt: Sequence[int],
        model: PreTrainedModel,
        generation_kwargs: dict[str, Any],
        *,
        tokenizer: Any = None,
        context: int | None = None,
        on_cancel: Callable[[], None] = lambda: None,
        encoder: EncoderInput | None = None,
        media: MediaInput | None = None,
    ):
        kwargs = dict(generation_kwargs)
        extras = {name: kwargs.pop(name) for name in REQUEST_ARGUMENTS if name in kwargs}
        self.logprobs = check_logprobs("logprobs", extras.get("logprobs"))
        self.prompt_logprobs_k = check_logprobs("prompt_logprobs", extras.get("prompt_logprobs"))
        config = generation_config_for(model, kwargs)
        if config.max_new_tokens is not None:
            config.max_length = len(prompt) + config.max_new_tokens  # what generate does with max_new_tokens
        check_request(prompt, config, model, context)
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=model.device)
        self.id = request_id
        self.prompt = list(prompt)  # an encoder-decoder model's: the decoder's prompt
        self.encoder = encoder  # an encoder-decoder model's: what its encoder reads (`engine.encoder_inputs`)
        self.media = media  # an image-text model's images (`engine.media`)
        self.config = config
        self.processors: LogitsProcessorList = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=len(prompt), device=model.device,
            prefix_allowed_tokens_fn=extras.get("prefix_allowed_tokens_fn"),
            logits_processor=extras.get("logits_processor") or LogitsProcessorList(),
        )
        # a constraint (a grammar's mask) is asked for its mask before sampling's filters, which could otherwise
        # keep only tokens it bans; the other processors run after it, in their order
        self.constraints: list[Constraint] = [p for p in self.processors if isinstance(p, Constraint)]
        self.processors = LogitsProcessorList(p for p in self.processors if not isinstance(p, Constraint))
        # LogitsProcessorList reads each processor's signature at every call (tens of microseconds a token):
        # processors that take (input_ids, scores) alone are called directly
        self._direct = all(len(inspect.signature(p.__call__).parameters) <= 2 for p in self.processors)
        self.criteria: StoppingCriteriaList = model._get_stopping_criteria(
            generation_config=config, stopping_criteria=extras.get("stopping_criteria") or StoppingCriteriaList(),
            tokenizer=tokenizer,
        )
        plain = not self.constraints
        self.greedy = greedy_stops(config, self.processors, self.criteria, self.logprobs) if plain else None
        self.generator = torch.Generator(device=model.device)
        if extras.get("seed") is not None:
            self.generator.manual_seed(extras["seed"])
        else:
            self.generator.seed()  # a fresh random seed, leaving torch's global generator alone
        self.generated: list[int] = []
        self.prompt_logprobs: list[TokenLogprob] = []  # for prompt tokens 1, 2, ... as far as computed
        self.followers: list[Request] = []  # the other choices of its prompt, until they start decoding
        self.handle = RequestHandle(request_id, on_cancel)

    @property
    def group(self) -> list[Request]:
        """This request and its followers: the choices its prefill serves."""
        return [self, *self.followers]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether its prompt's log-probabilities are asked for and not all computed yet."""
        return self.prompt_logprobs_k is not None and len(self.prompt_logprobs) < len(self.prompt) - 1

    @property
    def takes_cached_prefix(self) -> bool:
        """Whether it starts from the longest prefix the pool has cached: not when its prompt's log-probabilities
        are asked for (cached blocks hold keys and values, not logits), nor with a single token to compute."""
        return len(self.prompt) + len(self.generated) > 1 and not self.needs_prompt_logprobs

    @property
    def finish_reason(self) -> str:
        """Why it stopped: ``"length"`` at its longest (unless its last token is an EOS), else ``"stop"``."""
        eos_ids = set(flat_token_ids(self.config.eos_token_id))
        at_longest = len(self.tokens) >= self.max_length
        return "length" if at_longest and not (self.generated and self.generated[-1] in eos_ids) else "stop"

    @property
    def max_length(self) -> int:
        """Most tokens (prompt and generated) it can reach: ``max_length``, or prompt + ``max_new_tokens``."""
        return self.config.max_length

    @property
    def tokens(self) -> list[int]:
        """Prompt and generated tokens: what its cache must hold to compute the next token."""
        return self.prompt + self.generated

    @property
    def key_tokens(self) -> list[int]:
        """`tokens` as its blocks are keyed by prefix: an image's placeholders stand for the image (`media`)."""
        return self.tokens if self.media is None else [*self.media.key_ids, *self.generated]

    def pick(self, logits: torch.Tensor, after: Sequence[int] = ()) -> Choice:
        """Pick the next token from the last position's `logits` ``[V]``, and whether the request stops there.

        `after`: tokens that come after the request's own before this position (drafts a speculative step
        kept). A speculative step verifies a draft by picking as ever and keeping the draft when the pick is
        that token: a sampled request draws each token with the same one call of its generator whether it
        verifies a draft or not, so a seed gives the same tokens with speculation and without (and the draft is
        kept with probability ``p(draft)``, as speculative sampling's rule would keep it).

        Changes nothing but the request's generator (sampling), which it puts back when it raises: a retry
        draws the same token. Raises `ValueError` when the processed scores have no finite maximum (NaN, or
        every token banned), where ``generate`` would silently pick an arbitrary token.
        """
        state = self.generator.get_state() if self.config.do_sample else None
        try:
            tokens = [*self.tokens, *after]
            ids = torch.tensor([tokens], device=logits.device)  # [1, n]
            scores = logits.unsqueeze(0).float()  # [1, V]
            generated = [*self.generated, *after] if self.constraints else []
            for constraint in self.constraints:
                allowed = constraint.mask(generated, scores.shape[-1]).to(scores.device)  # [V]
                scores = scores + _BIAS.to(scores.device, scores.dtype)[allowed.int()]  # -inf banned, 0 allowed
            if self._direct:
                for processor in self.processors:
                    scores = processor(ids, scores)
            else:
                scores = self.processors(ids, scores)
            if not math.isfinite(float(scores.max())):
                raise ValueError(
                    f"request {self.id}: its logits processors left no finite score (NaN or every token banned); "
                    f"check temperature={self.config.temperature}, bad_words_ids and suppress_tokens"
                )
            if self.config.do_sample:
                token = int(torch.multinomial(torch.softmax(scores, dim=-1)[0], 1, generator=self.generator))
            else:
                token = int(scores.argmax(dim=-1))
            full = torch.cat([ids, ids.new_tensor([[token]])], dim=1)  # [1, n + 1]
            logprob = None if self.logprobs is None else token_logprobs(logits.unsqueeze(0), [token], self.logprobs)[0]
            finished = bool(self.criteria(full, scores).any())
            finished = finished or any(c.is_complete([*generated, token]) for c in self.constraints)
            return Choice(token, finished, logprob)
        except BaseException:
            if state is not None:
                self.generator.set_state(state)
            raise

    def greedy_choice(self, token: int, after: int = 0) -> Choice:
        """What `pick` returns for a plain greedy request (`greedy` set) whose logits' first maximum, finite, is
        `token`, `after` tokens past its own (drafts a speculative step kept): that token, and whether it
        stops the request."""
        return Choice(token, self.greedy.stop(len(self.prompt) + len(self.generated) + after + 1, token))

    def accept(self, choice: Choice) -> None:
        """Add a picked token to the request and stream it to its handle (once its step is kept)."""
        self.generated.append(choice.token)
        first = len(self.generated) == 1  # the handle takes the prompt's log-probabilities with the first token
        prompt = list(self.prompt_logprobs) if first and self.prompt_logprobs_k is not None else None
        self.handle._emit(choice.token, choice.logprob, prompt)

    def add_prompt_logprobs(self, computed: Sequence[TokenLogprob], first: int) -> None:
        """Record the log-probabilities of prompt tokens ``first, first + 1, ...`` (those not recorded yet)."""
        have = len(self.prompt_logprobs) + 1  # the index of the next prompt token without one
        if first > have:
            raise RuntimeError(f"request {self.id}: prompt log-probabilities from token {first}, but {have} is missing")
        self.prompt_logprobs.extend(computed[have - first :])

    def prompt_targets(self, start: int, length: int) -> tuple[int, list[int]]:
        """For a chunk of `length` tokens from `start`: the first prompt index whose log-probability its logits
        give (position ``p`` predicts token ``p + 1``) and those prompt tokens (none past the prompt)."""
        first = start + 1
        return first, self.prompt[first : min(start + length + 1, len(self.prompt))]
