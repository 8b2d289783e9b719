"""Grammars a request can be held to, compiled once per tokenizer and spec by llguidance.

A `GrammarSpec` says what the output must be: a JSON Schema (``json_schema``), any JSON object (``json_object``),
a regular expression (``regex``), one of some strings (``choice``) or a Lark grammar (``lark``: llguidance's
dialect of EBNF, https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md). `Grammars.compile` turns it
into a `CompiledGrammar` checked against the tokenizer (an error names what the engine could not take), and caches
it by spec, so a schema sent again is not compiled again.

Why llguidance (docs/structured-outputs.md has the numbers): it computes one row's mask in about 0.1 ms on
SmolLM2's 49,152-token vocabulary after a compile of about 1 ms, takes JSON Schema, regular expressions and
context-free grammars, can roll a matcher back, and installs as one 8 MB wheel with no dependencies.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import llguidance.hf

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "lark")
ANY_JSON_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """A spec the grammar engine cannot compile (the message names what it refused)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match.

    Attributes:
        kind: one of `KINDS`.
        source: the JSON Schema as JSON text (``json_schema``), the regular expression (``regex``), the Lark
            grammar (``lark``), the choices as a JSON list (``choice``), or "" (``json_object``).
    """

    kind: GrammarKind
    source: str = ""

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str) -> GrammarSpec:
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> GrammarSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> GrammarSpec:
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        return cls("lark", grammar)

    def engine_grammar(self) -> str:
        """The spec as llguidance's grammar text (`GrammarError` when it is malformed before compiling)."""
        if self.kind == "json_schema":
            try:
                schema = json.loads(self.source)
            except json.JSONDecodeError as error:
                raise GrammarError(f"the JSON schema is not JSON: {error}") from error
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            choices = json.loads(self.source)
            if not choices or not all(isinstance(choice, str) and choice for choice in choices):
                raise GrammarError("choice must be a non-empty list of non-empty strings")
            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(choice) for choice in choices))
        if self.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(self.source)
        raise GrammarError(f"unknown grammar kind {self.kind!r}; expected one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class CompiledGrammar:
    """A spec checked against a tokenizer: what a `GrammarLogitsProcessor` makes its matchers from."""

    spec: GrammarSpec
    grammar: str  # llguidance's grammar text
    tokenizer: llguidance.LLTokenizer

    def matcher(self) -> llguidance.LLMatcher:
        return llguidance.LLMatcher(self.tokenizer, self.grammar)


class Grammars:
    """Compiles `GrammarSpec`s for one tokenizer, keeping the last `cache_size` compiled (by spec).

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits (at least the tokenizer's length; ids past the tokenizer are
            never allowed).
        eos_token_ids: the ids that end an answer once the grammar is complete (default: the tokenizer's EOS).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None, eos_token_ids: list[int] | None = None,
                 cache_size: int = 256):
        self.tokenizer = engine_tokenizer(tokenizer, vocab_size, eos_token_ids)
        self.cache_size = cache_size
        self._compiled: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()  # handlers compile on several threads
        self.compiled = 0  # specs compiled so far (cache misses)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """`spec` compiled for this tokenizer (from the cache when it was compiled before); `GrammarError` when
        the engine refuses it, with the engine's reason."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return self._compiled[spec]
        try:
            grammar = spec.engine_grammar()
        except GrammarError:
            raise
        except (ValueError, TypeError, RuntimeError) as error:
            raise GrammarError(f"the {spec.kind} grammar does not compile: {error}") from error
        message = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if message:
            raise GrammarError(f"the {spec.kind} grammar does not compile: {message}")
        compiled = CompiledGrammar(spec, grammar, self.tokenizer)
        matcher = compiled.matcher()
        if matcher.is_error():
            raise GrammarError(f"the {spec.kind} grammar does not compile: {matcher.get_error()}")
        with self._lock:
            self._compiled[spec] = compiled
            self.compiled += 1
            while len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return compiled


def engine_tokenizer(tokenizer: Any, vocab_size: int | None = None,
                     eos_token_ids: list[int] | None = None) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face tokenizer, `vocab_size` tokens wide.

    A fast tokenizer whose decoder llguidance knows is read from its JSON; any other (a character tokenizer, say)
    is described token by token: each id's text as bytes, special tokens marked as such.
    """
    eos = eos_token_ids or tokenizer.eos_token_id
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        return llguidance.LLTokenizer(_TokenByToken(tokenizer), n_vocab=vocab_size, eos_token=eos)


class _TokenByToken:
    """A tokenizer as llguidance's `TokenizerWrapper` protocol reads it: every token's bytes, and encoding."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(set(tokenizer.all_special_ids))
        special = set(self.special_token_ids)
        self.tokens = [
            (b"\xff" if token in special else b"") + tokenizer.decode([token], clean_up_tokenization_spaces=False)
            .encode("utf-8") for token in range(len(tokenizer))
        ]
        self.is_tokenizer_wrapper = True

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer(text, add_special_tokens=False).input_ids)
