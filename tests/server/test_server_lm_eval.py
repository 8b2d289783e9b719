"""lm-evaluation-harness against the server: its "local-completions" model, pointed at a real
`python -m hf_paged_cache.serve` subprocess, scores the tiny local tasks as the harness's own "hf" model does on
the same weights.

The server, on its tiny random Llama with the character tokenizer, is test_server.py's (`tests/server/conftest.py`,
`tests/server_process.py`: the subprocess is always stopped); the tasks, and the "hf" run they are compared with,
come from `tests/lm_eval_tasks.py`. What the harness sends is recorded on the way, to check it asks what the
server answers: a loglikelihood is the prompt's own log-probabilities (``echo``, ``logprobs=1``, ``max_tokens=1``),
``is_greedy`` whether each of them is the top alternative's; a generation is greedy up to the task's ``until`` or
the EOS text.
"""

from __future__ import annotations

import pytest

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (optional extra: pip install -e '.[lm-eval]')"
)
pytest.importorskip("tenacity", reason="lm-eval's API models need its api extra: pip install 'lm-eval[api]'")
api_models = pytest.importorskip("lm_eval.models.api_models")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval_tasks import evaluate, task_configs  # noqa: E402
from server_process import CONTEXT, KEY, NAME, generate_alone  # noqa: E402

BATCH = 8  # prompts per request: the 24 multiple-choice continuations take 3 requests, the 8 generations 1


def server_model_args(server, model_dir) -> str:
    """local-completions on the server, prompts sent as token ids of the model's own tokenizer."""
    return ",".join([
        f"base_url={server.url}/v1/completions", f"model={NAME}", "tokenized_requests=True",
        f"tokenizer={model_dir}", "tokenizer_backend=huggingface", f"max_length={CONTEXT}",
        f"batch_size={BATCH}", "num_concurrent=1", "max_retries=1",  # in order, one try: an error fails the test
    ])


def evaluate_server(server, model_dir) -> dict:
    return lm_eval.simple_evaluate(
        model="local-completions", model_args=server_model_args(server, model_dir), tasks=task_configs(),
        log_samples=True, bootstrap_iters=0, task_manager=TaskManager(include_defaults=False),
    )


def by_doc(results: dict, task: str) -> list[dict]:
    return sorted(results["samples"][task], key=lambda sample: sample["doc_id"])


def test_local_completions_on_the_server_matches_hf(server, model_dir, monkeypatch):
    """Both tiny tasks through the server: the same accuracy, loglikelihoods and generations as "hf"."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)  # what local-completions sends as its bearer key
    exchanges: list[tuple[dict, dict]] = []
    post = api_models.requests.post

    def recording_post(url, **kwargs):
        response = post(url, **kwargs)
        exchanges.append((kwargs["json"], response.json()))
        return response

    monkeypatch.setattr(api_models.requests, "post", recording_post)
    served = evaluate_server(server, model_dir)
    plain = evaluate("hf", model_dir)

    # What the harness asked: loglikelihoods as the echoed prompt's logprobs, one token "generated" (and ignored)
    scoring = [(body, answer) for body, answer in exchanges if body.get("echo")]
    assert len(scoring) == 3  # 24 continuations (8 questions x 3 choices) in requests of 8
    for body, answer in scoring:
        assert (body["max_tokens"], body["logprobs"], body["temperature"], body["model"]) == (1, 1, 0, NAME)
        assert all(isinstance(ids, list) and all(isinstance(i, int) for i in ids) for ids in body["prompt"])
        assert len(answer["choices"]) == len(body["prompt"]) == BATCH
        for choice, ids in zip(sorted(answer["choices"], key=lambda c: c["index"]), body["prompt"], strict=True):
            logprobs = choice["logprobs"]
            assert len(logprobs["token_logprobs"]) == len(ids) + 1  # the prompt's tokens, then the new one
            assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
            assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])  # is_greedy reads the top one
    # ... and generations greedy, to the task's "\n" or the tokenizer's EOS text, at most max_gen_toks
    generating = [(body, answer) for body, answer in exchanges if not body.get("echo")]
    assert len(generating) == 1
    body, answer = generating[0]
    assert (body["stop"], body["max_tokens"], body["temperature"]) == (["\n", "</s>"], 8, 0)
    assert len(answer["choices"]) == len(body["prompt"]) == BATCH
    assert all(choice["finish_reason"] in ("stop", "length") for choice in answer["choices"])

    for task in ("paged_tiny_mc", "paged_tiny_gen"):
        assert served["results"][task]["sample_len"] == plain["results"][task]["sample_len"] == 8
    assert served["results"]["paged_tiny_mc"]["acc,none"] == plain["results"]["paged_tiny_mc"]["acc,none"]
    assert (served["results"]["paged_tiny_gen"]["exact_match,none"]
            == plain["results"]["paged_tiny_gen"]["exact_match,none"])

    # Per sample: each choice's loglikelihood to float rounding, and the same is_greedy
    for ours, theirs in zip(by_doc(served, "paged_tiny_mc"), by_doc(plain, "paged_tiny_mc"), strict=True):
        for (ll_ours, greedy_ours), (ll_theirs, greedy_theirs) in zip(
            (r[0] for r in ours["resps"]), (r[0] for r in theirs["resps"]), strict=True
        ):
            assert ll_ours == pytest.approx(ll_theirs, abs=1e-4)
            assert greedy_ours == greedy_theirs
    # ... and the very same generations
    generated = [s["resps"] for s in by_doc(served, "paged_tiny_gen")]
    assert generated == [s["resps"] for s in by_doc(plain, "paged_tiny_gen")]
    assert all(resps[0][0] for resps in generated)  # something was generated


def test_is_greedy_when_the_continuation_is_the_models_greedy_answer(server, model_dir, reference, monkeypatch):
    """The tasks' choices are never greedy for a random model, so score the model's own greedy answers too:
    `is_greedy` must then be True (and False once one character differs), from the server as from "hf"."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    model, tokenizer = reference
    requests = []
    # (no context ends in a space: the harness would move it to the continuation, which is then not greedy)
    for context in ["Hello, world!", "abc", "The capital of France is"]:
        answer = generate_alone(model, tokenizer(context).input_ids, 2)  # two characters
        text = tokenizer.decode(answer)
        # the model's vocabulary is larger than the tokenizer's: this answer must be one the harness can send
        assert tokenizer(text, add_special_tokens=False).input_ids == answer, (context, answer)
        other = "a" if text[-1] != "a" else "b"
        requests += [(context, text), (context, text[:-1] + other)]
    instances = [Instance("loglikelihood", {}, pair, idx) for idx, pair in enumerate(requests)]

    served = get_model("local-completions").create_from_arg_string(server_model_args(server, model_dir))
    plain = get_model("hf").create_from_arg_string(f"pretrained={model_dir},dtype=float32,device=cpu")
    ours, theirs = served.loglikelihood(instances), plain.loglikelihood(instances)
    assert [greedy for _, greedy in ours] == [greedy for _, greedy in theirs] == [True, False] * 3
    assert [ll for ll, _ in ours] == pytest.approx([ll for ll, _ in theirs], abs=1e-4)
