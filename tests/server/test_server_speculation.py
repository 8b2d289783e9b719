"""The server with speculative decoding on (``--speculative ngram`` and ``draft:MODEL``): the same answers, and
its counters."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from server_process import KEY, NAME, generate_alone, run_server, token_ids

openai = pytest.importorskip("openai")


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_answers_equal_generate_and_are_counted(model_dir, reference, tmp_path, method):
    model, tokenizer = reference
    log = tmp_path / "server.log"
    speculative = "ngram" if method == "ngram" else f"draft:{model_dir}"  # the model drafts for itself
    logs = ["--log-level", "info"] if method == "draft" else []  # to see that the draft's layers were packed
    with run_server(model_dir, log, "--speculative", speculative, "--speculative-tokens", "3", *logs) as server:
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
    if method == "draft":
        assert accepted > 0.9 * drafts  # its own drafts: all kept but for ties between float32 kernels
        assert "linear layers of the draft model for oneDNN" in log.read_text()  # packed as the model's are


def test_an_unknown_speculative_method_stops_the_command(model_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "hf_paged_cache.serve", str(model_dir),
                           "--speculative", "eagle"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "expected ngram, draft:MODEL or off" in done.stderr
