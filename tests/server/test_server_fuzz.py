"""The API fuzzed from its own OpenAPI schema: schemathesis reads ``/openapi.json`` from a real server (the
subprocess and tiny Llama of `server_process.py`) and sends every operation requests drawn from it, bodies that fit
the schema and bodies that break it.

Every answer must come within `REQUEST_TIMEOUT` seconds, never be a 5xx, and match what the schema says of its
status, content type, headers and body; a body that breaks the schema must be refused. Afterwards no request is
left running, the pool holds as many blocks as before, the log holds no traceback (a failure inside a stream is
sent with status 200, and only logged), and a greedy completion is what it was before.

Bounded: `EXAMPLES` requests per operation and mode, from a fixed seed (the same requests on every run), and a time
budget shared by the operations, past which the rest of an operation's requests are skipped.
``HF_PAGED_CACHE_API_FUZZ_EXAMPLES=500`` runs longer (the budget grows with it). The server's context is
`MAX_MODEL_LEN` tokens, so no prompt or answer costs much; its pool, running set, queue and ``--max-n`` are
small, so that fuzzed requests wait, and fill the queue (429), too. Half the bodies that fit the schema are
steered (`steer`) towards what the server runs, so that fuzzed sampling settings reach the batcher.
"""

from __future__ import annotations

import os
import time
from collections import Counter

import pytest
from repo_paths import DATA
from server_process import NAME, Server, metric, metrics_text, run_server
from transformers import AutoTokenizer

schemathesis = pytest.importorskip("schemathesis", reason="the fuzz test needs schemathesis (pip install -e '.[dev]')")
httpx = pytest.importorskip("httpx")

from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("HF_PAGED_CACHE_API_FUZZ_EXAMPLES", "25"))  # per operation and generation mode
BUDGET_SECONDS = 25.0 * max(1.0, EXAMPLES / 25)  # for all the fuzzing (about 10 s on two idle cores)
SEED = 20261202  # hypothesis' seed: the same requests on every run
REQUEST_TIMEOUT = 10.0  # seconds: an answer that takes longer is a hang
MAX_MODEL_LEN = 24  # tokens of prompt and answer: what a fuzzed request costs at most, per choice
MAX_N = 3
SERVER_OPTIONS = [
    "--max-model-len", str(MAX_MODEL_LEN), "--block-size", "4", "--num-blocks", "48", "--max-n", str(MAX_N),
    "--max-running", "4", "--max-waiting", "4", "--max-body-bytes", "32768",
]
CHECKS = [
    not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
    response_schema_conformance, negative_data_rejection,
]
# a body that breaks the schema may also be refused for its size (413; schemathesis' list lacks it)
REJECTED = ["400", "401", "404", "405", "413", "415", "422", "429", "5xx"]
REFUSED_BY_DESIGN = ("logit_bias", "response_format", "tools", "tool_choice", "functions", "function_call", "suffix",
                     "best_of", "modalities", "audio")  # params.py refuses these when set
ROUTES = {
    "GET /health", "GET /v1/models", "GET /v1/models/{model_id}", "POST /v1/completions", "POST /v1/chat/completions",
    "POST /v1/responses", "POST /tokenize", "POST /detokenize", "GET /metrics", "POST /v1/audio/transcriptions",
}


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz-server-log") / "server.log"
    with run_server(model_dir, log, *SERVER_OPTIONS) as running:
        yield running


def greedy_completion(server: Server) -> str:
    body = {"model": NAME, "prompt": "Fuzz me:", "max_tokens": 12, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, headers=server.headers(), timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["text"]


def test_the_schema_needs_the_key_and_describes_every_route(server):
    assert httpx.get(server.url + "/openapi.json", timeout=10).status_code == 401
    assert httpx.get(server.url + "/docs", headers=server.headers(), timeout=10).status_code == 404
    assert httpx.get(server.url + "/redoc", headers=server.headers(), timeout=10).status_code == 404
    schema = httpx.get(server.url + "/openapi.json", headers=server.headers(), timeout=10).json()
    routes = {f"{method.upper()} {path}" for path, item in schema["paths"].items() for method in item}
    assert routes == ROUTES
    completions = schema["paths"]["/v1/completions"]["post"]
    assert completions["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/CompletionRequest"}
    answers = completions["responses"]
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "422" not in answers  # FastAPI's validation error: this server answers 400 with an error object
    error = {"$ref": "#/components/schemas/ErrorResponse"}
    assert all(answers[status]["content"]["application/json"]["schema"] == error
               for status in ("400", "401", "404", "413", "429", "500", "503"))


def steer(body: object, vocabulary: int) -> None:
    """Nudge a body drawn from the schema towards one the server runs, in place: the served model, none of the
    parameters it refuses by design, at most `MAX_N` choices, `max_tokens` the context can hold (with a short
    prompt) and token ids inside the vocabulary. Half the bodies that fit the schema are steered, so that most
    of those reach the batcher while the others still try every refusal."""
    if not isinstance(body, dict):
        return
    for name in REFUSED_BY_DESIGN:
        body.pop(name, None)
    if "model" in body:
        body["model"] = NAME
    if _is_int(body.get("n")):
        body["n"] = 1 + (body["n"] - 1) % MAX_N
    for name in ("max_tokens", "max_completion_tokens"):
        if _is_int(body.get(name)):
            body[name] = 1 + (body[name] - 1) % (MAX_MODEL_LEN // 2)
    if "stream_options" in body:
        body["stream"] = True
    for name in ("prompt", "tokens"):
        if isinstance(body.get(name), list):
            body[name] = [[t % vocabulary if _is_int(t) else t for t in item] if isinstance(item, list)
                          else item % vocabulary if _is_int(item) else item for item in body[name]]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def test_the_api_survives_its_own_schema(server):
    before = greedy_completion(server)
    text = metrics_text(server)
    idle = metric(text, "hf_paged_cache_blocks_used")
    finished = sum(metric(text, "hf_paged_cache_requests_total", f'finish_reason="{reason}"')
                   for reason in ("stop", "length"))
    vocabulary = len(AutoTokenizer.from_pretrained(DATA / "char_tokenizer"))
    config = schemathesis.Config.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": REJECTED}}})
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config, headers=server.headers(),
                                           timeout=10)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {operation.label for operation in operations} == ROUTES
    # a body can break the schema; a path's string, or no input at all, cannot
    runs = [(operation, mode) for operation in operations
            for mode in (("positive", "negative") if operation.body else ("positive",))]
    end = time.monotonic() + BUDGET_SECONDS
    answered: Counter[tuple[str, str, int]] = Counter()  # (operation, mode, status): requests
    for done, (operation, mode) in enumerate(runs):
        deadline = time.monotonic() + (end - time.monotonic()) / (len(runs) - done)  # its share of what is left

        @given(case=operation.as_strategy(generation_mode=schemathesis.GenerationMode(mode)), steered=st.booleans())
        @seed(SEED)
        @settings(max_examples=EXAMPLES, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate, Phase.shrink],
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
        def fuzz(case, steered):
            if time.monotonic() > deadline:
                return
            if steered and mode == "positive":
                steer(case.body, vocabulary)
            started = time.monotonic()
            response = case.call_and_validate(headers=server.headers(), checks=CHECKS, timeout=REQUEST_TIMEOUT)
            assert time.monotonic() - started < REQUEST_TIMEOUT, f"{case.as_curl_command()} took too long"
            answered[operation.label, mode, response.status_code] += 1

        fuzz()
    tally = sorted(answered.items())
    print("".join(f"\n{count:4d} {label} {mode}: {status}" for (label, mode, status), count in tally))
    for label in ("POST /v1/completions", "POST /v1/chat/completions"):  # the batcher ran fuzzed requests
        assert answered[label, "positive", 200] > 0, answered

    # afterwards: nothing running, every block back, no traceback logged, the same greedy answer
    deadline = time.monotonic() + 10
    while True:
        text = metrics_text(server)
        settled = (metric(text, "hf_paged_cache_blocks_used") == idle
                   and metric(text, "hf_paged_cache_requests_running") == 0
                   and metric(text, "hf_paged_cache_requests_waiting") == 0)
        if settled or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert settled, text
    ran = sum(metric(text, "hf_paged_cache_requests_total", f'finish_reason="{reason}"')
              for reason in ("stop", "length")) - finished
    print(f"the batcher finished {ran:.0f} fuzzed choices")
    log = server.log.read_text(errors="replace")
    assert "Traceback" not in log, log
    assert greedy_completion(server) == before
