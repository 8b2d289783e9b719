"""`StepForwards`: the model forwards a step is made of, each leaving its caches pending until the step commits.

A step of the plan runs as one of these: the decode rows in one forward of the running cache (one position a
row, or ``1 + k`` with drafts), a prompt chunk in a forward of its own request's cache, or all of them packed
in one forward over one sequence (`cache.packed_forward`). A forward that raises leaves every cache as it was
(each `PagedCache` rolls its step back); one that returns leaves its caches pending (``manual_commit``) until
the executor commits or settles them. An encoder-decoder model's forwards take their encoder inputs as
`engine.encoder_inputs` says. With a `CompiledForward`, the decode forwards (the running rows alone) run it.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutput

from ..cache.encoder_decoder import PagedEncoderDecoderCache
from ..cache.packed_caches import Segment
from ..cache.packed_forward import packed_forward
from ..cache.paged_cache import PagedCache
from ..compiled import CompiledForward
from ..speculative.speculator import Drafts
from .encoder_inputs import encode, encoder_stand_in, row_positions
from .plan import Chunk, StepPlan
from .request import Request


class StepForwards:
    """The forwards of `model` that steps are made of (the decode forwards through `compiled`, when given)."""

    def __init__(self, model: PreTrainedModel, compiled: CompiledForward | None = None):
        self.model = model
        self.compiled = compiled

    def decode(self, cache: PagedCache, requests: list[Request], drafts: Drafts | None = None) -> torch.Tensor:
        """One new token for each row of `cache` (left pending), after its `drafts` if any: the logits ``[B, V]``
        (with drafts ``[B, 1 + k, V]``, every position's)."""
        input_ids, positions, mask = self.decode_inputs(cache, requests, drafts)
        if isinstance(cache, PagedEncoderDecoderCache):
            return self._decode_encoder_decoder(cache, input_ids, positions, mask)
        if drafts is not None:
            cache.expect_drafts(drafts.k)
        if self.compiled is not None:  # every position's logits: with or without drafts, one graph
            logits = self.compiled(cache, input_ids, positions, mask)  # [B, q, V]
            return logits if drafts is not None else logits[:, -1]
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                         logits_to_keep=0 if drafts is not None else 1)
        return out.logits if drafts is not None else out.logits[:, -1]

    def chunk(self, chunk: Chunk) -> torch.Tensor:
        """The chunk's forward on its request's cache (left pending); its logits ``[r, V]`` at `logit_offsets`:
        every position's when the prompt's log-probabilities are asked for, else the last position's."""
        device = self.model.device
        if chunk.request.encoder is not None:
            return self._chunk_encoder_decoder(chunk)
        media = {}
        if chunk.reads_media:  # its images' tensors, and the ids that key its blocks (`engine.media`)
            media = chunk.request.media.chunk_inputs(chunk.start, len(chunk.tokens))
            end = chunk.start + len(chunk.tokens)
            chunk.cache.key_next_forward(torch.tensor([chunk.request.key_tokens[chunk.start : end]], device=device))
        out = self.model(
            input_ids=torch.tensor([chunk.tokens], device=device),
            position_ids=torch.arange(chunk.start, chunk.start + len(chunk.tokens), device=device).unsqueeze(0),
            cache=chunk.cache, use_cache=True, logits_to_keep=0 if chunk.request.needs_prompt_logprobs else 1,
            **media,
        )
        return out.logits[0]

    def encode(self, chunks: list[Chunk]) -> None:
        """Run the encoder for the chunks' requests that need it, in one batch (`encoder_inputs.encode`)."""
        encode(self.model, [chunk.request.encoder for chunk in chunks if chunk.request.encoder is not None])

    def _chunk_encoder_decoder(self, chunk: Chunk) -> torch.Tensor:
        """`chunk` for an encoder-decoder request: its decoder tokens, after its encoder's output (computed now
        if no batch computed it; dropped after the prompt's last chunk)."""
        encoder = chunk.request.encoder
        encode(self.model, [encoder])
        device = self.model.device
        out = self.model(
            decoder_input_ids=torch.tensor([chunk.tokens], device=device),
            encoder_outputs=BaseModelOutput(last_hidden_state=encoder.hidden),  # its own positions: no mask
            cache=chunk.cache, use_cache=True,
        )
        if chunk.finishes:
            encoder.hidden = None  # its cross-attention is in the pool now (a preempted request encodes again)
        wanted = logit_offsets(chunk) if chunk.request.needs_prompt_logprobs else [len(chunk.tokens) - 1]
        return out.logits[0, wanted]

    def _decode_encoder_decoder(
        self, cache: PagedEncoderDecoderCache, input_ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """`decode` on an encoder-decoder model's running rows, whose cross-attention reads the cache alone."""
        encoder_mask = cache.encoder_mask(input_ids.device)  # [B, S]
        ragged = None if bool(encoder_mask.all()) else encoder_mask  # no mask when none: the fastest kernel
        with row_positions(self.model, positions) as position_arguments:
            out = self.model(
                decoder_input_ids=input_ids, decoder_attention_mask=mask, attention_mask=ragged,
                encoder_outputs=encoder_stand_in(self.model, encoder_mask), cache=cache, use_cache=True,
                **position_arguments,
            )
        return out.logits[:, -1]

    def packed(self, plan: StepPlan) -> tuple[torch.Tensor, list[slice], list[PagedCache]]:
        """The plan's decode rows (with its drafts, if any) and prompt chunks in one packed forward, every cache
        left pending: the logits ``[R, V]`` (decode row ``b``'s position ``j`` at ``b * q + j``, ``q = 1 + k``,
        then each chunk's `logit_offsets`), each chunk's slice of them, and the caches of the forward. Any
        failure propagates with every cache as it was."""
        cache, running, drafts = plan.running_cache, plan.running, plan.drafts
        q = 1 + (drafts.k if drafts is not None else 0)  # positions per decode row
        segments, logits_at, chunk_rows = [], [], []
        if running:
            segments.append(Segment(cache, *self.decode_inputs(cache, running, drafts)))
            logits_at += range(len(running) * q)
        end = len(logits_at)
        for chunk in plan.chunks:
            positions = torch.arange(chunk.start, chunk.start + len(chunk.tokens)).unsqueeze(0)  # [1, c]
            segments.append(Segment(chunk.cache, torch.tensor([chunk.tokens]), positions))
            wanted = logit_offsets(chunk)
            chunk_rows.append(slice(len(logits_at), len(logits_at) + len(wanted)))
            logits_at += [end + offset for offset in wanted]
            end += len(chunk.tokens)
        if drafts is not None and running:
            cache.expect_drafts(drafts.k)
        logits = packed_forward(self.model, segments, logits_at)  # [len(logits_at), V]; every cache pending
        return logits, chunk_rows, [segment.cache for segment in segments]

    def decode_inputs(
        self, cache: PagedCache, requests: list[Request], drafts: Drafts | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Decode inputs of `cache`'s rows, each its last token then its drafts (``q = 1 + k``): input ids
        ``[B, q]``, positions ``[B, q]``, mask ``[B, L + q]``."""
        device = self.model.device
        rows = [[r.generated[-1], *(drafts.tokens[b] if drafts else ())] for b, r in enumerate(requests)]
        input_ids = torch.tensor(rows, device=device)  # [B, q]
        first = torch.tensor([[len(r.tokens) - 1] for r in requests], device=device)  # [B, 1]
        positions = first + torch.arange(input_ids.shape[1], device=device)  # [B, q]
        real = cache.is_real.to(device)
        mask = torch.cat([real, torch.ones_like(input_ids, dtype=torch.bool)], dim=1).long()  # [B, L + q]
        return input_ids, positions, mask


def logit_offsets(chunk: Chunk) -> list[int]:
    """Positions of `chunk` (from 0) whose logits its step needs: all of them for the prompt's log-probabilities,
    else the last one when the chunk finishes the prompt, else none."""
    if chunk.request.needs_prompt_logprobs:
        return list(range(len(chunk.tokens)))
    return [len(chunk.tokens) - 1] if chunk.finishes else []
