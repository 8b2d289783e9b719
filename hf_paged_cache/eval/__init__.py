"""Evaluation through `PagedCache`: does the cache change the model's answers?

- `perplexity`: strided, token-weighted perplexity with chunked prefill through any cache;
- `corpora`: the evaluation texts (a file, a folder, a Hub dataset, or an offline Wikipedia excerpt);
- `generation`: greedy generation with `DynamicCache` against `PagedCache`, token by token;
- `lm_eval_model`: the ``hf-paged`` model type for lm-evaluation-harness (import it explicitly: it needs
  the ``lm-eval`` extra).
"""
