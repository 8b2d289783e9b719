"""`MaskPrefetch`: the grammar masks a batcher step will ask for, filled while its forward runs.

A constrained row's mask depends only on the tokens it has so far, which are known before the step's forward
starts. `MaskPrefetch.start` takes each such row's processor lock (`GrammarLogitsProcessor.lock`) on the
calling thread, then, on a thread of its own, brings each row's matcher to its tokens and fills every row's
mask in one call of llguidance's parallel fill (``fill_next_token_bitmask_par``, which releases the GIL while
it works), stores each with its processor (`GrammarLogitsProcessor.prefetched`) and releases the locks. The
forward runs meanwhile; a token choice that asks a processor for its mask waits on the lock, then takes the
stored one. Nothing depends on the prefetch: a mask it did not store (a failure, tokens the call does not
ask for) is filled by the call as before.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import llguidance
import llguidance.numpy
import numpy

logger = logging.getLogger(__name__)


class GrammarLogitsProcessor(Protocol):
    """What the prefetch uses of `hf_paged_cache.structured.processor.GrammarLogitsProcessor` (which names this
    class as its `mask_filler`, so this module does not import it)."""

    grammar: Any  # a `CompiledGrammar`: its tokenizer's vocabulary size is the mask's width
    lock: threading.Lock

    def _matcher_for(self, tokens: Sequence[int]) -> Any: ...

    def prefetched(self, tokens: Sequence[int], words: numpy.ndarray) -> None: ...


class MaskPrefetch:
    """Fills a step's masks ahead of its token choices, on one thread of its own."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        self._executor = llguidance.LLExecutor()
        self._pending: Future | None = None

    def start(self, rows: Sequence[tuple[GrammarLogitsProcessor, Sequence[int]]]) -> None:
        """Fill the mask of each ``(processor, generated tokens)`` of `rows`, starting now on the thread."""
        self.wait()
        if not rows:
            return
        processors = list({id(processor): processor for processor, _ in rows}.values())
        for processor in processors:  # taken here: no token choice can use a matcher before it is done
            processor.lock.acquire()
        try:
            self._pending = self._thread.submit(self._fill, [(p, list(tokens)) for p, tokens in rows], processors)
        except BaseException:
            for processor in processors:
                processor.lock.release()
            raise

    def wait(self) -> None:
        """Until the prefetch in flight (if any) has ended."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        self._thread.shutdown()

    def _fill(self, rows: list[tuple[GrammarLogitsProcessor, list[int]]],
              processors: list[GrammarLogitsProcessor]) -> None:
        """Fill and store every row's mask, then let go of the processors' locks (taken by `start`).

        A processor with one row has its mask filled with the other such processors' in one parallel call. A
        processor with several rows (the choices of one prompt) may move one matcher from row to row, so each of
        those is filled on its own, before the next row's matcher is found.
        """
        try:
            counts = Counter(id(processor) for processor, _ in rows)
            by_width: dict[int, list[tuple[GrammarLogitsProcessor, list[int], llguidance.LLMatcher]]] = {}
            for processor, tokens in rows:
                matcher = processor._matcher_for(tokens)  # the lock is held for it
                if matcher is None or matcher.engine.is_stopped():
                    continue
                width = processor.grammar.tokenizer.vocab_size
                if counts[id(processor)] > 1:
                    self._fill_rows(width, [(processor, tokens, matcher.engine)])
                else:
                    by_width.setdefault(width, []).append((processor, tokens, matcher.engine))
            for width, entries in by_width.items():
                self._fill_rows(width, entries)
        except Exception:  # noqa: BLE001 (an optimisation: each call fills its own mask)
            logger.debug("prefetching grammar masks failed", exc_info=True)
        finally:
            for processor in processors:
                processor.lock.release()

    def _fill_rows(self, width: int, entries: list[tuple[GrammarLogitsProcessor, list[int], llguidance.LLMatcher]]
                   ) -> None:
        """Fill the masks of `entries` (distinct matchers) in one parallel call and store each with its processor."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(entries), width)  # [rows, W / 32]
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(engine, row) for row, (_, _, engine) in enumerate(entries)], bitmask)
        for row, (processor, tokens, _) in enumerate(entries):
            processor.prefetched(tokens, bitmask[row])
