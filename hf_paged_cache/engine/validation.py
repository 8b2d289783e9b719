"""What `ContinuousBatcher.submit` checks before a request is queued: every argument that could fail later.

A request that would fail in the middle of a step (an id outside the vocabulary, a temperature whose
reciprocal overflows, a prompt running past the position table) is refused here with a `ValueError` that
names the argument, so it never reaches a step it shares with other requests. Arguments the batcher cannot
honour (beam search, several return sequences, assisted decoding, per-step scores...) are refused too,
never silently ignored. Anything that still fails later fails that request alone (`engine.executor`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation.configuration_utils import GenerationMode

SUPPORTED_MODES = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)

REQUEST_ARGUMENTS = (
    "seed", "logprobs", "prompt_logprobs", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
)
"""`submit` arguments that are neither `GenerationConfig` fields nor ``generation_config`` (which
`generation_config_for` takes); the last three as `generate` takes them."""

UNSUPPORTED_ARGUMENTS = {
    "assistant_model": "assisted decoding needs a draft model beside each request",
    "assistant_tokenizer": "assisted decoding needs a draft model beside each request",
    "streamer": "iterate the RequestHandle instead: it streams tokens as they come",
    "negative_prompt_ids": "classifier-free guidance needs a second forward per step",
    "negative_prompt_attention_mask": "classifier-free guidance needs a second forward per step",
    "custom_generate": "the batcher runs its own decoding loop",
    "synced_gpus": "the batcher runs on one process",
    "attention_mask": "a request is one unpadded prompt",
    "position_ids": "each request's positions are its token indices",
    "inputs_embeds": "a request is token ids",
    "cache": "the batcher keeps every request's cache in its own pool",
    "past_key_values": "the batcher keeps every request's cache in its own pool",
}
"""`generate` arguments the batcher refuses, with why."""

DEFAULTS_ONLY = {
    "num_return_sequences": (1, "submit the prompt once per sequence (with its own seed)"),
    "output_scores": (False, "the batcher returns tokens only"),
    "output_logits": (False, "the batcher returns tokens only"),
    "output_attentions": (False, "the batcher returns tokens only"),
    "output_hidden_states": (False, "the batcher returns tokens only"),
    "return_dict_in_generate": (False, "the batcher returns tokens only"),
    "use_cache": (True, "the batcher always caches"),
    "cache_implementation": (None, "the batcher's caches are paged"),
    "guidance_scale": (1.0, "classifier-free guidance needs a second forward per step"),
    "token_healing": (False, "token healing rewrites the prompt"),
    "prefill_chunk_size": (None, "the batcher chunks prompts itself (max_step_tokens)"),
}
"""`GenerationConfig` fields the batcher can only run at one value (None is always fine), with why."""


def generation_config_for(model: PreTrainedModel, kwargs: dict[str, Any]) -> GenerationConfig:
    """The request's `GenerationConfig`, resolved as `generate` resolves it (its arguments, then the model's
    generation config, then transformers' defaults). `kwargs` holds `GenerationConfig` fields and, optionally,
    a ``generation_config`` to start from.

    Raises `ValueError` for an argument or decoding mode the batcher cannot run, `TypeError` for an unknown one.
    """
    refused = sorted(set(kwargs) & set(UNSUPPORTED_ARGUMENTS))
    if refused:
        name = refused[0]
        raise ValueError(f"the continuous batcher does not take {name}= ({UNSUPPORTED_ARGUMENTS[name]}); use generate()")
    base = kwargs.pop("generation_config", None)
    config, unknown = model._prepare_generation_config(base, **kwargs)
    if unknown:
        raise TypeError(f"unknown generation argument(s) {sorted(unknown)} (GenerationConfig has no such field)")
    config.validate()
    mode = config.get_generation_mode()
    if mode not in SUPPORTED_MODES:
        raise ValueError(
            f"the continuous batcher does greedy search and sampling, not {mode.value} (set by num_beams="
            f"{config.num_beams}, penalty_alpha={config.penalty_alpha}, prompt_lookup_num_tokens="
            f"{config.prompt_lookup_num_tokens}, dola_layers={config.dola_layers}, ...); use generate()"
        )
    for name, (allowed, why) in DEFAULTS_ONLY.items():
        value = getattr(config, name, None)
        if value is not None and value != allowed:
            raise ValueError(f"the continuous batcher does not do {name}={value!r} ({why}); use generate()")
    return config


def check_request(prompt: Sequence[int], config: GenerationConfig, model: PreTrainedModel, context: int | None) -> None:
    """Raise `ValueError` naming the argument if `prompt` with `config` could fail in a step.

    `config.max_length` must already count the prompt (``len(prompt) + max_new_tokens``).
    """
    input_vocab = model.get_input_embeddings().num_embeddings
    bad = [t for t in prompt if not 0 <= t < input_vocab]
    if bad:
        raise ValueError(f"input_ids: token id {bad[0]} is outside the model's vocabulary of {input_vocab}")
    if config.max_length <= len(prompt):
        raise ValueError(
            f"max_length={config.max_length} leaves nothing to generate after a prompt of {len(prompt)} tokens; "
            "pass max_new_tokens"
        )
    if context is not None and config.max_length > context:
        raise ValueError(
            f"the prompt's {len(prompt)} tokens and max_new_tokens={config.max_length - len(prompt)} make "
            f"{config.max_length} positions, past the model's {context} (max_position_embeddings)"
        )
    _check_token_ids(config, _output_vocab(model))
    _check_numbers(config)


def _output_vocab(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    return weight.shape[0] if weight is not None else model.config.get_text_config(decoder=True).vocab_size


def _check_token_ids(config: GenerationConfig, vocab: int) -> None:
    bias = config.sequence_bias
    bias_ids = bias.keys() if isinstance(bias, dict) else [ids for ids, _ in bias or []]
    for name, value in (
        ("eos_token_id", config.eos_token_id),
        ("forced_bos_token_id", config.forced_bos_token_id),
        ("forced_eos_token_id", config.forced_eos_token_id),
        ("suppress_tokens", config.suppress_tokens),
        ("begin_suppress_tokens", config.begin_suppress_tokens),
        ("bad_words_ids", config.bad_words_ids),
        ("sequence_bias", list(bias_ids)),
    ):
        for token in flat_token_ids(value):
            if not 0 <= token < vocab:
                raise ValueError(f"{name}: token id {token} is outside the model's vocabulary of {vocab}")


def flat_token_ids(value: object) -> list[int]:
    """Every token id in an int, a (nested) list or tuple of them, or a tensor; nothing for None."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return value.reshape(-1).tolist()
    if isinstance(value, (list, tuple)):
        return [token for item in value for token in flat_token_ids(item)]
    return [int(value)]


def _check_numbers(config: GenerationConfig) -> None:
    _require(config.repetition_penalty, "repetition_penalty", lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
    _require(config.no_repeat_ngram_size, "no_repeat_ngram_size", lambda v: v >= 0, "an integer >= 0")
    _require(config.min_new_tokens, "min_new_tokens", lambda v: v >= 0, "an integer >= 0")
    if not config.do_sample:
        return  # the sampling settings below are not used (transformers warns about them)
    largest = torch.finfo(torch.float32).max
    _require(
        config.temperature, "temperature", lambda v: math.isfinite(v) and v > 0 and 1 / v <= largest,
        f"a finite number > 0 whose reciprocal fits float32 (>= {1 / largest:.1e})",
    )
    _require(config.top_k, "top_k", lambda v: v >= 0, "an integer >= 0")
    _require(config.top_p, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    _require(config.min_p, "min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
    _require(config.typical_p, "typical_p", lambda v: 0 < v <= 1, "in (0, 1]")
    _require(config.epsilon_cutoff, "epsilon_cutoff", lambda v: 0 <= v < 1, "in [0, 1)")
    _require(config.eta_cutoff, "eta_cutoff", lambda v: 0 <= v < 1, "in [0, 1)")


def _require(value: Any, name: str, ok: Any, what: str) -> None:
    if value is None:
        return
    try:
        fine = bool(ok(value))
    except TypeError:
        fine = False
    if not fine:
        raise ValueError(f"{name} must be {what}, got {value!r}")
