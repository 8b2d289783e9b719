"""The OpenAI-compatible server, as clients see it: a real `python -m hf_paged_cache.serve` subprocess on a free
port, driven by the official `openai` client and by raw HTTP (`httpx`).

The model is a tiny random Llama (vocabulary 96) with the character tokenizer of `tests/data/char_tokenizer`
(one token per character, so text and tokens line up), saved to a folder the server and these tests both load
(`tests/server_process.py`; the fixtures are in `tests/server/conftest.py`): every greedy answer is checked
against `model.generate` with `DynamicCache` on the same token ids, and every log-probability against
`torch.log_softmax` of the model's logits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from repo_paths import DATA
from server_process import (
    CONTEXT, KEY, MAX_BODY, MAX_N, NAME, Server, chat_ids, generate_alone, log_softmax_rows, metric, metrics_text,
    text_of, token_ids,
)
from tiny_models import tiny_model, tiny_tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

openai = pytest.importorskip("openai", reason="the server tests need the openai client (pip install -e '.[dev]')")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi", reason="the server needs its extra: pip install -e '.[serve]'")

from hf_paged_cache import ContinuousBatcher, PagedCache  # noqa: E402
from hf_paged_cache.kernels import quantize_weights  # noqa: E402
from hf_paged_cache.server.http.engine import EngineClient, GenerationOptions  # noqa: E402
from hf_paged_cache.server.http.penalties import PresenceFrequencyPenalty  # noqa: E402
from hf_paged_cache.server.http.stop_strings import StopStringMatcher  # noqa: E402


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


# ------------------------------------------------------------------ pieces, no server


def test_stop_string_matcher_holds_back_what_may_start_a_stop_string():
    matcher = StopStringMatcher(["abc", "xy"])
    released = [matcher.feed(piece) for piece in ["12a", "b", "3x", "!ab", "c-more"]]
    # "a" waits until "b3" shows it is no stop; "x" until "!"; "ab" + "c" completes "abc": cut before it
    assert released == ["12", "", "ab3", "x!", ""]
    assert matcher.stopped and matcher.text == "12ab3x!"
    assert "".join(released) == matcher.text


def test_presence_and_frequency_penalties_count_generated_tokens_only():
    penalty = PresenceFrequencyPenalty(prompt_length=2, presence=0.5, frequency=0.25)
    ids = torch.tensor([[3, 3, 1, 1, 2]])  # prompt [3, 3]; generated 1 twice and 2 once
    scores = penalty(ids, torch.zeros(1, 5))
    assert scores.tolist() == [[0.0, -(0.5 + 2 * 0.25), -(0.5 + 0.25), 0.0, 0.0]]


def test_the_engine_ends_a_choice_at_eos_unless_ignore_eos():
    """The engine alone, no HTTP: EOS ends a choice ("stop", its text left out); ignore_eos runs on to max_tokens."""
    model = tiny_model("llama")
    tokenizer = AutoTokenizer.from_pretrained(DATA / "char_tokenizer")
    prompt = tokenizer("Stop at EOS").input_ids
    free = generate_alone(model, prompt, 8)
    model.generation_config.eos_token_id = free[3]
    cut = next(i for i, token in enumerate(free) if token in (free[3], tokenizer.eos_token_id))

    async def first_choice(options: GenerationOptions):
        return (await engine.generate([prompt], options).results())[0]

    with ContinuousBatcher(model, tokenizer=tokenizer) as batcher:
        engine = EngineClient(batcher, tokenizer)
        assert engine.eos_token_ids == (free[3], tokenizer.eos_token_id)  # the model's EOS, then the tokenizer's
        stopped = asyncio.run(first_choice(GenerationOptions(max_tokens=8, temperature=0)))
        assert (stopped.tokens, stopped.finish_reason) == (free[:cut + 1], "stop")
        assert stopped.text == text_of(tokenizer, free[:cut])
        ignored = asyncio.run(first_choice(GenerationOptions(max_tokens=8, temperature=0, ignore_eos=True)))
        assert (ignored.tokens, ignored.finish_reason, ignored.text) == (free, "length", text_of(tokenizer, free))


class _FakeEngine:
    """What the app's lifecycle needs of an engine, for the tests that need no model."""

    batcher = None

    def close(self, timeout: float = 0.0) -> None:
        pass


def test_health_is_503_while_the_model_loads_and_once_shutting_down():
    from fastapi.testclient import TestClient

    from hf_paged_cache.server.http.app import build_app
    from hf_paged_cache.server.http.settings import ServerSettings

    loaded = threading.Event()

    def load(metrics):
        assert loaded.wait(10)
        return _FakeEngine()

    settings = ServerSettings(model_name="m", model_root="m", api_key=KEY, metrics_need_key=True)
    app = build_app(settings, load)
    key = {"Authorization": f"Bearer {KEY}"}
    with TestClient(app) as http:
        assert_error(http.get("/health"), 503, None, "loading")  # no key needed
        assert_error(http.get("/v1/models", headers=key), 503, None, "loading")
        assert_error(http.get("/metrics"), 401)  # --metrics-need-key
        loaded.set()
        deadline = time.monotonic() + 10
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert http.get("/metrics", headers=key).status_code == 200
        app.state.lifecycle.begin_shutdown()  # what SIGTERM does first
        assert_error(http.get("/health"), 503, None, "shutting down")
        assert_error(http.post("/v1/completions", json={"prompt": "ab"}, headers=key), 503, None, "shutting down")

    failures = []

    def fail(metrics):
        raise OSError("no such model")

    with TestClient(build_app(settings, fail, on_load_failure=failures.append)) as http:
        deadline = time.monotonic() + 10
        while not failures:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert_error(http.get("/health"), 503, None, "failed")
    assert isinstance(failures[0], OSError)


def test_chat_needs_a_chat_template():
    """The app in process, on an engine whose tokenizer has no chat template (and no --chat-template)."""
    from fastapi.testclient import TestClient

    from hf_paged_cache.server.http.app import build_app
    from hf_paged_cache.server.http.settings import ServerSettings

    model, tokenizer = tiny_model("llama"), tiny_tokenizer()

    def load(metrics):
        return EngineClient(ContinuousBatcher(model, tokenizer=tokenizer), tokenizer, metrics=metrics)

    with TestClient(build_app(ServerSettings(model_name="m", model_root="m"), load)) as http:
        deadline = time.monotonic() + 30
        while http.get("/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert_error(http.post("/v1/chat/completions", json=chat), 400, "messages", "--chat-template")
        answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
        expected = generate_alone(model, tokenizer("hi").input_ids, 3)
        assert answer.json()["choices"][0]["text"] == text_of(tokenizer, expected)


def test_the_console_script_dispatches_serve(capsys):
    from hf_paged_cache import cli

    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert all(option in help_text for option in ("--api-key", "--max-body-bytes", "--chat-template", "--max-n"))


# ------------------------------------------------------------------ the openai client


def test_completions_and_chat_equal_generate(server, client, reference):
    model, tokenizer = reference
    for prompt in ["The sea is", "Hello, world! 42"]:
        ids = tokenizer(prompt).input_ids
        expected = generate_alone(model, ids, 12)
        answer = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        choice = answer.choices[0]
        assert token_ids(choice.logprobs.tokens) == expected
        assert choice.text == text_of(tokenizer, expected)
        assert choice.finish_reason == "length"
        assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), 12)

    # prompts as token ids, several at once: one choice each, in order
    prompts = [tokenizer("abc").input_ids, tokenizer("Zebra crossing").input_ids]
    answer = client.completions.create(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in answer.choices] == [0, 1]
    assert [c.text for c in answer.choices] == [text_of(tokenizer, generate_alone(model, p, 6)) for p in prompts]

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    ids = chat_ids(tokenizer, messages)
    expected = generate_alone(model, ids, 10)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.content == text_of(tokenizer, expected)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.prompt_tokens == len(ids)  # as templated


def test_stock_linears_on_request_equal_the_stock_model(model_dir, tiny_servers):
    """``--no-packed-linears`` serves with the model's own kernels: greedy answers equal the unpacked model's."""
    stock = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer(p).input_ids for p in ("The sea is", "Hello, world! 42", "abc")]
    stock_client = openai.OpenAI(base_url=tiny_servers["stock"].url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = stock_client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in answer.choices] == [text_of(tokenizer, generate_alone(stock, p, 12)) for p in prompts]


def test_time_linears_packs_the_groups_timed_faster_packed_from_their_rows(model_dir, monkeypatch):
    """``--time-linears`` packs the groups of same-shaped layers its timings found faster packed, each from the
    rows where it was, and no other group (the timings are made to say: the first group at every size, the
    second from 4 rows, the others never; so every way is seen whatever this CPU measures)."""
    import hf_paged_cache.kernels as kernels
    from hf_paged_cache.kernels import PackedLinear
    from hf_paged_cache.kernels.linear_timing import linear_key
    from hf_paged_cache.server.launch import build_parser, load_batcher

    timed = []

    def made_up(model, *args, **kwargs):
        shapes = kernels.linear_timing.time_linear_shapes(model, *args, **kwargs)
        for number, shape in enumerate(shapes):
            ratios = {0: {1: 0.5, 4: 0.5, 16: 0.5}, 1: {1: 2.0, 4: 0.5, 16: 0.5}}.get(number, {1: 2, 4: 2, 16: 2})
            shape.packed_ms = {rows: ms * ratios[rows] for rows, ms in shape.stock_ms.items()}
        timed.append(shapes)
        return shapes

    monkeypatch.setattr(kernels, "time_linear_shapes", made_up)
    batcher, tokenizer = load_batcher(build_parser().parse_args([str(model_dir), "--num-blocks", "64",
                                                                 "--time-linears"]))
    with batcher:
        (shapes,) = timed
        assert len(shapes) > 2
        expected = {shapes[0].key: 1, shapes[1].key: 4}
        linears = [m for m in batcher.model.modules() if isinstance(m, torch.nn.Linear)]
        packed = {linear_key(m): m.stock_below for m in linears if type(m) is PackedLinear}
        assert packed == expected
        assert sum(type(m) is PackedLinear for m in linears) == shapes[0].layers + shapes[1].layers
        prompts = [tokenizer(p).input_ids for p in ("The sea is", "abc")]
        assert [len(a) for a in batcher.generate(prompts, max_new_tokens=6, min_new_tokens=6)] == [6, 6]


def test_bmm_decode_flag_runs_the_batcher_on_paged_bmm(model_dir, monkeypatch):
    """``--bmm-decode`` serves on ``paged_bmm``: decode steps by batched products, answers of the asked length."""
    from call_counters import count_calls

    from hf_paged_cache.attention import decode
    from hf_paged_cache.server.launch import build_parser, load_batcher

    products = count_calls(monkeypatch, decode, "product_attention")
    batcher, tokenizer = load_batcher(build_parser().parse_args([str(model_dir), "--num-blocks", "64", "--bmm-decode"]))
    with batcher:
        assert batcher.model.config._attn_implementation == "paged_bmm"
        prompts = [tokenizer(p).input_ids for p in ("The sea is", "Hello, world! 42", "abc")]
        answers = batcher.generate(prompts, max_new_tokens=12, min_new_tokens=12)
    assert [len(answer) for answer in answers] == [12, 12, 12]
    assert products  # the rows' blocks interleave as they grow: their decode steps attend by products


@pytest.mark.skipif(not any(shutil.which(name) for name in ("g++", "c++", "clang++")),
                    reason="paged_flex's kernel is compiled by inductor, which needs a C++ compiler")
def test_flex_decode_flag_compiles_before_serving_and_answers_as_generate(model_dir, reference, monkeypatch, caplog):
    """``--flex-decode`` serves on ``paged_flex``: its kernel compiled at start-up, then decode steps read the
    blocks in place (every step's rows in groups of their own here); greedy answers equal `generate` alone."""
    import hf_paged_cache.attention.reading as reading
    from hf_paged_cache.attention import flex_decode
    from hf_paged_cache.server.launch import build_parser, load_batcher

    monkeypatch.setattr(reading, "DECODE_CALL_COST", 0)

    model, tokenizer = reference
    prompts = [tokenizer(p).input_ids for p in ("The sea is", "Hello, world! 42", "abc")]
    runs = []
    original = flex_decode.attend_flex
    monkeypatch.setattr(flex_decode, "attend_flex", lambda *args: runs.append(1) or original(*args))
    monkeypatch.setattr("hf_paged_cache.attention.decode.attend_flex", flex_decode.attend_flex)
    options = build_parser().parse_args([str(model_dir), "--num-blocks", "64", "--flex-decode"])
    with caplog.at_level(logging.INFO, logger="hf_paged_cache.serve"):
        batcher, _ = load_batcher(options)
    with batcher:
        assert batcher.model.config._attn_implementation == "paged_flex"
        assert any(r.getMessage().startswith("paged_flex: decode kernel ready in") for r in caplog.records)
        warmed_up = len(runs)
        answers = batcher.generate(prompts, max_new_tokens=12, min_new_tokens=12)
    assert warmed_up and len(runs) > warmed_up
    assert answers == [generate_alone(model, p, 12) for p in prompts]


def test_int8_weights_keys_and_values_on_request_equal_generate_on_them(tiny_servers, reference, model_dir):
    """``--kv-dtype int8 --quantize int8`` serves int8 weights from an int8 pool: greedy answers equal `generate`
    on the same model quantized by `quantize_weights`, with an int8 `PagedCache`."""
    _, tokenizer = reference
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantize_weights(model)
    prompts = [tokenizer(p).input_ids for p in ("The sea is", "Hello, world! 42", "abc")]
    expected = []
    for ids in prompts:
        input_ids = torch.tensor([ids])
        with PagedCache(model, kv_dtype="int8") as cache:
            out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=12, cache=cache)
        expected.append(text_of(tokenizer, out[0, len(ids):].tolist()))
    int8_client = openai.OpenAI(base_url=tiny_servers["int8"].url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    answer = int8_client.completions.create(model=NAME, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in answer.choices] == expected


def test_int4_flag_quantizes_every_layer_and_answers_as_generate_on_the_same_model(model_dir, reference):
    """``--quantize int4-all`` loads 4-bit weights, the output head too: greedy answers equal `generate` on the same
    model quantized by `quantize_weights(bits=4, output_head=True)`."""
    from hf_paged_cache.kernels import Int4Linear
    from hf_paged_cache.server.launch import build_parser, load_batcher

    _, tokenizer = reference
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    quantize_weights(model, bits=4, output_head=True)
    prompts = [tokenizer(p).input_ids for p in ("The sea is", "Hello, world! 42", "abc")]
    batcher, _ = load_batcher(build_parser().parse_args([str(model_dir), "--num-blocks", "64", "--quantize", "int4-all"]))
    with batcher:
        assert isinstance(batcher.model.get_output_embeddings(), Int4Linear)
        answers = batcher.generate(prompts, max_new_tokens=12, min_new_tokens=12)
    assert answers == [generate_alone(model, p, 12) for p in prompts]


def test_streamed_text_joins_to_the_answer(server, client):
    kwargs = dict(model=NAME, prompt="Once upon a time", max_tokens=16, temperature=0)
    whole = client.completions.create(**kwargs)
    # on the wire: one "data: {json}" line per event, each event ended by a blank line, then "data: [DONE]"
    raw = httpx.post(server.url + "/v1/completions", json={**kwargs, "stream": True}, headers=server.headers())
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = raw.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(event.startswith("data: {") and "\n" not in event for event in events[:-2])
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens

    messages = [{"role": "user", "content": "Tell me a story."}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_n_choices_with_a_seed(server, client, reference):
    model, tokenizer = reference
    kwargs = dict(model=NAME, prompt="Roll the dice:", max_tokens=10, temperature=1.0, n=3, seed=7)
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # reproducible
    assert first.usage.prompt_tokens == len(tokenizer("Roll the dice:").input_ids)  # the prompt counted once
    # choice i samples as a request alone with seed 7 + i
    ids = tokenizer("Roll the dice:").input_ids
    with ContinuousBatcher(model) as batcher:
        alone = [batcher.submit(ids, max_new_tokens=10, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, seed=7 + i)
                 for i in range(3)]
        assert [c.text for c in first.choices] == [text_of(tokenizer, h.result(timeout=60)) for h in alone]
    # several prompts, n each: choice index = prompt index * n + j; greedy choices of one prompt agree
    answer = client.completions.create(model=NAME, prompt=["ab", "xyz"], max_tokens=5, temperature=0, n=2)
    texts = [c.text for c in sorted(answer.choices, key=lambda c: c.index)]
    expected = [text_of(tokenizer, generate_alone(model, tokenizer(p).input_ids, 5)) for p in ["ab", "xyz"]]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]


def test_logprobs_are_the_models_log_softmax(client, reference):
    model, tokenizer = reference
    prompt = "Logprobs, please"
    ids = tokenizer(prompt).input_ids
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"return_tokens_as_token_ids": True})
    logprobs = answer.choices[0].logprobs
    generated = token_ids(logprobs.tokens)
    rows = log_softmax_rows(model, ids + generated)  # [P + N, V]
    for i, token in enumerate(generated):
        row = rows[len(ids) - 1 + i]
        assert logprobs.token_logprobs[i] == pytest.approx(float(row[token]), abs=1e-4)
        top = {f"token_id:{t}": float(row[t]) for t in row.topk(3).indices.tolist()}
        assert logprobs.top_logprobs[i] == pytest.approx(top, abs=1e-4)
    # where each token's text starts (a special token, or an id the tokenizer lacks, has none)
    assert logprobs.text_offset == [len(text_of(tokenizer, generated[:i])) for i in range(len(generated))]

    messages = [{"role": "user", "content": "Hi"}]
    chat_prompt = chat_ids(tokenizer, messages)
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4, temperature=0, logprobs=True,
                                          top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    content = chat.choices[0].logprobs.content
    generated = token_ids([entry.token for entry in content])
    rows = log_softmax_rows(model, chat_prompt + generated)
    for i, entry in enumerate(content):
        row = rows[len(chat_prompt) - 1 + i]
        assert entry.logprob == pytest.approx(float(row[generated[i]]), abs=1e-4)
        assert token_ids([alt.token for alt in entry.top_logprobs]) == row.topk(2).indices.tolist()
        assert entry.bytes == list(entry.token.encode())


def test_echo_with_logprobs_scores_the_prompt(client, reference):
    """What lm-evaluation-harness's loglikelihood asks: echo, logprobs=1, max_tokens=1."""
    model, tokenizer = reference
    prompt = "The cat sat on the mat"
    ids = tokenizer(prompt).input_ids
    answer = client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1,
                                       extra_body={"return_tokens_as_token_ids": True})
    choice = answer.choices[0]
    logprobs = choice.logprobs
    assert choice.text.startswith(prompt) and len(choice.text) <= len(prompt) + 1
    assert token_ids(logprobs.tokens)[:len(ids)] == ids and len(logprobs.tokens) == len(ids) + 1
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = log_softmax_rows(model, token_ids(logprobs.tokens))
    for j in range(1, len(ids) + 1):
        token = token_ids([logprobs.tokens[j]])[0]
        assert logprobs.token_logprobs[j] == pytest.approx(float(rows[j - 1, token]), abs=1e-4)
        assert list(logprobs.top_logprobs[j]) == [f"token_id:{int(rows[j - 1].argmax())}"]
    assert logprobs.text_offset[:len(ids)] == list(range(len(ids)))


def test_stop_strings_and_stop_tokens_cut_the_text(client, reference):
    model, tokenizer = reference
    ids = tokenizer("Stop here:").input_ids
    generated = generate_alone(model, ids, 24)
    full = text_of(tokenizer, generated)
    stop = full[8:10]
    expected = full[:full.index(stop)]
    stops = ["never-there-1", stop, "never-there-2", "never-there-3", "never-there-4", "never-there-5"]
    answer = client.completions.create(model=NAME, prompt="Stop here:", max_tokens=24, temperature=0, stop=stops)
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (expected, "stop")
    streamed = list(client.completions.create(model=NAME, prompt="Stop here:", max_tokens=24, temperature=0,
                                              stop=stops, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"

    # a stop token ends the answer at its first occurrence, its own text left out
    token = generated[5]
    cut = generated.index(token)
    answer = client.completions.create(model=NAME, prompt="Stop here:", max_tokens=24, temperature=0,
                                       extra_body={"stop_token_ids": [token]})
    assert (answer.choices[0].text, answer.choices[0].finish_reason) == (text_of(tokenizer, generated[:cut]), "stop")
    assert answer.usage.completion_tokens == cut + 1


def test_sixteen_concurrent_clients_each_get_their_answer_alone(client, reference):
    model, tokenizer = reference
    prompts = [f"Client {i}: {'abcdefgh'[: i % 8 + 1]}" for i in range(16)]
    expected = [text_of(tokenizer, generate_alone(model, tokenizer(p).input_ids, 8 + i % 5))
                for i, p in enumerate(prompts)]

    def ask(i: int) -> str:  # one client object is thread-safe: 16 threads, 16 connections
        kwargs = dict(model=NAME, prompt=prompts[i], max_tokens=8 + i % 5, temperature=0)
        if i % 2:
            return client.completions.create(**kwargs).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))

    with ThreadPoolExecutor(16) as pool:
        assert list(pool.map(ask, range(16))) == expected


# ------------------------------------------------------------------ raw HTTP


def post(server: Server, path: str, body: object, key: str | None = KEY, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **server.headers(key), **kwargs.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, **{"timeout": 30, **kwargs})


def assert_error(response: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] and "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


BAD_COMPLETIONS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": MAX_N + 1}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1, 2], []]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"stop": ""}, "stop"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"stream": "yes"}, "stream"),
    ({"seed": 2**70}, "seed"),
    ({"prompt": [100000]}, "prompt"),  # a token id outside the vocabulary (the batcher refuses it)
    ({"prompt": [-1], "echo": True}, "prompt"),  # refused before echo decodes it (found by test_server_fuzz.py)
    ({"prompt": [[5], [2**40]], "echo": True}, "prompt"),
    # parameters that would change the output and are not implemented
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"response_format": {"type": "xml"}}, "response_format"),  # structured outputs: test_server_structured.py
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("change,param", BAD_COMPLETIONS, ids=[json.dumps(change) for change, _ in BAD_COMPLETIONS])
def test_bad_completion_values_are_400_naming_the_parameter(server, change, param):
    body = {"model": NAME, "prompt": "ab", "max_tokens": 2, **change}
    assert_error(post(server, "/v1/completions", body), 400, param)


def test_requests_the_server_refuses(server):
    # prompt and max_tokens past the context: both numbers said
    assert_error(post(server, "/v1/completions", {"prompt": "abcdefghij", "max_tokens": CONTEXT - 5}), 400,
                 "max_tokens", str(CONTEXT), str(CONTEXT + 5))
    too_long = {"prompt": [5] * CONTEXT, "max_tokens": 1}
    assert_error(post(server, "/v1/completions", too_long), 400, "prompt", str(CONTEXT))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    top_21 = {**chat, "logprobs": True, "top_logprobs": 21}
    assert_error(post(server, "/v1/chat/completions", top_21), 400, "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", {**chat, "top_logprobs": 2}), 400, "top_logprobs")
    assert_error(post(server, "/v1/chat/completions", {**chat, "messages": []}), 400, "messages")
    assert_error(post(server, "/v1/chat/completions", {**chat, "tool_choice": "required"}), 400, "tool_choice")
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert_error(post(server, "/v1/chat/completions", {**chat, "messages": image}), 400, "messages")
    # malformed JSON, the wrong content type, no body
    assert_error(post(server, "/v1/completions", b'{"prompt": "ab", '), 400, None, "JSON")
    assert_error(post(server, "/v1/completions", {"prompt": "ab"}, headers={"Content-Type": "text/plain"}), 400)
    assert_error(httpx.post(server.url + "/v1/completions", headers=server.headers(), timeout=30), 400)
    # too large: by Content-Length, and while reading a body sent without one (chunked)
    big = {"prompt": "a" * MAX_BODY, "max_tokens": 1}
    assert_error(post(server, "/v1/completions", big), 413)
    chunks = (b"x" * 8192 for _ in range(MAX_BODY // 8192 + 2))
    assert_error(httpx.post(server.url + "/v1/completions", content=chunks, timeout=30,
                            headers={"Content-Type": "application/json", **server.headers()}), 413)
    # the key: missing or wrong, on every API route; /health and /metrics are open
    for key in (None, "wrong-key"):
        assert_error(post(server, "/v1/completions", {"prompt": "ab"}, key=key), 401)
        assert_error(httpx.get(server.url + "/v1/models", headers=server.headers(key)), 401)
        assert_error(post(server, "/tokenize", {"prompt": "ab"}, key=key), 401)
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    # unknown model, unknown route
    assert_error(post(server, "/v1/completions", {"model": "gpt-9", "prompt": "ab"}), 404, "model")
    assert_error(httpx.get(server.url + "/v1/models/gpt-9", headers=server.headers()), 404, "model")
    assert_error(httpx.get(server.url + "/v1/engines", headers=server.headers()), 404)
    # unknown fields are ignored (greedy and without EOS: a sampled token could end it early, with "stop")
    ok = post(server, "/v1/completions", {"model": NAME, "prompt": "ab", "max_tokens": 2, "temperature": 0,
                                          "ignore_eos": True, "no_such_field": 1})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_models_tokenize_detokenize(server, reference):
    _, tokenizer = reference
    models = httpx.get(server.url + "/v1/models", headers=server.headers()).json()
    assert [m["id"] for m in models["data"]] == [NAME] and models["data"][0]["max_model_len"] == CONTEXT
    assert httpx.get(server.url + f"/v1/models/{NAME}", headers=server.headers()).json()["id"] == NAME
    tokens = post(server, "/tokenize", {"prompt": "Hello"}).json()
    assert tokens["tokens"] == tokenizer("Hello").input_ids and tokens["count"] == 5
    messages = [{"role": "user", "content": "hi"}]
    assert post(server, "/tokenize", {"messages": messages}).json()["tokens"] == chat_ids(tokenizer, messages)
    assert post(server, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": "Hello"}


def test_a_client_that_goes_away_cancels_its_request(server, client, reference):
    idle = metric(metrics_text(server), "hf_paged_cache_blocks_used")
    cancelled = metric(metrics_text(server), "hf_paged_cache_requests_total", 'finish_reason="cancelled"')
    body = {"model": NAME, "prompt": "A very long answer:", "max_tokens": CONTEXT - 100, "temperature": 0}
    # a stream cut after a few chunks
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=server.headers(),
                      timeout=30) as response:
        lines = response.iter_lines()
        assert sum(1 for line, _ in zip(lines, range(6)) if line.startswith("data: ")) >= 3
    # a non-streamed request whose client gives up
    with pytest.raises(httpx.TimeoutException):
        post(server, "/v1/completions", body, timeout=0.5)

    deadline = time.monotonic() + 5
    while True:
        text = metrics_text(server)
        done = (metric(text, "hf_paged_cache_blocks_used") == idle
                and metric(text, "hf_paged_cache_requests_total", 'finish_reason="cancelled"') >= cancelled + 2
                and metric(text, "hf_paged_cache_requests_running") == 0)
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert done, text
    for name in ("blocks_total", "blocks_free", "blocks_cached", "kv_utilization", "requests_waiting",
                 "prefix_cache_hit_tokens_total", "preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        metric(text, "hf_paged_cache_" + name)
    assert metric(text, "hf_paged_cache_requests_total", 'finish_reason="length"') > 0
    # still answering right after all of the above
    model, tokenizer = reference
    ids = tokenizer("Still there?").input_ids
    answer = client.completions.create(model=NAME, prompt="Still there?", max_tokens=8, temperature=0)
    assert answer.choices[0].text == text_of(tokenizer, generate_alone(model, ids, 8))


def test_metrics_count_the_batcher_steps(server, client):
    """One request alone: its prompt tokens in prompt steps, then its other tokens in decode steps (one each,
    or several in a step that kept drafts: speculation is on by default)."""
    def steps(text: str, kind: str) -> tuple[float, ...]:
        label = f'kind="{kind}"'
        return tuple(metric(text, "hf_paged_cache_" + name, label)
                     for name in ("steps_total", "step_tokens_total", "step_seconds_total"))

    before = metrics_text(server)
    answer = client.completions.create(model=NAME, prompt="Steps, counted: 3 1 4 1 5 9 2 6", max_tokens=7,
                                       temperature=0, extra_body={"ignore_eos": True})
    after = metrics_text(server)
    (prompt_steps, prompt_tokens, prompt_seconds), (decode_steps, decode_tokens, decode_seconds) = (
        tuple(b - a for a, b in zip(steps(before, kind), steps(after, kind))) for kind in ("prompt", "decode")
    )
    assert (prompt_steps, prompt_tokens) == (1, answer.usage.prompt_tokens)  # nothing of it cached before
    assert decode_tokens == answer.usage.completion_tokens - 1 == 6 and 1 <= decode_steps <= decode_tokens
    assert prompt_seconds > 0 and decode_seconds > 0


def test_sigterm_lets_the_request_in_flight_finish_then_exits_0(tiny_servers):
    """It stops the ``stock`` server (`tests/server/conftest.py`), whose test has run: ``main`` serves on, for
    test_server_lm_eval.py."""
    server = tiny_servers["stock"]
    body = {"model": NAME, "prompt": "Last words:", "max_tokens": 40, "temperature": 0, "stream": True}
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers(),
                          timeout=30) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(30)
    server.process.send_signal(signal.SIGTERM)
    reader.join(30)
    assert server.process.wait(timeout=30) == 0, server.log.read_text(errors="replace")
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
    assert "Traceback" not in server.log.read_text(errors="replace")
