"""Strided perplexity (hf_paged_cache.eval.perplexity), corpora, the evaluate metric and scripts/eval/perplexity.py."""

from __future__ import annotations

import importlib.util
import json
import math
import re

import pytest
import torch
from transformers import AutoTokenizer

from hf_paged_cache.eval.corpora import (
    CorpusDownloadError,
    load_corpus_text,
    offline_corpus_path,
    wiki_xml_to_text,
    wikitext_to_text,
)
from hf_paged_cache.eval.perplexity import (
    IGNORE_INDEX,
    encode_corpus,
    pad_windows,
    perplexity_of_text,
    score_windows,
    strided_windows,
)
from repo_paths import DATA, ROOT
from tiny_models import tiny_model

CORPUS = DATA / "perplexity_corpus.txt"
CHAR_TOKENIZER = DATA / "char_tokenizer"
MAX_LENGTH, STRIDE = 64, 24  # windows overlap by 40 tokens


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(CHAR_TOKENIZER)


@pytest.fixture(scope="module")
def corpus_ids(tokenizer) -> torch.Tensor:
    return encode_corpus(tokenizer, CORPUS.read_text(encoding="utf-8"))


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / "eval" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("n, max_length, stride", [(300, 64, 24), (300, 64, 64), (64, 64, 16), (10, 64, 8), (2, 2, 1)])
def test_windows_score_every_token_once(n, max_length, stride):
    ids = torch.arange(n)
    windows = strided_windows(ids, max_length, stride)
    assert [w.begin for w in windows] == list(range(0, stride * len(windows), stride))
    assert windows[-1].end == n
    targets = []
    for w in windows:
        assert w.length <= max_length
        assert torch.equal(w.input_ids, ids[w.begin : w.end])
        labels = w.labels()
        assert (labels[: w.context_len] == IGNORE_INDEX).all()
        assert torch.equal(labels[w.context_len :], ids[w.end - w.target_len : w.end])
        targets.extend(range(w.end - w.target_len, w.end))
    assert targets == list(range(n))  # each token is a target once; token 0 has no prediction


def test_windows_reject_bad_arguments():
    with pytest.raises(ValueError, match="stride"):
        strided_windows(torch.arange(100), 16, 17)
    with pytest.raises(ValueError, match="at least 2"):
        strided_windows(torch.arange(1), 16, 8)


def test_pad_windows_left_pads_and_masks_labels():
    windows = strided_windows(torch.arange(3, 40), 16, 8)
    input_ids, mask, labels = pad_windows(windows[-2:], pad_token_id=0)
    assert input_ids.shape == mask.shape == labels.shape == (2, 16)
    short = windows[-1]
    pad = 16 - short.length
    assert pad > 0
    assert (mask[1, :pad] == 0).all() and (mask[1, pad:] == 1).all()
    assert (input_ids[1, :pad] == 0).all() and torch.equal(input_ids[1, pad:], short.input_ids)
    assert (labels[1, :pad] == IGNORE_INDEX).all() and torch.equal(labels[1, pad:], short.labels())


# ---------------------------------------------------------------------------------------------- scoring


def guide_reference(model, windows) -> float:
    """The guide's loop (one window at a time, the model's own loss), with exact token counts."""
    nll_sum, tokens = 0.0, 0
    with torch.no_grad():
        for w in windows:
            labels = w.labels()[None]  # [1, L]
            loss = model(input_ids=w.input_ids[None], labels=labels).loss
            counted = int((labels[:, 1:] != IGNORE_INDEX).sum())
            nll_sum += float(loss) * counted
            tokens += counted
    return math.exp(nll_sum / tokens)


def test_no_cache_matches_the_guide_loop(corpus_ids):
    model = tiny_model("llama")
    windows = strided_windows(corpus_ids[:300], MAX_LENGTH, STRIDE)
    result = score_windows(model, windows, cache="none", batch_size=4)
    assert result.tokens == 299
    assert result.perplexity == pytest.approx(guide_reference(model, windows), rel=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "gpt2"])
def test_paged_matches_no_cache(model_type, corpus_ids):
    model = tiny_model(model_type)
    ids = corpus_ids[:480]
    # 19 windows: the last batch holds two full windows and a 48-token one, left-padded by 16, so with
    # chunks of 16 that row's first chunk is all padding.
    windows = strided_windows(ids, MAX_LENGTH, STRIDE)
    assert len(windows) % 4 == 3 and windows[-1].length == MAX_LENGTH - 16
    none = score_windows(model, windows, cache="none", batch_size=4)
    paged = score_windows(model, windows, cache="paged", batch_size=4, chunk_size=16)
    dynamic = score_windows(model, windows, cache="dynamic", batch_size=4, chunk_size=16)

    assert none.tokens == paged.tokens == dynamic.tokens == ids.numel() - 1
    assert paged.perplexity == pytest.approx(none.perplexity, rel=1e-4)
    assert dynamic.perplexity == pytest.approx(none.perplexity, rel=1e-4)
    assert none.peak_cache_bytes is None and paged.peak_cache_bytes > 0 and dynamic.peak_cache_bytes > 0


@pytest.mark.parametrize("batch_size, chunk_size", [(1, None), (3, 7), (8, 64)])
def test_batching_and_chunking_do_not_change_the_result(batch_size, chunk_size, corpus_ids):
    model = tiny_model("qwen3")
    windows = strided_windows(corpus_ids[:300], MAX_LENGTH, STRIDE)
    reference = score_windows(model, windows, cache="none", batch_size=1)
    paged = score_windows(model, windows, cache="paged", batch_size=batch_size, chunk_size=chunk_size)
    assert paged.perplexity == pytest.approx(reference.perplexity, rel=1e-4)
    assert paged.batches == math.ceil(len(windows) / batch_size)


def test_paged_peak_memory_counts_real_tokens_only(corpus_ids):
    model = tiny_model("llama")
    block_size = 8
    windows = strided_windows(corpus_ids[:200], 40, 30)  # 6 windows; the last one is 20 tokens long
    result = score_windows(model, windows, cache="paged", batch_size=4, chunk_size=16, block_size=block_size)
    per_block = 2 * 2 * 2 * 16 * block_size * 4  # K+V x layers x kv heads x head dim x tokens x float32
    expected_blocks = max(
        sum(math.ceil(w.length / block_size) for w in windows[i : i + 4]) for i in range(0, len(windows), 4)
    )
    assert result.peak_cache_bytes == expected_blocks * per_block


# ---------------------------------------------------------------------------------------------- corpora


WIKITEXT_SAMPLE = """{{Infobox river|name=Test|length={{convert|5|km}}}}
'''The Test''' is a [[river]] in [[England|southern England]].<ref>{{cite web|title=x}}</ref> It flows
past [[File:Bridge.jpg|thumb|The [[bridge]] [in 1900]]] the town of [[Stockbridge]].<ref name="a"/>
{| class="wikitable"
| cell || cell
|}
== Course ==
* It rises near [http://example.org Ashe] and joins the sea.&nbsp;See [[wikt:estuary]].
<!-- hidden -->
== References ==
{{reflist}}
* A book.
[[Category:Rivers]]
"""


def test_wikitext_to_text_strips_markup():
    text = wikitext_to_text(WIKITEXT_SAMPLE, title="River Test")
    assert text == (
        "= River Test =\n\n"
        "The Test is a river in southern England. It flows\n"
        "past the town of Stockbridge.\n\n"
        "== Course ==\n"
        "It rises near Ashe and joins the sea. See estuary."
    )


def test_wiki_xml_keeps_articles_and_skips_redirects():
    xml = (
        b'<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">'
        b"<page><title>A</title><ns>0</ns><revision><text>Alpha is [[first]].</text></revision></page>"
        b"<page><title>B</title><ns>0</ns><redirect title='A'/><revision><text>#REDIRECT [[A]]</text></revision></page>"
        b"<page><title>Talk:A</title><ns>1</ns><revision><text>chat</text></revision></page>"
        b"</mediawiki>"
    )
    assert wiki_xml_to_text(xml) == "= A =\n\nAlpha is first.\n"


def test_load_corpus_from_file_and_folder(tmp_path):
    pytest.importorskip("datasets", reason="the datasets package (extra 'eval') is not installed")
    assert load_corpus_text(CORPUS).text == CORPUS.read_text(encoding="utf-8").strip("\n")
    (tmp_path / "b.txt").write_text("second file\n", encoding="utf-8")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_text("first line\nsecond line\n", encoding="utf-8")
    (tmp_path / "notes.md").write_text("ignored", encoding="utf-8")
    corpus = load_corpus_text(tmp_path)
    assert corpus.text == "second file\n\nfirst line\nsecond line"  # sorted paths: b.txt < sub/a.txt


def test_offline_corpus_is_built_from_the_gensim_wheel(tmp_path):
    """The one networked test: downloads gensim 4.4.0 from PyPI (about 28 MB) and converts the excerpt."""
    try:
        path = offline_corpus_path(tmp_path)
    except CorpusDownloadError as exc:
        pytest.skip(f"PyPI unreachable, cannot download the gensim wheel: {exc}")
    text = path.read_text(encoding="utf-8")
    assert text.startswith("= Anarchism =\n\nAnarchism is a political philosophy")
    assert len(re.findall(r"^= .+ =$", text, flags=re.MULTILINE)) == 106  # one title line per article
    for markup in ("{{", "[[", "<ref", "{|", "'''"):
        assert text.count(markup) <= 2, markup
    provenance = (tmp_path / "enwiki-excerpt.PROVENANCE.md").read_text(encoding="utf-8")
    assert "CC BY-SA" in provenance and "gensim==4.4.0" in provenance
    assert offline_corpus_path(tmp_path) == path  # built once


# ---------------------------------------------------------------------------------------------- entry points


def test_evaluate_module_loads_from_path_and_matches_library(tokenizer):
    evaluate = pytest.importorskip("evaluate", reason="the evaluate package (extra 'eval') is not installed")
    metric = evaluate.load(str(ROOT / "metrics" / "paged_perplexity"))
    model = tiny_model("llama")
    text = CORPUS.read_text(encoding="utf-8")
    paragraphs = text.split("\n\n")
    kwargs = {"max_length": MAX_LENGTH, "stride": STRIDE, "batch_size": 4, "chunk_size": 16}
    got = metric.compute(predictions=paragraphs, model=model, tokenizer=tokenizer, cache="paged", **kwargs)
    expected = perplexity_of_text(model, tokenizer, "\n\n".join(paragraphs), cache="paged", **kwargs)
    assert got["perplexity"] == pytest.approx(expected.perplexity, rel=1e-9)
    assert got["tokens"] == expected.tokens and got["windows"] == expected.windows
    plain = metric.compute(predictions=paragraphs, model=model, tokenizer=tokenizer, cache="none", **kwargs)
    assert plain["perplexity"] == pytest.approx(got["perplexity"], rel=1e-4)


def test_perplexity_script_compare(tmp_path, tokenizer):
    pytest.importorskip("datasets", reason="the datasets package (extra 'eval') is not installed")
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "ppl.json"
    results = load_script("perplexity").main(
        [
            "--model", str(model_dir), "--corpus", str(CORPUS), "--max-length", "64", "--stride", "32",
            "--batch-size", "3", "--chunk-size", "16", "--max-tokens", "400", "--compare", "--json", str(out),
            "--no-progress",
        ]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert set(results["runs"]) == {"paged", "none"}
    assert results["runs"]["paged"]["tokens"] == 399
    assert results["relative_difference"] < 1e-4
    assert results["runs"]["paged"]["peak_cache_bytes"] > 0
