"""Greedy generation DynamicCache vs PagedCache (hf_paged_cache.eval.generation, scripts/eval/eval_generate.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import AutoTokenizer

from hf_paged_cache.eval.generation import _first_difference, compare_generation, encode_prompts, left_pad
from repo_paths import DATA, ROOT
from tiny_models import PAD, VOCAB, tiny_model

CHAR_TOKENIZER = DATA / "char_tokenizer"


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_paged_generation_matches_dynamic_on_ragged_batches(model_type):
    model = tiny_model(model_type)
    lengths = [3, 57, 12, 1, 30, 8, 44]  # very ragged batches of 3, 3 and 1
    result = compare_generation(
        model, random_prompts(lengths), pad_token_id=PAD, batch_size=3, max_new_tokens=12, block_size=8
    )
    assert result.prompts == 7 and len(result.batches) == 3
    assert result.exact_match_rate == 1.0 and result.exact_matches == 7
    assert result.first_divergence is None
    assert result.tokens_matching == result.tokens_compared == 7 * 12
    assert result.max_abs_logit_diff <= 1e-5
    assert result.paged_tokens == result.dynamic_tokens
    for batch in result.batches:
        assert 0 < batch.paged_bytes_used <= batch.paged_bytes_reserved <= batch.paged_pool_bytes
    if model_type == "llama":  # (Gemma 3's sliding layers keep only their window in DynamicCache)
        # Padding takes no blocks: the paged cache stores each row's real tokens only, less than the padded
        # dense cache. generate() feeds back all but the last new token.
        bytes_per_token = 2 * 2 * 2 * 16 * 4  # K+V x layers x kv heads x head dim x float32
        for batch in result.batches:
            real_tokens = sum(lengths[i] + 12 - 1 for i in batch.prompt_indices)
            assert batch.paged_bytes_used == real_tokens * bytes_per_token
            assert batch.dynamic_bytes == len(batch.prompt_indices) * (batch.padded_length + 12 - 1) * bytes_per_token
        assert result.batches[0].paged_bytes_reserved < result.batches[0].dynamic_bytes


def test_left_pad_and_first_difference():
    input_ids, mask = left_pad([[5, 6, 7], [9]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert _first_difference([1, 2, 3], [1, 2, 3]) is None
    assert _first_difference([1, 2, 3], [1, 4, 3]) == 1
    assert _first_difference([1, 2], [1, 2, 3]) == 2


def test_encode_prompts_uses_the_chat_template():
    tokenizer = AutoTokenizer.from_pretrained(CHAR_TOKENIZER)
    templated, raw = encode_prompts(tokenizer, ["hi"]), encode_prompts(tokenizer, ["hi"], use_chat_template=False)
    assert tokenizer.decode(templated[0]) == "user: hi\nassistant:"
    assert tokenizer.decode(raw[0]) == "hi"


def test_eval_generate_script(tmp_path):
    model_dir = tmp_path / "tiny-llama"
    tiny_model("llama").save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(CHAR_TOKENIZER).save_pretrained(model_dir)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"id": f"p{n}", "prompt": "word " * n}) for n in (1, 9, 3, 14, 2)) + "\n",
        encoding="utf-8",
    )
    spec = importlib.util.spec_from_file_location("eval_generate_script", ROOT / "scripts" / "eval" / "eval_generate.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "gen.json"
    results = script.main(
        ["--model", str(model_dir), "--prompts", str(prompts), "--batch-size", "2", "--max-new-tokens", "6",
         "--json", str(out), "--batcher"]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(results))
    assert results["summary"]["exact_match_rate"] == 1.0
    assert results["summary"]["first_divergence"] is None
    assert results["settings"]["chat_template"] is True
    assert [p["id"] for p in results["per_prompt"]] == ["p1", "p9", "p3", "p14", "p2"]
    assert len(results["batches"]) == 3
    assert results["batcher"]["exact_matches"] == 5  # every prompt through the ContinuousBatcher too
    assert results["batcher"]["seconds"] > 0


def test_shipped_prompts_are_valid():
    lines = (ROOT / "scripts" / "eval" / "data" / "eval_prompts.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    assert len(records) >= 10
    assert len({r["id"] for r in records}) == len(records)
    lengths = sorted(len(r["prompt"]) for r in records)
    assert lengths[0] < 40 and lengths[-1] > 400  # short questions up to a few paragraphs
