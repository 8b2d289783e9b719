"""The supported-architectures table of docs/layer-kinds.md is the tests' own: every model type the tests build
(`TINY_CONFIGS`, `LAYER_KIND_CONFIGS`), its layer kinds, and what `PagedCache(model)` does with it.

The exactness of each "exact" row is asserted by tests/cache/test_parity.py (`TINY_CONFIGS`),
tests/cache/test_layer_kinds.py (`LAYER_KIND_CONFIGS`) and tests/cache/test_encoder_decoder.py
(`ENCODER_DECODER_CONFIGS`); the batcher's "yes" by tests/engine/test_batcher_layer_kinds.py and
tests/engine/test_batcher_encoder_decoder.py. Rewrite the table after changing the configs or what is
supported: ``HF_PAGED_CACHE_WRITE_DOCS=1 python -m pytest tests/project/test_supported_models.py``.
"""

import os

import torch

from encoder_decoder_models import ENCODER_DECODER_CONFIGS, encoder_inputs, tiny_seq2seq
from layer_kind_models import LAYER_KIND_CONFIGS
from repo_paths import DOCS
from tiny_models import TINY_CONFIGS, tiny_model
from transformers.cache_utils import get_layer_types_and_kwargs

from hf_paged_cache import ContinuousBatcher, PagedCache
from hf_paged_cache.pool.memory import dense_attention_kinds

PAGE = DOCS / "layer-kinds.md"
START, END = "<!-- supported-models: start -->", "<!-- supported-models: end -->"


def row(model_type: str) -> str:
    """Its table row: layer kinds, what `PagedCache(model)` does, whether `paged_sdpa` can run it."""
    model = tiny_model(model_type)
    config = model.config.get_text_config(decoder=True)
    kinds = ", ".join(sorted(set(get_layer_types_and_kwargs(config)[0])))
    elsewhere, verdict = [], ""
    try:
        with PagedCache(model) as probe, torch.no_grad():  # a forward of one token, as the batcher's start-up check
            verdict = "refused at its first forward: "
            model(input_ids=torch.zeros(1, 1, dtype=torch.long), cache=probe, use_cache=True)
            elsewhere = probe.states_kept_elsewhere()
        verdict = "exact"
    except NotImplementedError as error:
        verdict = (verdict if verdict.startswith("refused at") else "refused: ") + _reason(error)
    if verdict != "exact":
        paged = "-"
    elif dense_attention_kinds(model.config):
        paged = f"no ({', '.join(dense_attention_kinds(model.config))})"
    elif not getattr(model, "_supports_attention_backend", False):
        paged = "no (its own attention)"
    else:
        paged = "yes"
    batcher = "-" if verdict != "exact" else "refused (states in its own modules)" if elsewhere else "yes"
    if verdict == "exact" and "indexed_attention" in kinds:
        batcher = "refused (its indexer depends on the batch)"
    return f"| `{model_type}` | {type(model).__name__} | {kinds} | {verdict} | {paged} | {batcher} |"


def encoder_decoder_row(model_type: str) -> str:
    """An encoder-decoder model's row: its decoder's self-attention layers, what one generated token does."""
    model = tiny_seq2seq(model_type)
    with PagedCache(model) as cache:  # an EncoderDecoderCache: the decoder's blocks and the cross-attention's
        model.generate(**encoder_inputs(model_type, [0]), cache=cache, max_new_tokens=1, do_sample=False)
        verdict = "exact" if cache.cross_attention_cache.written else "no cross attention stored"
    try:
        ContinuousBatcher(model).close()
        batcher = "yes"
    except NotImplementedError as error:
        batcher = f"refused: {_reason(error)}"
    kinds = "full_attention (decoder), cross attention"
    return f"| `{model_type}` | {type(model).__name__} | {kinds} | {verdict} | no (cross attention) | {batcher} |"


def _reason(error: Exception) -> str:
    """The error's first clause."""
    return str(error).split(" (")[0].split(":")[0]


def table() -> str:
    rows = [row(model_type) for model_type in sorted({*TINY_CONFIGS, *LAYER_KIND_CONFIGS})]
    rows += [encoder_decoder_row(model_type) for model_type in sorted(ENCODER_DECODER_CONFIGS)]
    head = ["| model type | class | layer kinds | `PagedCache(model)` | `paged_sdpa` | `ContinuousBatcher` |",
            "| --- | --- | --- | --- | --- | --- |"]
    return "\n".join([*head, *rows])


def test_the_docs_table_is_the_tests_own():
    text = PAGE.read_text()
    before, rest = text.split(START)
    _, after = rest.split(END)
    expected = f"{before}{START}\n{table()}\n{END}{after}"
    if os.environ.get("HF_PAGED_CACHE_WRITE_DOCS"):
        PAGE.write_text(expected)
        return
    assert text == expected, "docs/layer-kinds.md's table is stale: rewrite it (see this module's docstring)"
