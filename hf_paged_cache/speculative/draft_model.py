"""Draft tokens from a smaller model: `DraftModel`, a `DraftSource` for the batcher's `Speculator`.

A draft model shares the target model's tokenizer (its token ids mean the same) and costs a fraction of it
per forward. Each running request has a one-row `PagedCache` of the draft model, on a pool of the draft's
own, holding the keys and values of the tokens the draft has seen. To propose, each row is first brought in
step with its request: what its cache holds past their common prefix (drafts the target rejected) is
cropped, and the tokens the request kept since are fed; then the draft's greedy tokens follow, one position
at a time. All rows run in one packed forward per position (`packed_forward`), so drafting k tokens costs k
forwards of the draft model whatever the number of rows. The last draft is never fed: the next step feeds it
if the target kept it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from ..attention import PAGED_ATTENTION_NAMES, set_paged_attention
from ..cache.packed_caches import PackingUnsupported, Segment
from ..cache.packed_forward import packed_forward
from ..cache.paged_cache import PagedCache
from ..errors import PoolExhaustedError
from ..pool.kv_pool import KVPool
from .proposers import DraftRow


@dataclass
class _Row:
    """One request's draft cache and the tokens whose keys and values it holds."""

    cache: PagedCache
    tokens: list[int] = field(default_factory=list)


class DraftModel:
    """Proposes each request's next tokens as `model` (the draft) would continue it greedily.

    Args:
        model: the draft; its vocabulary must cover the target's token ids. Its attention is switched to
            ``paged_sdpa`` (the packed forward reads keys and values from the pool).
        vocab_size: the target's vocabulary size: drafts are the draft's best token below it.
        block_size, num_blocks, max_memory: the draft's own pool (as for `PagedCache`; by default it grows as
            needed).
    """

    proposes_as_asked = True

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        vocab_size: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        max_memory: int | str | None = None,
    ):
        if getattr(model.config, "_attn_implementation", None) not in PAGED_ATTENTION_NAMES:
            try:
                set_paged_attention(model)
            except NotImplementedError as error:
                raise ValueError(f"{model.config.model_type!r} cannot be a draft model: {error}") from error
        self.model = model
        self.draft_vocab = model.get_input_embeddings().num_embeddings  # tokens it can be fed are below it
        self.vocab_size = vocab_size or self.draft_vocab
        self.context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
        probe = PagedCache(model, block_size=block_size, num_blocks=num_blocks, max_memory=max_memory)
        self.pool: KVPool = probe.pool  # made for the draft's layers and dtype; every request's cache shares it
        try:
            with torch.no_grad():
                self._forward([_Row(probe)], [[0]])
        except PackingUnsupported as error:
            raise ValueError(f"{model.config.model_type!r} cannot be a draft model: {error}") from error
        finally:
            probe.release()
        self._rows: dict[DraftRow, _Row] = {}

    @torch.no_grad()
    def propose(self, requests: Sequence[DraftRow], limits: Sequence[int]) -> list[list[int]]:
        """`limits[b]` greedy tokens of the draft after ``requests[b]``'s tokens (none where the pool runs out:
        every draft cache is then given back, and fed again from the start at its next proposal)."""
        drafts: list[list[int]] = [[] for _ in requests]
        if self.context is not None:  # the last draft is never fed: it may sit at the draft's last position + 1
            limits = [min(limit, self.context + 1 - len(r.tokens)) for r, limit in zip(requests, limits)]
        active = [b for b, limit in enumerate(limits) if limit > 0]
        if not active:
            return drafts
        try:
            feeds = {b: self._sync(requests[b]) for b in active}
            active = [b for b in active if max(feeds[b]) < self.draft_vocab]  # a token the draft cannot read
            if not active:
                return drafts
            for position in range(max(limits[b] for b in active)):
                rows = [b for b in active if limits[b] > position]
                feed = [feeds[b] if position == 0 else drafts[b][-1:] for b in rows]
                for b, token in zip(rows, self._forward([self._rows[requests[b]] for b in rows], feed)):
                    drafts[b].append(token)
        except PoolExhaustedError:
            self.keep_only([])
            return [[] for _ in requests]
        return drafts

    def keep_only(self, requests: Sequence[DraftRow]) -> None:
        running = set(requests)
        for request in [r for r in self._rows if r not in running]:
            self._rows.pop(request).cache.release()

    def _sync(self, request: DraftRow) -> list[int]:
        """Crop `request`'s draft cache to what it shares with the request's tokens; returns the tokens to feed
        (at least the last one, whose logits give the first draft)."""
        row = self._rows.get(request)
        if row is None:
            row = self._rows[request] = _Row(PagedCache(self.model, pool=self.pool))
        tokens = request.tokens
        common = 0
        for seen, token in zip(row.tokens, tokens[:-1]):
            if seen != token:
                break
            common += 1
        try:
            row.cache.crop(common - len(row.tokens))  # also trims sliding windows to what they need
        except ValueError:  # a sliding window gave back positions the crop needs: start the row over
            row.cache.release()
            common = 0
        del row.tokens[common:]
        row.cache.activate_past_recording()  # this proposal's drafts may be cropped at the next one
        return tokens[common:]

    def _forward(self, rows: list[_Row], feeds: list[list[int]]) -> list[int]:
        """Feed each row its tokens in one packed forward; each row's greedy next token."""
        segments, ends, end = [], [], 0
        for row, feed in zip(rows, feeds):
            start = len(row.tokens)
            positions = torch.arange(start, start + len(feed)).unsqueeze(0)  # [1, f]
            segments.append(Segment(row.cache, torch.tensor([feed]), positions))
            end += len(feed)
            ends.append(end - 1)
        logits = packed_forward(self.model, segments, ends)  # [rows, V]; each cache keeps its tokens
        for row, feed in zip(rows, feeds):
            row.tokens += feed
        return logits[:, : self.vocab_size].argmax(dim=-1).tolist()
