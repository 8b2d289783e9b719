"""The lm-evaluation-harness model type "hf-paged" gives the same results as the harness's own "hf"."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from repo_paths import DATA
from tiny_models import tiny_model

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (optional extra: pip install 'lm-eval>=0.4,<0.5')"
)
from lm_eval_tasks import TASKS, evaluate  # noqa: E402 (needs lm_eval)

import hf_paged_cache.eval.lm_eval_model as adapter
from hf_paged_cache import PagedCache
from hf_paged_cache.eval.lm_eval_model import PagedHFLM


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    AutoTokenizer.from_pretrained(DATA / "char_tokenizer").save_pretrained(path)
    return path


def test_hf_paged_matches_hf(model_dir, monkeypatch):
    assert lm_eval.api.registry.get_model("hf-paged") is PagedHFLM
    plain = evaluate("hf", model_dir)

    # Count the forwards of each kind and the PagedCache objects built for them: one per call.
    calls = {"_model_call": 0, "_model_generate": 0}
    caches: list[PagedCache] = []

    class CountingCache(PagedCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            caches.append(self)

    def counted(name):
        original = getattr(PagedHFLM, name)

        def wrapper(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        return wrapper

    monkeypatch.setattr(adapter, "PagedCache", CountingCache)
    for name in calls:
        monkeypatch.setattr(PagedHFLM, name, counted(name))
    paged = evaluate("hf-paged", model_dir, ",block_size=8,prefill_chunk_size=7")  # chunked prefill
    assert calls["_model_call"] > 0 and calls["_model_generate"] > 0
    assert len(caches) == sum(calls.values())
    for task in TASKS:
        assert paged["results"][task]["sample_len"] == plain["results"][task]["sample_len"] == 8
    assert paged["results"]["paged_tiny_mc"]["acc,none"] == plain["results"]["paged_tiny_mc"]["acc,none"]
    assert (
        paged["results"]["paged_tiny_gen"]["exact_match,none"]
        == plain["results"]["paged_tiny_gen"]["exact_match,none"]
    )

    # Per-sample: loglikelihoods of every choice agree to float rounding, greedy answers are identical.
    mc_plain = sorted(plain["samples"]["paged_tiny_mc"], key=lambda s: s["doc_id"])
    mc_paged = sorted(paged["samples"]["paged_tiny_mc"], key=lambda s: s["doc_id"])
    for ours, theirs in zip(mc_paged, mc_plain, strict=True):
        for (ll_ours, greedy_ours), (ll_theirs, greedy_theirs) in zip(
            (r[0] for r in ours["resps"]), (r[0] for r in theirs["resps"]), strict=True
        ):
            assert ll_ours == pytest.approx(ll_theirs, abs=1e-4)
            assert greedy_ours == greedy_theirs
    gen_plain = sorted(plain["samples"]["paged_tiny_gen"], key=lambda s: s["doc_id"])
    gen_paged = sorted(paged["samples"]["paged_tiny_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"] for s in gen_paged] == [s["resps"] for s in gen_plain]
    assert all(s["resps"][0][0] for s in gen_paged)  # something was generated


def test_hf_paged_generation_through_the_batcher(model_dir):
    plain = evaluate("hf", model_dir)
    batched = evaluate("hf-paged", model_dir, ",batcher=True")
    gen_plain = sorted(plain["samples"]["paged_tiny_gen"], key=lambda s: s["doc_id"])
    gen_batched = sorted(batched["samples"]["paged_tiny_gen"], key=lambda s: s["doc_id"])
    assert [s["resps"] for s in gen_batched] == [s["resps"] for s in gen_plain]
    assert batched["results"]["paged_tiny_mc"]["acc,none"] == plain["results"]["paged_tiny_mc"]["acc,none"]
