"""lm-evaluation-harness model type ``"hf-paged"``: the harness's ``hf`` model with every forward through `PagedCache`.

Optional: needs ``lm-eval>=0.4,<0.5`` (``pip install "lm-eval==0.4.*"``).  Importing this module
registers the model type, so import it before calling the harness::

    import lm_eval
    import hf_paged_cache.eval.lm_eval_model  # registers "hf-paged"

    results = lm_eval.simple_evaluate(
        model="hf-paged",
        model_args="pretrained=HuggingFaceTB/SmolLM2-135M-Instruct,dtype=float32,block_size=16",
        tasks=["hellaswag"],
    )

or run the harness's command line with the model type registered::

    python -m hf_paged_cache.eval.lm_eval_model --model hf-paged --model_args pretrained=... --tasks ...

`PagedHFLM` is lm-eval's `HFLM` (``"hf"``) with two methods replaced:

* ``_model_call`` (loglikelihood and rolling loglikelihood): the batch goes through a fresh
  `PagedCache` sized for it, in one forward with ``use_cache=True`` (or in chunks of
  ``prefill_chunk_size`` tokens: chunked prefill).  The harness right-pads these batches without an
  attention mask, so the padding is stored like any token; causal attention keeps it from affecting
  the real tokens' logits, exactly as in the plain ``hf`` forward.
* ``_model_generate`` (``generate_until``): ``model.generate`` gets ``cache=PagedCache(self.model, ...)``
  sized for the batch (rows x beams/return sequences x ``ceil(max_length / block_size) + 1`` blocks);
  left padding takes no blocks.

With ``batcher=True``, ``generate_until`` runs through a `ContinuousBatcher` instead: each row of the
harness's batch is a request (padding stripped), with ``stop_strings`` for the harness's stop sequences,
and finishes on its own instead of running until the batch's longest row is done.

Extra ``model_args``: ``block_size`` (tokens per block, default 16), ``prefill_chunk_size`` (default:
whole batch in one forward) and ``batcher`` (default False).  Seq2seq models and ``mixed_precision_dtype`` (autocast: keys and values
then come out in different dtypes, which a one-dtype pool refuses) are not supported.
``peak_cache_bytes`` records the most ``PagedCache.stats().bytes_reserved`` seen by one call.
"""

from __future__ import annotations

from typing import Any

import torch
from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from ..cache.paged_cache import PagedCache
from ..engine.batcher import ContinuousBatcher
from .perplexity import chunked_logits, num_blocks_for

__all__ = ["PagedHFLM", "main"]


@register_model("hf-paged")
class PagedHFLM(HFLM):
    """lm-eval's ``hf`` model whose loglikelihood forwards and generation run through `PagedCache`."""

    def __init__(
        self,
        pretrained: Any,
        block_size: int = 16,
        prefill_chunk_size: int | None = None,
        batcher: bool | str = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(pretrained, **kwargs)
        if self.backend != "causal":
            raise NotImplementedError("hf-paged supports decoder-only (causal) models only")
        if getattr(self, "mixed_precision_dtype", None) is not None:
            # Under autocast, attention layers emit keys and values of different dtypes (e.g. float32 keys
            # after RoPE, bfloat16 values); a PagedCache pool stores one dtype and refuses them.
            raise NotImplementedError(
                "hf-paged does not support mixed_precision_dtype (autocast); load the model in the wanted "
                "dtype with dtype=... instead"
            )
        self.block_size = int(block_size)
        self.prefill_chunk_size = int(prefill_chunk_size) if prefill_chunk_size else None
        self.peak_cache_bytes = 0
        self.use_batcher = str(batcher).lower() in ("1", "true", "yes")
        self._batcher: ContinuousBatcher | None = None

    def _record(self, cache: PagedCache) -> None:
        self.peak_cache_bytes = max(self.peak_cache_bytes, cache.stats().bytes_reserved)

    def _model_call(
        self,
        inps: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[batch, seq, vocab]`` logits of ``inps [batch, seq]``, computed through a fresh `PagedCache`."""
        if attn_mask is not None or labels is not None:  # seq2seq path; refused in __init__
            return super()._model_call(inps, attn_mask=attn_mask, labels=labels)
        rows, length = inps.shape
        num_blocks = num_blocks_for(rows, length, self.block_size)
        with (
            torch.no_grad(),
            PagedCache(self.model, block_size=self.block_size, num_blocks=num_blocks) as cache,
        ):
            mask = torch.ones_like(inps)  # [batch, seq]: lm-eval's right padding is stored, see module docs
            logits = chunked_logits(self.model, inps, mask, cache, self.prefill_chunk_size)  # [batch, seq, vocab]
            self._record(cache)
        return logits

    def _model_generate(
        self,
        context: torch.Tensor,
        max_length: int,
        stop: list[str],
        **generation_kwargs: Any,
    ) -> torch.Tensor:
        """``HFLM._model_generate`` with ``cache=PagedCache(...)`` sized for ``context [batch, seq]``."""
        if self.use_batcher:
            return self._generate_with_batcher(context, max_length, stop, **generation_kwargs)
        copies = max(int(generation_kwargs.get("num_beams") or 1), 1) * max(
            int(generation_kwargs.get("num_return_sequences") or 1), 1
        )
        num_blocks = num_blocks_for(context.shape[0] * copies, max_length, self.block_size, spare_per_row=1)
        cache = PagedCache(self.model, block_size=self.block_size, num_blocks=num_blocks)
        try:
            out = super()._model_generate(context, max_length, stop, cache=cache, **generation_kwargs)
            self._record(cache)
            return out
        finally:
            cache.release()


    def _generate_with_batcher(
        self, context: torch.Tensor, max_length: int, stop: list[str], **generation_kwargs: Any
    ) -> torch.Tensor:
        """``[batch, seq + new]`` like ``generate``'s output: each row a request of the `ContinuousBatcher`."""
        mask = generation_kwargs.pop("attention_mask", None)
        if mask is None:
            mask = context != self.tokenizer.pad_token_id  # [batch, seq] the harness pads on the left
        if not generation_kwargs.get("do_sample") and not generation_kwargs.get("temperature"):
            generation_kwargs.pop("temperature", None)
            generation_kwargs["do_sample"] = False
        if self._batcher is None:
            self._batcher = ContinuousBatcher(self.model, block_size=self.block_size, tokenizer=self.tokenizer)
        prompts = [row[keep.bool()].tolist() for row, keep in zip(context, mask, strict=True)]
        new_tokens = max_length - context.shape[1]
        outputs = self._batcher.generate(
            prompts, max_new_tokens=new_tokens, stop_strings=stop or None, **generation_kwargs
        )
        padded = torch.full((context.shape[0], new_tokens), self.tokenizer.pad_token_id, dtype=context.dtype)
        for row, tokens in enumerate(outputs):
            padded[row, : len(tokens)] = torch.tensor(tokens, dtype=context.dtype)
        return torch.cat([context, padded.to(context.device)], dim=1)


def main() -> None:
    """lm-eval's command line with ``hf-paged`` registered (``python -m hf_paged_cache.eval.lm_eval_model ...``)."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
