"""Speculative decoding: draft tokens proposed for a row (`proposers`: n-gram lookup in its own tokens, or a
smaller model, `draft_model`), how far each engine step drafts (`speculator`), and which drafts a step keeps
(`verification`). Nothing here knows the engine: a row is anything with its tokens so far (`DraftRow`)."""

from .draft_model import DraftModel
from .proposers import DraftRow, DraftSource, NgramDrafts, OwnTokens, Proposer
from .speculator import DEFAULT_SPECULATIVE_TOKENS, Drafts, SpeculationStats, Speculator
from .verification import kept_picks

__all__ = [
    "DEFAULT_SPECULATIVE_TOKENS", "DraftModel", "DraftRow", "DraftSource", "Drafts", "NgramDrafts", "OwnTokens",
    "Proposer", "SpeculationStats", "Speculator", "kept_picks",
]
