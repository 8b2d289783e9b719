"""Strided perplexity of a causal LM over a corpus, with the windows fed through a KV cache in chunks.

The method is the one of the transformers guide "Perplexity of fixed-length models": the token ids
of the corpus are cut into windows of at most ``max_length`` tokens whose starts are ``stride`` apart;
in each window only the tokens not already scored by the previous window are targets (the first
``max_length - trg_len`` tokens are context, their labels set to -100), so each corpus token after the
first is predicted exactly once, with up to ``max_length - stride`` tokens of context.

Two deliberate details:

* **Token-weighted average.**  The reported NLL is the sum of the per-token negative log-likelihoods
  over every counted token divided by the number of counted tokens, not the mean of per-window means.
  Tokens are counted exactly (labels other than -100 after the one-position shift); the guide's
  ``num_valid_tokens - batch_size`` correction undercounts by one token in every window that has
  context (every window after the first when ``stride < max_length``), whose dropped first label is
  already -100.
* **Cache-aware scoring.**  With ``cache="paged"`` (or ``"dynamic"``) each batch of windows runs as one
  left-padded ragged batch, fed through the cache in chunks of ``chunk_size`` tokens (chunked prefill:
  each chunk attends to the earlier chunks through the cache); the logits of all chunks are collected
  and the loss is computed over the whole window afterwards.  ``cache="none"`` runs each batch as one
  plain forward without a cache: the reference the cached modes must match.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..cache.paged_cache import PagedCache

__all__ = [
    "CACHE_MODES",
    "IGNORE_INDEX",
    "CacheMode",
    "PerplexityResult",
    "Window",
    "cache_bytes",
    "chunked_logits",
    "encode_corpus",
    "num_blocks_for",
    "pad_windows",
    "perplexity_of_text",
    "score_windows",
    "strided_windows",
    "token_nll",
]

CacheMode = Literal["paged", "dynamic", "none"]
CACHE_MODES: tuple[str, ...] = ("paged", "dynamic", "none")
IGNORE_INDEX: int = -100
"""Label of tokens that are not scored (context and padding), as in transformers' losses."""


@dataclass(frozen=True)
class Window:
    """Tokens ``[begin, end)`` of the corpus; the last `target_len` of them are scored, the rest is context."""

    begin: int
    end: int
    target_len: int
    input_ids: torch.Tensor  # [end - begin] int64

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def context_len(self) -> int:
        """Leading tokens that are context only (``max_length - trg_len`` in the guide)."""
        return self.length - self.target_len

    def labels(self) -> torch.Tensor:
        """``[length]`` the input ids with the context tokens set to -100."""
        labels = self.input_ids.clone()  # [length]
        labels[: self.context_len] = IGNORE_INDEX
        return labels


@dataclass
class PerplexityResult:
    """Outcome of :func:`score_windows`.

    `peak_cache_bytes` is the most K/V memory the cache held: for ``"paged"`` the maximum of
    ``cache.stats().bytes_reserved`` (blocks in use), for ``"dynamic"`` the bytes of its key and value
    tensors, ``None`` without a cache.  `pool_bytes` is what the paged pool allocated up front.
    """

    perplexity: float
    nll: float  # token-weighted mean negative log-likelihood (nats per token)
    nll_sum: float
    tokens: int  # tokens counted (predicted) over all windows
    windows: int
    batches: int
    seconds: float  # wall-clock time of the scoring loop
    cpu_seconds: float  # CPU time of this process (all threads) in that loop: steadier on a shared machine
    cache: str
    batch_size: int
    chunk_size: int | None
    peak_cache_bytes: int | None
    pool_bytes: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def encode_corpus(
    tokenizer: PreTrainedTokenizerBase, text: str, max_tokens: int | None = None
) -> torch.Tensor:
    """``[N]`` int64 token ids of `text` (tokenized as the guide does), capped at `max_tokens` if given.

    With a cap, only a prefix of the text long enough for `max_tokens` tokens is tokenized (the whole
    text if the prefix turns out too short), so capping a large corpus is cheap.
    """
    if max_tokens is not None and max_tokens < 2:
        raise ValueError(f"max_tokens must be at least 2 (one context token and one target), got {max_tokens}")
    chars_per_token_bound = 32
    if max_tokens is not None and len(text) > max_tokens * chars_per_token_bound:
        ids = tokenizer(text[: max_tokens * chars_per_token_bound], verbose=False)["input_ids"]
        if len(ids) < max_tokens:
            ids = tokenizer(text, verbose=False)["input_ids"]
    else:
        ids = tokenizer(text, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    return torch.tensor(ids, dtype=torch.long)  # [N]


def strided_windows(ids: torch.Tensor, max_length: int, stride: int) -> list[Window]:
    """Cut ``[N]`` token ids into the guide's windows.

    Window starts are ``0, stride, 2 * stride, ...``; each ends at ``min(begin + max_length, N)``; its
    targets are the tokens after the previous window's end; the last window is the first one reaching
    ``N`` (so it may be shorter than `max_length`).

    Raises:
        ValueError: unless ``1 <= stride <= max_length`` and the corpus has at least 2 tokens.
    """
    if ids.ndim != 1:
        raise ValueError(f"expected 1-D token ids, got shape {tuple(ids.shape)}")
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    if not 1 <= stride <= max_length:
        raise ValueError(f"stride must be between 1 and max_length ({max_length}), got {stride}")
    seq_len = ids.shape[0]
    if seq_len < 2:
        raise ValueError(f"the corpus has {seq_len} token(s); perplexity needs at least 2")
    windows: list[Window] = []
    prev_end = 0
    for begin in range(0, seq_len, stride):
        end = min(begin + max_length, seq_len)
        windows.append(Window(begin, end, end - prev_end, ids[begin:end]))
        prev_end = end
        if end == seq_len:
            break
    return windows


def pad_windows(
    windows: Sequence[Window], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad windows into one ragged batch.

    Returns:
        ``input_ids [B, T]``, ``attention_mask [B, T]`` (0 on padding) and ``labels [B, T]`` (-100 on
        padding and context), with ``T`` the longest window.
    """
    width = max(w.length for w in windows)
    input_ids = torch.full((len(windows), width), pad_token_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros(len(windows), width, dtype=torch.long)  # [B, T]
    labels = torch.full((len(windows), width), IGNORE_INDEX, dtype=torch.long)  # [B, T]
    for row, window in enumerate(windows):
        input_ids[row, width - window.length :] = window.input_ids
        attention_mask[row, width - window.length :] = 1
        labels[row, width - window.length :] = window.labels()
    return input_ids, attention_mask, labels


def num_blocks_for(rows: int, tokens_per_row: int, block_size: int, *, spare_per_row: int = 0) -> int:
    """Pool size in blocks for `rows` sequences of up to `tokens_per_row` real tokens, plus the null block."""
    return rows * (math.ceil(tokens_per_row / block_size) + spare_per_row) + 1


def chunked_logits(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    cache: Cache | None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Logits of a left-padded batch, fed through `cache` in chunks (or in one plain forward without one).

    Position ids are ``cumsum(attention_mask) - 1`` clamped at 0, so every row starts at position 0 after
    its padding.  Chunk ``k`` gets ``input_ids[:, s:e]`` with the attention mask of everything so far
    (``attention_mask[:, :e]``) and attends to the earlier chunks through the cache.

    Args:
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 for real tokens, 0 for padding.
        cache: an empty cache to fill, or ``None`` for one forward with ``use_cache=False``.
        chunk_size: tokens per forward with a cache; ``None`` feeds the whole batch in one forward.

    Returns:
        ``[B, T, vocab]`` logits.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)  # [B, T]
    if cache is None:
        return model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits  # [B, T, V]
    width = input_ids.shape[1]
    step = chunk_size or width
    pieces: list[torch.Tensor] = []
    for start in range(0, width, step):
        end = min(start + step, width)
        out = model(
            input_ids=input_ids[:, start:end],  # [B, q]
            attention_mask=attention_mask[:, :end],  # [B, past + q]
            position_ids=position_ids[:, start:end],  # [B, q]
            cache=cache,
            use_cache=True,
        )
        pieces.append(out.logits)  # [B, q, V]
    return torch.cat(pieces, dim=1)  # [B, T, V]


def token_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Summed negative log-likelihood and number of counted tokens.

    Position ``t`` predicts label ``t + 1`` (the usual shift); labels of -100 are ignored.  The
    log-softmax runs in float32 or wider, one row at a time to bound memory.

    Args:
        logits: ``[B, T, V]``.
        labels: ``[B, T]`` with -100 for ignored positions.
    """
    total = 0.0
    count = 0
    for row_logits, row_labels in zip(logits, labels):  # [T, V], [T]
        targets = row_labels[1:].to(row_logits.device)  # [T - 1]
        predictions = row_logits[:-1]  # [T - 1, V]
        if predictions.dtype not in (torch.float32, torch.float64):
            predictions = predictions.float()
        nll = F.cross_entropy(predictions, targets, ignore_index=IGNORE_INDEX, reduction="sum")  # []
        total += float(nll)
        count += int((targets != IGNORE_INDEX).sum())
    return total, count


def cache_bytes(cache: Cache) -> int:
    """K/V bytes a cache holds now: `bytes_reserved` for a `PagedCache`, tensor bytes for any other cache."""
    if isinstance(cache, PagedCache):
        return cache.stats().bytes_reserved
    total = 0
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                total += tensor.numel() * tensor.element_size()
    return total


def _model_device(model: PreTrainedModel) -> torch.device:
    return next(model.parameters()).device


def score_windows(
    model: PreTrainedModel,
    windows: Sequence[Window],
    *,
    cache: CacheMode = "paged",
    batch_size: int = 1,
    chunk_size: int | None = None,
    block_size: int = 16,
    pad_token_id: int = 0,
    progress: bool = False,
    kv_dtype: str | None = None,
) -> PerplexityResult:
    """Score `windows` in batches of `batch_size` and return the token-weighted perplexity.

    Each batch is left-padded (:func:`pad_windows`) and run through :func:`chunked_logits`: with
    ``cache="paged"`` through one `PagedCache` (a pool sized for one batch, `reset()` between batches),
    with ``"dynamic"`` through a fresh `DynamicCache` per batch, with ``"none"`` as one plain forward
    (`chunk_size` is then unused).  Caches only grow within a batch, so the peak memory is read once per
    batch, after its last chunk.

    Args:
        model: a causal LM in eval mode.
        windows: from :func:`strided_windows`.
        cache: ``"paged"``, ``"dynamic"`` or ``"none"``.
        batch_size: windows per forward batch.
        chunk_size: tokens per cached forward (chunked prefill); ``None`` = whole window at once.
        block_size: tokens per `PagedCache` block.
        pad_token_id: id written at padding positions (they are masked, so any valid id works).
        progress: show a tqdm bar over windows.
        kv_dtype: how the `PagedCache` stores keys and values (``"int8"``, say; default: the model's dtype), so
            that later chunks attend to history read back from that format.
    """
    if cache not in CACHE_MODES:
        raise ValueError(f"cache must be one of {CACHE_MODES}, got {cache!r}")
    if kv_dtype is not None and cache != "paged":
        raise ValueError(f"kv_dtype is PagedCache's: it needs cache='paged', got {cache!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not windows:
        raise ValueError("no windows to score")
    device = _model_device(model)
    paged: PagedCache | None = None
    if cache == "paged":
        longest = max(w.length for w in windows)
        paged = PagedCache(
            model, block_size=block_size, num_blocks=num_blocks_for(min(batch_size, len(windows)), longest, block_size),
            kv_dtype=kv_dtype,
        )
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc=f"perplexity ({cache})", unit="window")
    nll_sum, tokens, batches = 0.0, 0, 0
    peak: int | None = None if cache == "none" else 0
    start_time, start_cpu = time.perf_counter(), time.process_time()
    try:
        with torch.no_grad():
            for first in range(0, len(windows), batch_size):
                batch = windows[first : first + batch_size]
                input_ids, attention_mask, labels = pad_windows(batch, pad_token_id)  # [B, T] each
                run_cache: Cache | None
                if paged is not None:
                    paged.reset()
                    run_cache = paged
                elif cache == "dynamic":
                    run_cache = DynamicCache(config=model.config)
                else:
                    run_cache = None
                logits = chunked_logits(
                    model, input_ids.to(device), attention_mask.to(device), run_cache, chunk_size
                )  # [B, T, V]
                if run_cache is not None and peak is not None:
                    peak = max(peak, cache_bytes(run_cache))
                batch_nll, batch_tokens = token_nll(logits, labels)
                del logits, run_cache
                nll_sum += batch_nll
                tokens += batch_tokens
                batches += 1
                if bar is not None:
                    bar.update(len(batch))
    finally:
        if bar is not None:
            bar.close()
        pool_bytes = paged.pool.storage_bytes() if paged is not None else None
        if paged is not None:
            paged.release()
    seconds, cpu_seconds = time.perf_counter() - start_time, time.process_time() - start_cpu
    if tokens == 0:
        raise ValueError("no tokens were counted; is every window context only?")
    nll = nll_sum / tokens
    return PerplexityResult(
        perplexity=math.exp(nll),
        nll=nll,
        nll_sum=nll_sum,
        tokens=tokens,
        windows=len(windows),
        batches=batches,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        cache=cache,
        batch_size=batch_size,
        chunk_size=chunk_size if cache != "none" else None,
        peak_cache_bytes=peak,
        pool_bytes=pool_bytes,
    )


def perplexity_of_text(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    text: str,
    *,
    max_length: int = 512,
    stride: int = 256,
    batch_size: int = 1,
    chunk_size: int | None = None,
    cache: CacheMode = "paged",
    max_tokens: int | None = None,
    block_size: int = 16,
    progress: bool = False,
) -> PerplexityResult:
    """Tokenize `text` (:func:`encode_corpus`), cut it (:func:`strided_windows`) and score it (:func:`score_windows`)."""
    ids = encode_corpus(tokenizer, text, max_tokens)  # [N]
    windows = strided_windows(ids, max_length, stride)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return score_windows(
        model,
        windows,
        cache=cache,
        batch_size=batch_size,
        chunk_size=chunk_size,
        block_size=block_size,
        pad_token_id=pad_token_id,
        progress=progress,
    )
