"""`EngineClient`: the batcher as the HTTP handlers need it, knowing nothing of HTTP.

It tokenizes prompts, renders chat templates, turns OpenAI's sampling settings into the batcher's (transformers'
`GenerationConfig` fields, stop tokens, the presence and frequency penalties) and submits a request's prompts,
the `n` choices of each with `ContinuousBatcher.submit_group` (which prefills the prompt once). What comes back
is a `Generation`: the choices' tokens as one async stream of text and log-probabilities.

A prompt may come with inputs besides its tokens (`generate`'s ``inputs``): an image model's pixels
(`vision`). On an encoder-decoder model (`Submitter.decoder_prompt` set), a prompt is what the encoder reads
and the decoder starts from its own prompt; a request whose encoder reads features (Whisper's:
`transcription`) passes them as its inputs, its prompt then being the decoder's.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from jinja2 import TemplateError
from transformers import LogitsProcessorList

from ...engine.batcher import ContinuousBatcher
from ...engine.request import RequestHandle
from ...engine.validation import flat_token_ids
from ...structured import CompiledGrammar, GrammarError, GrammarLogitsProcessor, Grammars, GrammarSpec
from .detokenize import IncrementalDetokenizer
from .generation import ChoiceStream, Generation
from .metrics import ServerMetrics
from .penalties import PresenceFrequencyPenalty
from .stop_strings import StopStringMatcher


@dataclass(frozen=True)
class GenerationOptions:
    """What to generate for each prompt, in OpenAI's terms (checked by the caller)."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None  # None, 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # alternatives to report for each new token (None: no logprobs)
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    grammar: CompiledGrammar | None = None  # what the answer must match (structured outputs)


class Submitter(Protocol):
    """What `EngineClient` runs requests on: a `ContinuousBatcher`, or the replicas of one
    (`hf_paged_cache.server.ray.ReplicaClient`)."""

    context: int | None  # the model's max_position_embeddings (an encoder-decoder model's decoder's)
    vocab_size: int  # a prompt's ids are below it
    eos_token_ids: tuple[int, ...]  # the model's generation config's
    decoder_prompt: tuple[int, ...] | None  # an encoder-decoder model's decoder start; None for a decoder-only one

    def submit(self, input_ids: Sequence[int] | None, **generation_kwargs: Any) -> RequestHandle: ...

    def submit_group(
        self, input_ids: Sequence[int] | None, n: int, **generation_kwargs: Any
    ) -> list[RequestHandle]: ...

    def close(self, timeout: float = 0.0) -> None: ...


class EngineClient:
    """Tokenizer and batcher behind one interface for the server's handlers.

    Args:
        batcher: what runs every request: a `ContinuousBatcher` (a `Submitter`; this client closes it in `close`).
        tokenizer: its model's tokenizer.
        max_model_len: the most positions a prompt and its answer may take (capped by the model's own).
        chat_template: a Jinja chat template to use instead of the tokenizer's.
        metrics: where each finished request is counted (None: nowhere).
    """

    def __init__(
        self, batcher: Submitter, tokenizer: Any, *, max_model_len: int | None = None,
        chat_template: str | None = None, metrics: ServerMetrics | None = None,
    ):
        self.batcher = batcher
        self.tokenizer = tokenizer
        limits = [limit for limit in (max_model_len, batcher.context) if limit is not None]
        if not limits:
            raise ValueError("the model has no max_position_embeddings: pass max_model_len")
        self.max_model_len = min(limits)
        self.vocab_size = batcher.vocab_size
        self.decoder_prompt = getattr(batcher, "decoder_prompt", None)
        self.transcriber: Any = None  # a speech model's `transcription.Transcriber` (set by the server)
        self.images: Any = None  # an image-text model's `vision.ImagePrompts` (set by the server)
        self.chat_template = chat_template
        self.metrics = metrics
        # a request stops at the model's EOS ids and the tokenizer's (as vLLM does), unless it says ignore_eos
        ids = [*batcher.eos_token_ids, *flat_token_ids(tokenizer.eos_token_id)]
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(ids))
        self.token_text = functools.lru_cache(maxsize=65536)(self._token_text)
        self._grammars: Grammars | None = None  # made on the first constrained request (reads the whole vocabulary)
        self._grammars_lock = threading.Lock()

    # ------------------------------------------------------------------ text

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _token_text(self, token: int) -> str:
        """One token's own text, special tokens included (how logprobs name it)."""
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def render_chat(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> str:
        """`messages` (and `tools`, OpenAI's tool objects) through the chat template (`ValueError` when there is
        none, or it refuses them)."""
        if self.chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template; start the server with --chat-template FILE")
        try:
            return self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt, tools=tools,
            )
        except TemplateError as error:
            raise ValueError(f"the chat template refused the messages: {error}") from error

    def compile_grammar(self, spec: GrammarSpec) -> CompiledGrammar:
        """`spec` compiled for the model's tokenizer (cached by spec); `GrammarError` names what is wrong, or
        that the batcher runs elsewhere (Ray Serve replicas, which a compiled grammar cannot be sent to)."""
        if not isinstance(self.batcher, ContinuousBatcher):
            raise GrammarError("structured outputs and tool_choice required/named need the engine in this "
                               "process: not available with --ray replicas")
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.vocab_size, list(self.eos_token_ids))
        return self._grammars.compile(spec)

    # ------------------------------------------------------------------ generation

    def generate(
        self, prompts: Sequence[Sequence[int]], options: GenerationOptions, *,
        inputs: Sequence[dict[str, Any]] | None = None,
    ) -> Generation:
        """Submit every prompt with its `options.n` choices; returns at once. `inputs`: each prompt's
        `ContinuousBatcher.submit` arguments besides its tokens (``multimodal_inputs`` and ``image_digests``;
        ``input_features``, with which the prompt is the decoder's).

        Raises what `submit` raises (`ValueError` for a value the batcher refuses, `QueueFullError`,
        `RuntimeError` once closed) after cancelling what it had submitted. Must be called on the event loop
        that will read the `Generation`.
        """
        loop = asyncio.get_running_loop()
        groups: list[list[RequestHandle]] = []
        submitted_at = time.perf_counter()
        own = list(inputs) if inputs is not None else [{}] * len(prompts)
        decoders = [self._decoder_prompt(prompt, "input_features" in extra) for prompt, extra in zip(prompts, own)]
        try:
            for prompt, decoder, extra in zip(prompts, decoders, own):
                kwargs = {**self._submit_kwargs(len(decoder), options), **extra}
                source = list(prompt)
                if "input_features" in extra:  # the encoder reads features: the prompt is the decoder's
                    source, kwargs["decoder_input_ids"] = None, decoder
                if options.n == 1:
                    groups.append([self.batcher.submit(source, **kwargs)])
                else:
                    groups.append(self.batcher.submit_group(source, options.n, **kwargs))
        except BaseException:
            for handles in groups:
                for handle in handles:
                    handle.cancel()
            raise
        stop_ids = frozenset(options.stop_token_ids) | frozenset(() if options.ignore_eos else self.eos_token_ids)
        choices = [
            ChoiceStream(
                index=p * options.n + j, prompt_index=p, prompt_length=len(prompt), handle=handle,
                detokenizer=IncrementalDetokenizer(self.tokenizer, decoder),
                matcher=StopStringMatcher(options.stop),
                stop_ids=stop_ids,
                logprobs=options.logprobs is not None, prompt_logprobs=options.prompt_logprobs is not None,
                first_of_prompt=j == 0,
            )
            for p, (prompt, decoder, handles) in enumerate(zip(prompts, decoders, groups))
            for j, handle in enumerate(handles)
        ]
        return Generation(loop, choices, submitted_at, self.metrics)

    def _decoder_prompt(self, prompt: Sequence[int], is_decoders: bool) -> list[int]:
        """The tokens `prompt`'s answer follows in the decoder: itself, unless it is an encoder-decoder model's
        encoder input (`is_decoders` False), whose answer follows the decoder's start."""
        if self.decoder_prompt is None or is_decoders:
            return list(prompt)
        return list(self.decoder_prompt)

    def _submit_kwargs(self, prompt_length: int, options: GenerationOptions) -> dict[str, Any]:
        """`options` as `submit` arguments: transformers' sampling settings, stop tokens and processors."""
        kwargs: dict[str, Any] = {"max_new_tokens": options.max_tokens}
        if options.temperature == 0:
            kwargs["do_sample"] = False
        else:
            kwargs.update(do_sample=True, temperature=options.temperature, top_p=options.top_p or 1.0,
                          top_k=max(options.top_k or 0, 0))
            if options.min_p:
                kwargs["min_p"] = options.min_p
        if options.repetition_penalty is not None:
            kwargs["repetition_penalty"] = options.repetition_penalty
        eos = () if options.ignore_eos else self.eos_token_ids
        kwargs["eos_token_id"] = list(dict.fromkeys([*eos, *options.stop_token_ids])) or None
        processors = LogitsProcessorList()
        if options.presence_penalty or options.frequency_penalty:
            processors.append(PresenceFrequencyPenalty(prompt_length, options.presence_penalty,
                                                       options.frequency_penalty))
        if options.grammar is not None:
            on_mask = None if self.metrics is None else self.metrics.grammar_mask_seconds.observe
            # the engine ends the row when the grammar is complete (`Constraint.is_complete`): no GrammarStop
            processors.append(GrammarLogitsProcessor(options.grammar, prompt_length, on_mask))
        if processors:
            kwargs["logits_processor"] = processors
        if options.seed is not None:
            kwargs["seed"] = options.seed
        if options.logprobs is not None:
            kwargs["logprobs"] = options.logprobs
        if options.prompt_logprobs is not None:
            kwargs["prompt_logprobs"] = options.prompt_logprobs
        return kwargs

    def close(self, timeout: float = 0.0) -> None:
        """Refuse new requests, let those in flight finish for `timeout` seconds, then stop the batcher."""
        self.batcher.close(timeout=timeout)
