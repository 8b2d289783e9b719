"""Structured outputs: a request's answer held to a JSON Schema, a regular expression, a choice or a grammar.

`Grammars` compiles a `GrammarSpec` for a tokenizer (llguidance does the work) and caches it; a
`GrammarLogitsProcessor` bans the tokens the grammar does not allow, and `GrammarStop` ends the answer when the
grammar is complete. Both work in ``model.generate`` and in the batcher's requests (docs/structured-outputs.md).
"""

from .grammars import KINDS, CompiledGrammar, GrammarError, Grammars, GrammarSpec
from .processor import GrammarLogitsProcessor, GrammarStop, grammar_constraint

__all__ = [
    "KINDS", "CompiledGrammar", "GrammarError", "GrammarLogitsProcessor", "GrammarSpec", "GrammarStop", "Grammars",
    "grammar_constraint",
]
