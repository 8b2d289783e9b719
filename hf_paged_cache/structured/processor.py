"""`GrammarLogitsProcessor`: a grammar's token mask as a transformers logits processor, and `GrammarStop`.

The processor holds no per-request state that a caller must keep in step: a matcher's state is a function of
the tokens it consumed, so on each call it finds (or makes) a matcher that has consumed exactly the row's
generated tokens (advancing one by the tokens it lacks, or rolling one back by those it has too many) and
computes the mask from it. Nothing it does depends on how often it is called: a token choice that is tried
again, a step that is dropped, a request preempted and recomputed, or the several choices of one prompt
(which share their processors) all see the mask of their own tokens. The same object works in
``model.generate(..., logits_processor=[...])``, where each row of the batch is one answer.

The bitmask is unpacked with plain tensor ops rather than llguidance's ``apply_token_bitmask_inplace``, which is
a ``torch.compile`` kernel (seconds of compiling on its first call, and a C compiler on the machine), and
``llguidance.torch`` is never imported (it compiles that kernel at import, which loads inductor into every
server): the mask is filled through ``llguidance.numpy`` and the bits
unpacked by numpy index a two-entry table of biases (-inf, 0) added to the scores, branch-free, about 60 us on a
49,152-token row where a masked fill takes 250 us.

The mask must come before sampling's filters (top-k, top-p, min-p), or they may leave nothing the grammar
allows: in ``generate`` the processor says so with ``runs_first``; the engine asks for the mask itself first.

To the engine the processor is a `Constraint` (`hf_paged_cache.engine.constraints`, matched by shape: this
module imports nothing of the engine): `mask` for a row's tokens, `follow` to the tokens a step kept,
`is_complete`, and `mask_filler`: the batcher fills the masks its step will ask for ahead of time, while the
forward runs (`MaskPrefetch`, `hf_paged_cache.structured.mask_prefetch`): `prefetched` stores one, which the call
for the same tokens takes instead of filling it again. A processor's lock (`lock`) makes that safe: whoever
holds it owns its matchers.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import llguidance.numpy
import numpy
import torch
from transformers import LogitsProcessor, StoppingCriteria

from .grammars import CompiledGrammar
from .mask_prefetch import MaskPrefetch

_BIAS = torch.tensor([-torch.inf, 0.0])  # added to a score: banned (bit 0), allowed (bit 1)
MAX_MATCHERS = 64  # matchers kept per processor: the rows (or choices) it serves, and spares


class _Matcher:
    """An llguidance matcher and the tokens it has consumed (its state is a function of them)."""

    def __init__(self, grammar: CompiledGrammar):
        self.engine = grammar.matcher()
        self.consumed: list[int] = []
        self.used = 0  # when the processor last used it (its call count), for eviction

    def follow(self, tokens: list[int]) -> bool:
        """Bring it to having consumed exactly `tokens` (it consumed a prefix of them, or they are a prefix of what
        it consumed); False when it cannot (they leave the grammar, or the rollback is refused)."""
        if len(self.consumed) > len(tokens):
            if not self.engine.rollback(len(self.consumed) - len(tokens)):
                return False  # past what it can undo (or after an error): the caller starts a fresh one
            del self.consumed[len(tokens):]
        for token in tokens[len(self.consumed):]:
            if not self.engine.consume_token(token):
                return False
            self.consumed.append(token)
        return not self.engine.is_error()


class GrammarLogitsProcessor(LogitsProcessor):
    """Bans every token the grammar does not allow after the row's generated tokens.

    Args:
        grammar: from `Grammars.compile`.
        prompt_length: where generated tokens start in the ``input_ids`` it is given (None: the length of the
            first ``input_ids`` it sees, as in ``generate``, whose first call is on the prompt alone).
        on_mask: called with the seconds each mask took (metrics), if given.
    """

    runs_first = True  # before temperature, top-k, top-p and min-p (in `generate`; the engine masks first)
    mask_filler = MaskPrefetch  # fills many rows' masks at once, while a step's forward runs (the engine's)

    def __init__(self, grammar: CompiledGrammar, prompt_length: int | None = None,
                 on_mask: Callable[[float], None] | None = None):
        self.grammar = grammar
        self.prompt_length = prompt_length
        self.on_mask = on_mask
        self._matchers: list[_Matcher] = []
        self._calls = 0
        self._bitmask = llguidance.numpy.allocate_token_bitmask(1, grammar.tokenizer.vocab_size)  # [1, W / 32]
        self._prefetched: OrderedDict[tuple[int, ...], numpy.ndarray] = OrderedDict()  # tokens -> bitmask row
        self.lock = threading.Lock()  # held by whoever uses the matchers: a call, or a prefetch in flight

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """`scores` ``[B, V]`` with the tokens each row's grammar bans at -inf, as a new tensor (the caller's
        logits stay as they were: log-probabilities and the other choices of a prompt read them)."""
        if self.prompt_length is None:
            self.prompt_length = input_ids.shape[1]
        rows = input_ids[:, self.prompt_length:].tolist()
        allowed = torch.stack([self.mask(ids, scores.shape[-1]) for ids in rows]).to(scores.device)  # [B, V]
        bias = _BIAS.to(scores.device, scores.dtype)[allowed.int()]  # [B, V]: -inf banned, 0 allowed
        return scores + bias

    def mask(self, generated: Sequence[int], vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` bool: the tokens the grammar allows after `generated` (none once they left it; ids
        past the tokenizer's are never text). Takes the mask `prefetched` for these tokens when there is one."""
        start = time.perf_counter()
        width = min(self.grammar.tokenizer.vocab_size, vocab_size)
        allowed = torch.zeros(vocab_size, dtype=torch.bool)
        with self.lock:
            words = self._prefetched.pop(tuple(generated), None)  # [W / 32], filled while the forward ran
            if words is None:
                matcher = self._matcher_for(generated)
                if matcher is not None:
                    llguidance.numpy.fill_next_token_bitmask(matcher.engine, self._bitmask, 0)
                    words = self._bitmask[0]
            if words is not None:
                bits = numpy.unpackbits(words.view(numpy.uint8), bitorder="little")[:width]  # [width]: 1 allowed
                allowed[:width] = torch.from_numpy(bits.astype(bool))
        if self.on_mask is not None:
            self.on_mask(time.perf_counter() - start)
        return allowed

    def follow(self, generated: Sequence[int]) -> bool:
        """Bring a matcher to exactly `generated` (the tokens a step kept: drafts it did not keep are rolled
        back); False when they leave the grammar."""
        return self.matcher_for(generated) is not None

    def prefetched(self, tokens: Sequence[int], words: numpy.ndarray) -> None:
        """Keep `words` ``[W / 32]``, the mask after the generated `tokens`, for the call that asks for it (the
        caller holds `lock`). At most `MAX_MATCHERS` are kept: a step dropped leaves its masks unused."""
        self._prefetched[tuple(tokens)] = words
        while len(self._prefetched) > MAX_MATCHERS:
            self._prefetched.popitem(last=False)

    def matcher_for(self, tokens: Sequence[int]) -> _Matcher | None:
        """A matcher that has consumed exactly `tokens` (None when they leave the grammar)."""
        with self.lock:
            return self._matcher_for(tokens)

    def _matcher_for(self, tokens: Sequence[int]) -> _Matcher | None:
        """`matcher_for`, for a caller that holds `lock`."""
        tokens = list(tokens)
        self._calls += 1
        matcher = self._nearest(tokens)
        if matcher is None or not matcher.follow(tokens):
            if matcher is not None:
                self._matchers.remove(matcher)
            matcher = _Matcher(self.grammar)
            if not matcher.follow(tokens):
                return None
            self._matchers.append(matcher)
        matcher.used = self._calls
        if len(self._matchers) > MAX_MATCHERS:
            self._matchers.remove(min(self._matchers, key=lambda m: m.used))  # the least recently used
        return matcher

    def is_complete(self, generated: Sequence[int]) -> bool:
        """Whether the grammar is complete after `generated` and nothing may follow them."""
        with self.lock:
            matcher = self._matcher_for(generated)
            return matcher is not None and matcher.engine.is_stopped()

    def _nearest(self, tokens: list[int]) -> _Matcher | None:
        """The kept matcher that reaches `tokens` with the least work: one that consumed a prefix of them (the
        longest), else one that consumed them and more (the fewest more: a dropped step, a token the stopping
        check consumed); None when every kept matcher is on another branch (another row's or choice's), which
        is left alone for its own row."""
        best, best_work = None, None
        for matcher in self._matchers:
            consumed = matcher.consumed
            if consumed == tokens[: len(consumed)]:
                work = len(tokens) - len(consumed)
            elif tokens == consumed[: len(tokens)]:
                work = len(consumed) - len(tokens)
            else:
                continue
            if best_work is None or work < best_work:
                best, best_work = matcher, work
        return best


class GrammarStop(StoppingCriteria):
    """Stops a row once its grammar is complete and allows nothing more (the answer's finish reason is "stop")."""

    def __init__(self, processor: GrammarLogitsProcessor):
        self.processor = processor

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        start = self.processor.prompt_length or 0
        done = [self.processor.is_complete(ids) for ids in input_ids[:, start:].tolist()]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def grammar_constraint(
    grammar: CompiledGrammar, prompt_length: int | None = None, on_mask: Callable[[float], None] | None = None,
) -> tuple[GrammarLogitsProcessor, GrammarStop]:
    """The logits processor and the stopping criterion that hold an answer to `grammar`, as a pair."""
    processor = GrammarLogitsProcessor(grammar, prompt_length, on_mask)
    return processor, GrammarStop(processor)
