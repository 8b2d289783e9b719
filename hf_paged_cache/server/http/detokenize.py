"""Turning a growing list of token ids into text, piece by piece, each piece final once released.

Decoding one token at a time is wrong for most tokenizers: SentencePiece drops a word's leading space when
the word is decoded alone, and byte-level BPE splits one character over several tokens. So, as vLLM and TGI
do, `IncrementalDetokenizer` decodes a short window of recent tokens with and without the new ones and
releases the difference, once it does not end in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 6
"""Prompt tokens decoded before the first new one, so that it decodes as it would after the prompt."""


class IncrementalDetokenizer:
    """The text of tokens added one by one, skipping special tokens.

    Args:
        tokenizer: a transformers tokenizer.
        context: the ids just before the first token to add (the prompt's last few); their text is not
            released, it only makes the first new token decode as it does after them.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.ids = list(context)[-CONTEXT_TOKENS:]
        self.prefix_offset = 0  # the window decoded to find what is new starts here
        self.read_offset = len(self.ids)  # text of the tokens before this is released

    def add(self, token: int) -> str:
        """Add one token; the text that is now final (often the token's own, "" while a character is incomplete)."""
        self.ids.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """The text held back at the end (an incomplete character), once no token will follow."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self._decode(self.ids[self.prefix_offset:self.read_offset])
        after = self._decode(self.ids[self.prefix_offset:])
        if len(after) <= len(before) or (after.endswith(INCOMPLETE) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
