"""The Space demo (scripts/space/): its request logic on a tiny model, then the page in a real browser.

The browser test drives Debian's Chromium (``/usr/bin/chromium``, or ``$CHROMIUM``) through Playwright; it is
skipped, saying why, where either cannot be found. By default the app runs on a tiny random model (fast) and
the screenshot goes to pytest's tmp folder only. To remake the screenshot of docs/getting-started.md with the real default
model (SmolLM2-135M-Instruct), run

    HF_PAGED_CACHE_SPACE_REAL_MODEL=1 OMP_NUM_THREADS=1 python -m pytest tests/scripts/test_space.py -k browser

which also writes ``docs/space_screenshot.png`` (about two minutes on a CPU; one thread is much faster than
torch's default on a busy machine).
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, PreTrainedConfig, PreTrainedModel

pytest.importorskip("gradio", reason="the Space needs gradio: pip install 'gradio==6.31.0' matplotlib")
pytest.importorskip("matplotlib", reason="the Space needs matplotlib: pip install matplotlib")

from repo_paths import ROOT  # noqa: E402
from tiny_models import ragged_batch, tiny_model, tiny_tokenizer  # noqa: E402

from hf_paged_cache import PagedCache  # noqa: E402

SPACE_DIR = ROOT / "scripts" / "space"
DOCS_SCREENSHOT = ROOT / "docs" / "space_screenshot.png"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
REAL_MODEL = os.environ.get("HF_PAGED_CACHE_SPACE_REAL_MODEL") == "1"

if str(SPACE_DIR) not in sys.path:
    sys.path.insert(0, str(SPACE_DIR))  # the Space's modules import each other from beside app.py, as on a Space
_spec = importlib.util.spec_from_file_location("space_app", SPACE_DIR / "app.py")
app = importlib.util.module_from_spec(_spec)
sys.modules["space_app"] = app
_spec.loader.exec_module(app)
import batch_tab  # noqa: E402
import chat_tab  # noqa: E402
import gradio as gr  # noqa: E402
import layout  # noqa: E402
import limits  # noqa: E402
import plan_tab  # noqa: E402
import prompts  # noqa: E402
import shared_pools  # noqa: E402
import waiting_line  # noqa: E402
from pool_view import BlockKind, block_states, compare_memory  # noqa: E402

BATCH = "Hi!\nWhat is the capital of France?\nGive three tips for learning a new language, one short sentence each."


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


# --------------------------------------------------------------------------- request logic (no browser)


def test_shared_prefix_is_whole_blocks_and_leaves_each_row_a_token():
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9, 9], [1, 2, 3, 4, 5, 6]]
    assert prompts.shared_prefix_length(rows, 4) == 4  # 6 common, cut to whole blocks
    assert prompts.shared_prefix_length(rows, 2) == 4  # 6 common but the shortest row keeps 1 token
    assert prompts.shared_prefix_length(rows[:1], 2) == 0  # nothing to share with one row
    # rows of 9 and 5 tokens, 4 new tokens (3 stored), blocks of 4, 4 shared: 1 + ceil(8/4) + ceil(4/4)
    assert prompts.blocks_needed([9, 5], 4, 4, shared=4) == 1 + 2 + 1
    assert prompts.blocks_needed([9, 5], 4, 4, shared=0) == 3 + 2


def test_compare_memory_formulas(tiny):
    model, _ = tiny
    per_token = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head dim x (key + value) x float32 bytes
    rows = compare_memory(paged_reserved=640, paged_used=600, prompt_lengths=[3, 10], generated_steps=5,
                          max_new_tokens=8, config=model.config, dtype=torch.float32)
    paged, dynamic, static = rows
    assert (paged.reserved_bytes, paged.used_bytes) == (640, 600)
    assert dynamic.reserved_bytes == 2 * (10 + 4) * per_token  # rows padded to the longest, last token not fed
    assert static.reserved_bytes == 2 * (10 + 8) * per_token  # sized to the longest prompt + max_new_tokens
    assert dynamic.used_bytes == static.used_bytes == (3 + 4 + 10 + 4) * per_token
    assert dynamic.utilization == pytest.approx(21 / 28)


def test_batch_shares_the_common_prefix_and_gives_every_block_back(tiny):
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 64)
    kwargs = dict(system_prompt="A system prompt long enough to fill a few blocks of eight characters.",
                  max_new_tokens=6, block_size=8, block_budget=63)
    shared = batch_tab.run_batch(model, tokenizer, pools, BATCH, share_prefix=True, **kwargs)
    private = batch_tab.run_batch(model, tokenizer, pools, BATCH, share_prefix=False, **kwargs)
    assert shared.outputs == private.outputs  # sharing blocks changes memory, not tokens
    assert len(shared.outputs) == 3 and all(n == 6 for n in shared.new_tokens)
    assert len(set(shared.prompt_lengths)) == 3  # a ragged batch
    assert shared.shared_tokens >= 64 and shared.shared_tokens % 8 == 0
    states = block_states(shared.snapshot)
    shared_blocks = [s for s in states if s.kind is BlockKind.SHARED]
    assert len(shared_blocks) == shared.shared_tokens // 8
    assert all(s.rows == (0, 1, 2) and s.refcount == 3 for s in shared_blocks)
    assert not any(s.kind is BlockKind.SHARED for s in block_states(private.snapshot))
    paged, dynamic, static = shared.memory
    assert paged.reserved_bytes < private.memory[0].reserved_bytes < dynamic.reserved_bytes <= static.reserved_bytes
    pool = pools.pool(8)
    assert pool.blocks.num_free == pool.blocks.capacity  # released after the request


def test_int8_pool_holds_more_blocks_in_the_same_bytes(tiny):
    """The Batch tab's int8 switch: a pool of the same bytes with about 3x the blocks (head dim 16: 20 bytes per
    vector against 64), the batch run from it, and the page saying how its keys and values are stored."""
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 64, block_sizes=(8,))
    full, small = pools.pool(8), pools.pool(8, "int8")
    assert small.num_blocks * small.bytes_per_block <= full.num_blocks * full.bytes_per_block
    assert small.num_blocks == full.num_blocks * 64 // 20
    result = batch_tab.run_batch(model, tokenizer, pools, BATCH, max_new_tokens=6, block_size=8, block_budget=63,
                           kv_dtype="int8")
    assert len(result.outputs) == 3 and all(n == 6 for n in result.new_tokens)
    assert small.blocks.num_free == small.blocks.capacity and full.blocks.num_free == full.blocks.capacity
    page = batch_tab.memory_markdown(result, small)
    assert "int8 with a float16 minimum and step per 32 elements of each token and head" in page and f"{small.blocks.capacity * 8:,} tokens" in page
    with pytest.raises(limits.InputError, match="can be stored as"):
        pools.line(8, "float16")


def _generate_each_row(model, tokenizer, system_prompt: str, prompts_text: str, max_new_tokens: int) -> tuple[str, ...]:
    """Each prompt alone through `generate` with a `DynamicCache`: no padding, no sharing (the reference)."""
    answers = []
    for prompt in batch_tab.parse_prompts(prompts_text):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
        ids = torch.tensor([prompts.prompt_ids(tokenizer, messages)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
                             max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=prompts.pad_token_id(tokenizer))
        answers.append(str(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)).strip())
    return tuple(answers)


def test_sharing_the_prefix_keeps_the_answers_of_a_small_sliding_window():
    model, tokenizer = tiny_model("gemma3_text"), tiny_tokenizer()  # sliding window 12; layers sliding, sliding, full
    pools = shared_pools.SharedPools(model, 64, block_sizes=(8,))
    system = "A system prompt long enough to fill a few blocks of eight characters."
    kwargs = dict(system_prompt=system, max_new_tokens=8, block_size=8, block_budget=63)
    shared = batch_tab.run_batch(model, tokenizer, pools, BATCH, share_prefix=True, **kwargs)
    private = batch_tab.run_batch(model, tokenizer, pools, BATCH, share_prefix=False, **kwargs)
    assert shared.shared_tokens >= 64  # the shared prefix is several windows (12 tokens) long
    assert len(set(shared.prompt_lengths)) == 3  # a ragged batch: the shorter rows are padded
    expected = _generate_each_row(model, tokenizer, system, BATCH, max_new_tokens=8)
    assert private.outputs == expected
    assert shared.outputs == expected  # sharing blocks changes memory, not tokens
    shared_blocks = [s for s in block_states(shared.snapshot) if s.kind is BlockKind.SHARED]
    assert len(shared_blocks) == shared.shared_tokens // 8  # the full-attention layer stores the prefix once
    pool = pools.pool(8)
    assert all(blocks.num_used == 0 for blocks in pool.groups)  # every group's blocks came back


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(prompts_text="\n".join(["hi"] * 9)), "At most 8 prompts"),
        (dict(prompts_text="  \n "), "at least one prompt"),
        (dict(prompts_text="x" * 2001), "characters"),
        (dict(max_new_tokens=129), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(block_size=12), "Block size must be one of 8, 16, 32"),
        (dict(block_budget=1), "more than its budget of 1"),
        (dict(prompts_text="y" * 250), "the limit is"),
    ],
)
def test_out_of_bounds_requests_get_clear_messages(tiny, change, message):
    model, tokenizer = tiny
    request = dict(prompts_text=BATCH, max_new_tokens=8, block_size=16, block_budget=40) | change
    with pytest.raises(limits.InputError, match=message):
        batch_tab.run_batch(model, tokenizer, shared_pools.SharedPools(model, 41), **request)


def _hold_most_of(pool, model) -> PagedCache:
    """A cache outside the app's waiting line (another session) holding all but a few of `pool`'s blocks."""
    other = PagedCache(model, pool=pool)
    model.generate(**ragged_batch([0, 2], 80), cache=other, max_new_tokens=4, do_sample=False)
    return other


def test_request_waits_while_another_session_holds_its_blocks(tiny):
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 24)
    pool = pools.pool(16)
    messages, waiting = [], threading.Event()

    def on_wait(message):
        messages.append(message)
        waiting.set()

    request = dict(max_new_tokens=16, block_size=16, block_budget=23, on_wait=on_wait)
    with ThreadPoolExecutor(1) as executor:
        with _hold_most_of(pool, model) as other:
            held = [list(t) for t in other.block_tables.tables]
            free_before = pool.blocks.num_free
            batch = executor.submit(batch_tab.run_batch, model, tokenizer, pools, BATCH, **request)
            assert waiting.wait(30), "the request did not wait for the blocks"
            assert "Waiting for" in messages[0] and f"{free_before} of 23 free now" in messages[0]
            assert pool.blocks.num_free == free_before and other.block_tables.tables == held  # nothing taken
            assert not batch.done()
        result = batch.result(timeout=30)  # runs once the other session gives its blocks back
    assert len(result.outputs) == 3 and result.waited_s > 0
    assert len(messages) == 1 and pool.blocks.num_free == pool.blocks.capacity


def test_a_wait_that_runs_out_gets_the_pool_full_message_and_changes_nothing(tiny):
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 24, max_wait_s=0.2)
    pool = pools.pool(16)
    with _hold_most_of(pool, model) as other:
        held = [list(t) for t in other.block_tables.tables]
        free_before = pool.blocks.num_free
        start = time.monotonic()
        with pytest.raises(waiting_line.PoolFullError) as error:
            batch_tab.run_batch(model, tokenizer, pools, BATCH, max_new_tokens=16, block_size=16, block_budget=23)
        assert 0.2 <= time.monotonic() - start < 10
        assert "pool is full" in waiting_line.pool_full_message(error.value) and "waited 0.2 s" in str(error.value)
        assert pool.blocks.num_free == free_before
        assert other.block_tables.tables == held
        assert all(pool.blocks.refcount(b) == 1 for t in held for b in t)
        assert (pools.line(16).waiting, pools.line(16).reserved) == (0, 0)
    result = batch_tab.run_batch(model, tokenizer, pools, BATCH, max_new_tokens=16, block_size=16, block_budget=23)
    assert len(result.outputs) == 3


def test_chat_turn_reuses_the_previous_turns_blocks(tiny):
    model, tokenizer = tiny
    line = shared_pools.SharedPools(model, 64, block_sizes=(16,)).line(16)
    pool = line.pool
    first = chat_tab.run_chat_turn(model, tokenizer, line, [], "Hello, how are you today?", max_new_tokens=8)
    history = [{"role": "user", "content": "Hello, how are you today?"}, {"role": "assistant", "content": first.answer}]
    second = chat_tab.run_chat_turn(model, tokenizer, line, history, "Tell me more.", max_new_tokens=8)
    assert first.reused_tokens == 0
    assert second.reused_tokens >= first.prompt_tokens // 16 * 16 > 0
    assert second.computed_tokens == second.prompt_tokens - second.reused_tokens
    assert pool.blocks.num_free == pool.blocks.capacity
    with pytest.raises(limits.InputError, match="Type a message"):
        chat_tab.run_chat_turn(model, tokenizer, line, history, "   ")


def test_plan_tab_plans_the_demo_model_and_refuses_bad_inputs(tiny, monkeypatch):
    model, _ = tiny  # 2 layers, 2 KV heads of 16
    text = plan_tab.run_plan(model, "tiny", batch_size=4, prompt_lengths="100", new_tokens=28, dtype="float32",
                        block_size=16, max_memory="1MiB")
    per_token = 2 * 2 * 16 * 2 * 4  # layers x KV heads x head dim x (K + V) x float32
    assert f"| 2 | full attention | 2 x (16 + 16) | {per_token:,} B |" in text
    weights = sum(p.numel() for p in model.parameters()) * 4
    rows = (2**20 - weights) // (128 * per_token)  # 100 + 28 tokens per row, every cache alike here
    assert "| DynamicCache | 256 KiB |" in text  # 4 rows x 128 tokens x 512 B
    assert f"| {rows:,} | " in text and "Assumptions:" in text
    ragged = plan_tab.run_plan(model, "tiny", batch_size=99, prompt_lengths="100, 7, 30", new_tokens=2)
    assert "3 rows: prompts of 100, 7, 30 tokens" in ragged  # a list sets the batch size
    monkeypatch.chdir(ROOT)  # where "tests/data" below names a folder
    for change, message in (
        (dict(batch_size=0), "Batch size"),
        (dict(prompt_lengths="12, x"), "prompt length"),
        (dict(new_tokens=-1), "New tokens"),
        (dict(block_size=2.5), "Block size"),
        (dict(dtype="int8"), "dtype must be one of"),
        (dict(max_memory="lots"), "Max memory"),
        (dict(hub_id="/etc"), "local paths are not read"),
        (dict(hub_id="../secrets/x"), "local paths are not read"),
        (dict(hub_id="tests/data"), "local paths are not read"),  # shaped like a Hub id, but a local folder
    ):
        with pytest.raises(limits.InputError, match=message):
            plan_tab.run_plan(model, "tiny", **change)


# config.json files a Hub repository could hold, each beyond what any released model asks
CRAFTED_CONFIGS = [
    ({"model_type": "gemma3_text", "num_hidden_layers": 10**6}, r"num_hidden_layers = 1,000,000 .* at most 256"),
    ({"model_type": "gemma3", "vision_config": {"num_hidden_layers": 2000}}, r"vision_config.num_hidden_layers"),
    ({"model_type": "llama", "num_hidden_layers": 200, "text_config": {"num_hidden_layers": 200}}, "in all"),
    ({"model_type": "llama", "max_position_embeddings": 10**9}, "max_position_embeddings = 1,000,000,000"),
    ({"model_type": "llama", "vocab_size": 10**12}, "vocab_size"),
    ({"model_type": "llama", "num_attention_heads": 10**6, "num_key_value_heads": 10**6}, "num_attention_heads"),
    ({"model_type": "llama", "hidden_size": 2.5}, "hidden_size must be a whole number"),
    ({"model_type": "llama", "num_hidden_layers": -3}, "num_hidden_layers = -3 must not be negative"),
    ({"model_type": "llama", "layer_types": ["full_attention"] * 100_000}, "layer_types has 100,000 items"),
]
LLAMA_3_405B = {  # meta-llama/Llama-3.1-405B's config.json, the sizes that matter: a real model plans as before
    "model_type": "llama", "num_hidden_layers": 126, "hidden_size": 16384, "intermediate_size": 53248,
    "num_attention_heads": 128, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}


def _serve_config(monkeypatch, config: dict) -> None:
    """Make every config read (a Hub id included) return `config`, as if a repository held it."""
    monkeypatch.setattr(PreTrainedConfig, "get_config_dict",
                        classmethod(lambda cls, *args, **kwargs: (copy.deepcopy(config), {})))


@pytest.mark.parametrize(("config", "message"), CRAFTED_CONFIGS)
def test_plan_tab_refuses_a_crafted_config_at_once(tiny, monkeypatch, config, message):
    model, _ = tiny
    _serve_config(monkeypatch, config)
    start = time.perf_counter()
    with pytest.raises(limits.InputError, match=message) as error:
        plan_tab.run_plan(model, "tiny", hub_id="someone/crafted")
    assert time.perf_counter() - start < 0.5  # no config object or meta model was built for it
    assert len(str(error.value)) < 300


def test_plan_tab_plans_a_405b_config_within_a_second(tiny, monkeypatch):
    model, _ = tiny
    _serve_config(monkeypatch, LLAMA_3_405B)
    start = time.perf_counter()
    text = plan_tab.run_plan(model, "tiny", hub_id="meta-llama/Llama-3.1-405B", max_memory="1TiB")
    assert time.perf_counter() - start < 1
    assert "| 126 | full attention | 8 x (128 + 128) | 516,096 B |" in text  # 126 x 8 x 256 x bf16
    assert "405,853,388,800 parameters" in text


class _NoTokenizer:
    """Stands in for the tokenizer where nothing may be tokenized: any use of it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was used ({name}) before the input's length was checked")


def test_long_inputs_are_refused_before_tokenizing(tiny, monkeypatch):
    model, _ = tiny
    tokenizer = _NoTokenizer()
    huge = "x" * 10_000_000  # 10 MB: tokenizing it would take seconds
    pools = shared_pools.SharedPools(model, 16, block_sizes=(16,))
    line = pools.line(16)
    monkeypatch.setattr(plan_tab, "load_config", None)  # the plan must not fetch a config for these either
    monkeypatch.setattr(plan_tab, "plan_memory", None)
    requests = [
        (lambda: batch_tab.run_batch(model, tokenizer, pools, huge), "limit is 32,000"),
        (lambda: batch_tab.run_batch(model, tokenizer, pools, "Hi!", system_prompt=huge), "limit is 1,000"),
        (lambda: batch_tab.run_batch(model, tokenizer, pools, "Hi!\n" + "y" * 2001), "limit is 2000"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, [], huge), "limit is 2,000"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, [], "Hi!", system_prompt=huge), "limit is 1,000"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, [{"role": "user", "content": "Hi"},
                                                            {"role": "assistant", "content": huge}], "Hi!"),
         "limit is 16,384"),
        (lambda: plan_tab.run_plan(model, "tiny", hub_id=huge), "limit is 200"),
        (lambda: plan_tab.run_plan(model, "tiny", prompt_lengths=huge), "limit is 65,536"),
        (lambda: plan_tab.run_plan(model, "tiny", max_memory=huge), "limit is 32"),
        (lambda: plan_tab.run_plan(model, "tiny", dtype=huge), "dtype must be one of"),
        (lambda: plan_tab.run_plan(model, "tiny", batch_size="9" * 10_000_000), "Batch size must be a number"),
    ]
    start = time.perf_counter()
    for request, message in requests:
        with pytest.raises(limits.InputError, match=message) as error:
            request()
        assert len(str(error.value)) < 200  # the input is never echoed in full
    assert time.perf_counter() - start < 5  # was 9 s for one 10 MB system prompt
    assert pools.pool(16).blocks.num_free == pools.pool(16).blocks.capacity


def test_none_inputs_get_friendly_messages(tiny):
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 64, block_sizes=(16,))
    line = pools.line(16)
    for request, message in (
        (lambda: batch_tab.run_batch(model, tokenizer, pools, None), "Enter at least one prompt"),
        (lambda: batch_tab.run_batch(model, tokenizer, pools, "Hi!", max_new_tokens=None), "max_new_tokens must be a"),
        (lambda: batch_tab.run_batch(model, tokenizer, pools, "Hi!", block_size=None), "Block size must be a number"),
        (lambda: batch_tab.run_batch(model, tokenizer, pools, "Hi!", block_budget=None), "Block budget must be a"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, None, None), "Type a message first"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, [None], "Hi!"), "press Clear"),
        (lambda: chat_tab.run_chat_turn(model, tokenizer, line, None, "Hi!", max_new_tokens=None), "max_new_tokens"),
        (lambda: plan_tab.run_plan(model, "tiny", prompt_lengths=None), "Enter a prompt length"),
        (lambda: plan_tab.run_plan(model, "tiny", batch_size=None), "Batch size must be a number"),
        (lambda: plan_tab.run_plan(model, "tiny", new_tokens=None), "New tokens must be a number"),
        (lambda: plan_tab.run_plan(model, "tiny", block_size=None), "Block size must be a number"),
        (lambda: plan_tab.run_plan(model, "tiny", dtype=None), "dtype must be one of"),
        (lambda: plan_tab.run_plan(model, "tiny", max_memory=None), "Enter the max memory"),
    ):
        with pytest.raises(limits.InputError, match=message):
            request()
    # an empty optional text (None) is simply empty
    assert batch_tab.run_batch(model, tokenizer, pools, "Hi!", system_prompt=None, max_new_tokens=2,
                               block_budget=63).outputs
    assert chat_tab.run_chat_turn(model, tokenizer, line, None, "Hi!", system_prompt=None, max_new_tokens=2).answer
    assert "rows that fit" in plan_tab.run_plan(model, "tiny", hub_id=None)
    # the page's handlers: a message, not a stack trace
    demo = layout.build_app(model, tokenizer, pools=pools, model_name="tiny")
    on_chat = next(f.fn for f in demo.fns.values() if f.name == "on_chat")
    with pytest.raises(gr.Error, match="Type a message first"):
        on_chat(None, None, None, None, None)
    on_batch = next(f.fn for f in demo.fns.values() if f.name == "on_batch")
    with pytest.raises(gr.Error, match="Enter at least one prompt"):
        on_batch(None, None, None, None, None, None)


MARKUP = "<img src=x onerror=alert(1)>"  # in a message rendered as HTML, an image whose error handler runs
ESCAPED = "&lt;img src=x onerror=alert(1)&gt;"


def test_messages_shown_in_the_page_escape_html():
    assert limits.as_page_text(f"got {MARKUP!r} & more") == f"got &#x27;{ESCAPED}&#x27; &amp; more"
    assert limits.as_page_text(limits.InputError("a <b>bold</b> claim")) == "a &lt;b&gt;bold&lt;/b&gt; claim"


def test_error_toasts_built_from_user_input_show_html_as_text(tiny):
    model, tokenizer = tiny
    pools = shared_pools.SharedPools(model, 16, block_sizes=(16,))
    demo = layout.build_app(model, tokenizer, pools=pools, model_name="tiny")
    handlers = {f.name: f.fn for f in demo.fns.values()}
    for name, call in (
        ("Hub id", lambda: handlers["on_plan"](MARKUP, 4, "100", 8, "float32", 16, "1GiB")),
        ("max memory", lambda: handlers["on_plan"]("", 4, "100", 8, "float32", 16, MARKUP)),
        ("prompt lengths", lambda: handlers["on_plan"]("", 4, MARKUP, 8, "float32", 16, "1GiB")),
        ("batch max_new_tokens", lambda: handlers["on_batch"]("Hi!", None, MARKUP, 16, 8, True)),
        ("chat max_new_tokens", lambda: handlers["on_chat"]("Hi!", [], [], None, MARKUP)),
    ):
        with pytest.raises(gr.Error) as error:
            call()
        assert ESCAPED in error.value.message and "<img" not in error.value.message, name


CHATS = ("Hello, how are you today?", "What is a KV cache?")
BATCHES = (BATCH, "Name a colour.\nName a fruit, then a vegetable, then a tree.\nName a planet.")


def test_four_concurrent_requests_wait_their_turn_and_match_sequential_outputs(tiny):
    model, tokenizer = tiny
    chat = dict(system_prompt="Be brief.", max_new_tokens=8)
    batch = dict(system_prompt="Be brief and kind.", max_new_tokens=6, block_size=16)

    def run_all(pools, on_wait=None):
        """Two chat turns and two batches on the pool of 16-token blocks, one request per thread."""
        with ThreadPoolExecutor(4) as executor:
            chats = [executor.submit(chat_tab.run_chat_turn, model, tokenizer, pools.line(16), [], text, **chat,
                                     on_wait=on_wait) for text in CHATS]
            batches = [executor.submit(batch_tab.run_batch, model, tokenizer, pools, text, **batch,
                                       block_budget=pools.pool(16).blocks.capacity, on_wait=on_wait)
                       for text in BATCHES]
            return [f.result(timeout=60).answer for f in chats], [f.result(timeout=60).outputs for f in batches]

    sequential = shared_pools.SharedPools(model, 64, block_sizes=(16,))
    line = sequential.line(16)
    expected = ([chat_tab.run_chat_turn(model, tokenizer, line, [], text, **chat).answer for text in CHATS],
                [batch_tab.run_batch(model, tokenizer, sequential, text, **batch, block_budget=63).outputs
                 for text in BATCHES])

    # 18 blocks: the batches need 13 and 10 at worst, the chat turns 5 and 4, so the batches never run together
    pools = shared_pools.SharedPools(model, 19, block_sizes=(16,))
    line, messages = pools.line(16), []
    with ThreadPoolExecutor(1) as starter, line.admit(line.pool.blocks.capacity):  # the pool taken, for now
        results = starter.submit(run_all, pools, messages.append)
        deadline = time.monotonic() + 30
        while line.waiting < 4:  # all four queue up behind the request holding the pool
            assert time.monotonic() < deadline and not results.done(), "the requests did not queue"
            time.sleep(0.01)
    assert results.result(timeout=60) == expected  # none was told the pool is full
    assert len(messages) == 4 and all(m.startswith("Waiting for") for m in messages)
    assert pools.pool(16).blocks.num_free == pools.pool(16).blocks.capacity and line.reserved == 0


def test_a_request_bigger_than_the_whole_pool_is_refused_at_once(tiny):
    model, tokenizer = tiny
    line = shared_pools.SharedPools(model, 4, block_sizes=(16,)).line(16)  # 3 blocks of 16 tokens
    waits = []
    start = time.monotonic()
    with pytest.raises(waiting_line.PoolFullError, match="more than the whole pool holds") as error:
        chat_tab.run_chat_turn(model, tokenizer, line, [],
                               "A message longer than the three blocks of this little pool.",
                               max_new_tokens=8, on_wait=waits.append)
    assert time.monotonic() - start < limits.MAX_WAIT_S / 3 and not waits  # no waiting: it could never fit
    assert "pool is full" in waiting_line.pool_full_message(error.value)
    assert line.pool.blocks.num_free == line.pool.blocks.capacity and (line.waiting, line.reserved) == (0, 0)


def test_the_waiting_line_is_bounded(tiny):
    model, _ = tiny
    line = waiting_line.WaitingLine(shared_pools.SharedPools(model, 8, block_sizes=(16,)).pool(16), max_waiting=2)

    def wait_for_one_block():
        with line.admit(1):
            return True

    with ThreadPoolExecutor(2) as executor:
        with line.admit(7):  # the whole pool
            waiters = [executor.submit(wait_for_one_block) for _ in range(2)]
            deadline = time.monotonic() + 30
            while line.waiting < 2:
                assert time.monotonic() < deadline, "the waiters did not queue"
                time.sleep(0.01)
            start = time.monotonic()
            with pytest.raises(waiting_line.PoolFullError, match="2 requests are already waiting"):
                with line.admit(1):
                    pass
            assert time.monotonic() - start < 5  # refused at once, not after a wait
        assert all(w.result(timeout=30) for w in waiters)  # those in line run once the pool is given back
    assert (line.waiting, line.reserved) == (0, 0)


def test_gradio_queue_is_bounded(tiny):
    model, tokenizer = tiny
    demo = layout.build_app(model, tokenizer, pools=shared_pools.SharedPools(model, 8), concurrency=3, queue_size=5)
    assert (demo._queue.max_size, demo._queue.default_concurrency_limit) == (5, 3)
    chat = [f for f in demo.fns.values() if f.name == "on_chat"]
    assert len(chat) == 2 and {(f.concurrency_id, f.concurrency_limit) for f in chat} == {("chat", 3)}


def test_help_shows_every_default_once(capsys):
    from script_loading import option_blocks

    with pytest.raises(SystemExit) as exit_info:
        app.main(["--help"])
    assert exit_info.value.code == 0
    blocks = option_blocks(capsys.readouterr().out)
    assert {"--host HOST", "--port PORT", "--device DEVICE", "--concurrency CONCURRENCY"} <= set(blocks)
    for option, text in blocks.items():
        expected = 0 if option.startswith("-h") or " " not in option else 1  # flags show no default
        assert text.lower().count("(default:") == expected == text.lower().count("default"), (option, text)


# --------------------------------------------------------------------------- the page in a browser


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    if not CHROMIUM.is_file():
        pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install -y chromium, or set $CHROMIUM)")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def served(browser, tiny) -> Iterator[tuple[str, shared_pools.SharedPools, PreTrainedModel]]:
    if REAL_MODEL:
        from hf_paged_cache.models.default_model import (
            DEFAULT_MODEL,
            load_model_and_tokenizer,
        )

        (model, tokenizer), name = load_model_and_tokenizer(), DEFAULT_MODEL
    else:
        (model, tokenizer), name = tiny, "tiny random Llama (test)"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
        pools = shared_pools.SharedPools(model, 128)
        demo = layout.build_app(model, tokenizer, pools=pools, model_name=name)
        port = _free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        try:
            yield f"http://127.0.0.1:{port}/", pools, model
        finally:
            demo.close()


def fill_once_mounted(field, initial: str, text: str) -> None:
    """Fill a Gradio text field once it shows its `initial` value, and wait until it holds `text`.

    Gradio mounts a tab's fields when the tab is first shown (the page's first tab on load); a field filled
    before its mount ends can get its initial value back, and the request then runs with it. Showing the
    initial value does not prove the mount over (seen once in four runs: the fill was undone at once), so a
    fill that is undone is made again, three times at most.
    """
    from playwright.sync_api import expect

    expect(field).to_have_value(initial)
    for _ in range(2):
        field.fill(text)
        try:
            expect(field).to_have_value(text, timeout=5_000)
            return
        except AssertionError:
            pass  # the mount put the initial value back: fill again
    field.fill(text)
    expect(field).to_have_value(text)


def test_browser_batch_pool_picture_memory_and_chat(browser, served, tmp_path):
    url, pools, model = served
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    page.goto(url)

    # a ragged batch of 3 prompts
    fill_once_mounted(page.locator("#batch-prompts textarea"), "\n".join(prompts.DEFAULT_PROMPTS), BATCH)
    if not REAL_MODEL:  # the tiny model reads 256 characters at most
        fill_once_mounted(page.locator("#batch-system textarea"), prompts.DEFAULT_SYSTEM,
                          "Be brief and kind; answer in one sentence.")
    page.locator("#run-batch").click()
    rows = page.locator("#batch-outputs tr.batch-row")
    rows.nth(2).wait_for()
    assert rows.count() == 3
    assert "What is the capital of France?" in rows.nth(1).inner_text()
    assert page.locator("#batch-outputs td.batch-output").nth(1).inner_text().strip()
    grid = page.locator("#pool-grid img")
    grid.wait_for()
    assert grid.evaluate("img => img.naturalWidth") > 500  # the pool picture really rendered
    page.locator("#memory-chart img").wait_for()
    numbers = page.locator("#memory-numbers").inner_text()
    for needle in ("PagedCache", "DynamicCache", "StaticCache", "utilization"):
        assert needle in numbers
    assert re.search(r"PagedCache utilization: \d+(\.\d)?%", numbers)
    assert "ran 3 prompts" in page.locator("#batch-status").inner_text()
    page.wait_for_function(
        "() => [...document.querySelectorAll('#pool-grid img, #memory-chart img')]"
        ".every(img => img.complete && img.naturalWidth > 0)"
    )
    shot = tmp_path / "space_screenshot.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 20_000
    if REAL_MODEL:
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        shutil.copyfile(shot, DOCS_SCREENSHOT)

    # too many prompts: a clear message in the page, no stack trace
    page.locator("#batch-prompts textarea").fill("\n".join(f"prompt {i}" for i in range(9)))
    page.locator("#run-batch").click()
    page.get_by_text("At most 8 prompts per batch; got 9.").first.wait_for()
    assert "Traceback" not in page.content()

    # another session holds nearly the whole pool: this request waits, saying so, and runs once it is free
    with PagedCache(model, pool=pools.pool(16)) as other:
        model.generate(**ragged_batch([0] * 7 + [10], 240), cache=other, max_new_tokens=1, do_sample=False)
        assert pools.pool(16).blocks.num_free < 10
        held = [list(t) for t in other.block_tables.tables]
        page.locator("#batch-prompts textarea").fill(BATCH)
        page.locator("#run-batch").click()
        page.get_by_text("other sessions are using").first.wait_for()  # the waiting message
        assert other.block_tables.tables == held
        assert "pool is full" not in page.locator("#batch-status").inner_text()
    page.locator("#batch-status", has_text="after waiting").wait_for()
    assert "ran 3 prompts" in page.locator("#batch-status").inner_text()
    assert rows.count() == 3

    # two sessions at once on the same pools: both get their answers, and every block comes back
    other_page = browser.new_page()
    other_page.set_default_timeout(60_000)
    other_page.goto(url)
    fill_once_mounted(other_page.locator("#batch-prompts textarea"), "\n".join(prompts.DEFAULT_PROMPTS),
                      "Name a colour.\nName a fruit.")
    if not REAL_MODEL:
        fill_once_mounted(other_page.locator("#batch-system textarea"), prompts.DEFAULT_SYSTEM, "Be brief.")
    page.locator("#batch-prompts textarea").fill(BATCH + "\nName a planet.")
    other_page.locator("#run-batch").click()
    page.locator("#run-batch").click()
    other_page.locator("#batch-status", has_text="ran 2 prompts").wait_for()
    page.locator("#batch-status", has_text="ran 4 prompts").wait_for()
    assert other_page.locator("#batch-outputs tr.batch-row").count() == 2
    assert rows.count() == 4
    other_page.close()
    assert all(pool.blocks.num_free == pool.blocks.capacity for pool in map(pools.pool, pools.block_sizes))

    # chat: the second turn reuses the first turn's blocks
    page.get_by_role("tab", name="Chat").click()
    # a short system prompt keeps the tiny model's 256-token context enough (the default one would not)
    fill_once_mounted(page.locator("#chat-system textarea"), prompts.DEFAULT_SYSTEM, "Be brief.")
    for turn, message in enumerate(("Hello! What is a KV cache?", "Why split it into blocks?"), start=1):
        fill_once_mounted(page.locator("#chat-input textarea"), "", message)
        page.locator("#chat-send").click()
        page.locator("#chat-stats tbody tr").nth(turn - 1).wait_for()
    cells = [row.locator("td").all_inner_texts() for row in page.locator("#chat-stats tbody tr").all()]
    assert [c[0] for c in cells] == ["1", "2"]
    prompt_1, reused_1, reused_2 = int(cells[0][1]), int(cells[0][2]), int(cells[1][2])
    assert reused_1 < prompt_1  # turn 1 can only reuse blocks other requests cached (e.g. the system prompt)
    assert reused_2 >= prompt_1 // 16 * 16 and reused_2 > reused_1  # turn 2 reuses turn 1's whole blocks
    assert int(cells[1][3]) == int(cells[1][1]) - int(cells[1][2])  # computed = prompt - reused
    assert page.locator("#chat-box").inner_text().count("KV cache") >= 1
    page.screenshot(path=str(tmp_path / "space_chat.png"), full_page=True)
    page.close()


def test_browser_plan_tab(browser, served):
    url, _, _ = served
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    page.goto(url)
    page.get_by_role("tab", name="Plan").click()
    output = page.locator("#plan-output")
    output.get_by_text("rows that fit in 24 GiB").wait_for()  # the demo model's plan, shown on load
    fill_once_mounted(page.locator("#plan-lengths textarea, #plan-lengths input").first, "512", "100, 7, 30")
    page.locator("#run-plan").click()
    output.get_by_text("3 rows: prompts of 100, 7, 30 tokens").wait_for()
    assert "PagedCache" in output.inner_text() and "Assumptions" in output.inner_text()
    fill_once_mounted(page.locator("#plan-hub-id textarea, #plan-hub-id input").first, "", "/etc/passwd")
    page.locator("#run-plan").click()
    page.get_by_text("local paths are not read").first.wait_for()
    assert "Traceback" not in page.content()
    # markup in an input comes back in the error toast as text, not as an element
    page.locator("#plan-hub-id textarea, #plan-hub-id input").first.fill(MARKUP)
    page.locator("#run-plan").click()
    toast = page.locator("[data-testid='toast-text']", has_text="onerror").first
    toast.wait_for(timeout=20_000)
    assert MARKUP in toast.inner_text()
    assert page.locator("[data-testid='toast-text'] img").count() == 0
    page.close()
