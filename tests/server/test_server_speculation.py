"""The server with speculative decoding on (``--speculative ngram``): the same answers, and its counters."""

from __future__ import annotations

import httpx
import pytest
from server_process import KEY, NAME, generate_alone, run_server, token_ids

openai = pytest.importorskip("openai")


def test_speculative_answers_equal_generate_and_are_counted(model_dir, reference, tmp_path):
    model, tokenizer = reference
    log = tmp_path / "server.log"
    with run_server(model_dir, log, "--speculative", "ngram", "--speculative-tokens", "3") as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        for prompt in ["abcabcabcabcab", "the sea, the sea, the sea, the", "xyz"]:
            ids = tokenizer(prompt).input_ids
            answer = client.completions.create(
                model=NAME, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True},
            )
            assert token_ids(answer.choices[0].logprobs.tokens) == generate_alone(model, ids, 24)
        metrics = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    counters = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith("hf_paged_cache_spec_")}
    drafts, accepted = counters["hf_paged_cache_spec_draft_tokens_total"], counters["hf_paged_cache_spec_accepted_tokens_total"]
    assert 0 < drafts and 0 <= accepted <= drafts
