"""Attention layers: keys and values per token, in blocks of the pool.

Full attention keeps every token. A sliding window of `W` keeps the tokens its next query can see (the last
``W - 1``), giving older blocks back. Chunked attention (Llama 4) is stored as a sliding window of its chunk
size: a query sees keys back to the start of its chunk, at most ``C - 1`` before it. It attends with the
chunked mask transformers builds over the dense keys and values, so the paged attentions, which mask by
causality and window only, refuse it.

Indexed attention (DeepSeek-V3.2's and GLM-5's DSA) is full attention whose lightning indexer keeps one more
key per token (``[index_head_dim]``, one head), which picks the keys each query attends to: it is stored in the
same blocks as the layer's keys and values (``cache.update_indexer``), so blocks share, copy, register by prefix
and go back with it. The model attends to the keys its indexer picked (a mask on eager and SDPA attention,
``sparse_indices`` for other kernels): the paged attentions, which attend to every key, refuse it.
"""

from .base import LayerKind

FULL_ATTENTION = LayerKind("full_attention", tokens=True, state=False)
SLIDING_ATTENTION = LayerKind("sliding_attention", tokens=True, state=False, windowed=True)
CHUNKED_ATTENTION = LayerKind("chunked_attention", tokens=True, state=False, windowed=True, dense_only=True)
INDEXED_ATTENTION = LayerKind("indexed_attention", tokens=True, state=False, indexer=True, dense_only=True)

KINDS = (FULL_ATTENTION, SLIDING_ATTENTION, CHUNKED_ATTENTION, INDEXED_ATTENTION)
