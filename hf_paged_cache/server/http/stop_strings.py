"""Stop strings on streamed text: the text is cut before the first one, and never streamed past it.

transformers' ``stop_strings`` stop a request at the token that completes one, but leave it in the text;
OpenAI's ``stop`` cuts the text before it. `StopStringMatcher` does the cutting on the text as it comes, and
holds back any tail that may be the start of a stop string, so that streamed pieces join to exactly the
text a non-streamed request returns.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Text fed piece by piece, released up to the first stop string (excluded) and never beyond it."""

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self.longest = max((len(stop) for stop in self.stops), default=0)
        self.text = ""  # everything fed, cut at the stop string once one is found
        self.released = 0  # characters of `text` released so far
        self.stopped = False

    def feed(self, piece: str) -> str:
        """Add `piece`; the text that is now safe to release (`stopped` tells whether a stop string was found)."""
        if self.stopped or not piece:
            return ""
        start = max(0, len(self.text) - self.longest + 1)  # a stop string may begin in the earlier text
        self.text += piece
        found = [index for stop in self.stops if (index := self.text.find(stop, start)) >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self._release(len(self.text))
        return self._release(len(self.text) - self._partial_stop_length())

    def flush(self) -> str:
        """The text held back, once no more will come (it was not the start of a stop string after all)."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        piece = self.text[self.released:end]
        self.released = max(self.released, end)
        return piece

    def _partial_stop_length(self) -> int:
        """Length of the longest unreleased tail of the text that begins some stop string."""
        for length in range(min(self.longest - 1, len(self.text) - self.released), 0, -1):
            tail = self.text[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
