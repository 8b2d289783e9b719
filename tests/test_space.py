"""The Space demo (scripts/space/app.py): its request logic on a tiny model, then the page in a real browser.

The browser test drives Debian's Chromium (``/usr/bin/chromium``, or ``$CHROMIUM``) through Playwright; it is
skipped, saying why, where either cannot be found. By default the app runs on a tiny random model (fast) and
the screenshot goes to pytest's tmp folder only. To remake the README's screenshot with the real default
model (SmolLM2-135M-Instruct), run

    HF_PAGED_CACHE_SPACE_REAL_MODEL=1 OMP_NUM_THREADS=1 python -m pytest tests/test_space.py -k browser

which also writes ``docs/space_screenshot.png`` (about two minutes on a CPU; one thread is much faster than
torch's default on a busy machine).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

pytest.importorskip("gradio", reason="the Space needs gradio: pip install 'gradio==6.31.0' matplotlib")
pytest.importorskip("matplotlib", reason="the Space needs matplotlib: pip install matplotlib")

from hf_paged_cache import PagedCache, PoolExhaustedError  # noqa: E402
from tiny_models import ragged_batch, tiny_model, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SPACE_DIR = ROOT / "scripts" / "space"
DOCS_SCREENSHOT = ROOT / "docs" / "space_screenshot.png"
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
REAL_MODEL = os.environ.get("HF_PAGED_CACHE_SPACE_REAL_MODEL") == "1"

if str(SPACE_DIR) not in sys.path:
    sys.path.insert(0, str(SPACE_DIR))  # app.py imports pool_view.py from beside it, as on a Space
_spec = importlib.util.spec_from_file_location("space_app", SPACE_DIR / "app.py")
app = importlib.util.module_from_spec(_spec)
sys.modules["space_app"] = app  # dataclasses look their module up while the class is built
_spec.loader.exec_module(app)
from pool_view import BlockKind, block_states, compare_memory  # noqa: E402

BATCH = "Hi!\nWhat is the capital of France?\nGive three tips for learning a new language, one short sentence each."


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


# --------------------------------------------------------------------------- request logic (no browser)


def test_shared_prefix_is_whole_blocks_and_leaves_each_row_a_token():
    rows = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 5, 6, 9, 9], [1, 2, 3, 4, 5, 6]]
    assert app.shared_prefix_length(rows, 4) == 4  # 6 common, cut to whole blocks
    assert app.shared_prefix_length(rows, 2) == 4  # 6 common but the shortest row keeps 1 token
    assert app.shared_prefix_length(rows[:1], 2) == 0  # nothing to share with one row
    # rows of 9 and 5 tokens, 4 new tokens (3 stored), blocks of 4, 4 shared: 1 + ceil(8/4) + ceil(4/4)
    assert app.blocks_needed([9, 5], 4, 4, shared=4) == 1 + 2 + 1
    assert app.blocks_needed([9, 5], 4, 4, shared=0) == 3 + 2


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
    pools = app.SharedPools(model, 64)
    kwargs = dict(system_prompt="A system prompt long enough to fill a few blocks of eight characters.",
                  max_new_tokens=6, block_size=8, block_budget=63)
    shared = app.run_batch(model, tokenizer, pools, BATCH, share_prefix=True, **kwargs)
    private = app.run_batch(model, tokenizer, pools, BATCH, share_prefix=False, **kwargs)
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
    with pytest.raises(app.InputError, match=message):
        app.run_batch(model, tokenizer, app.SharedPools(model, 41), **request)


def test_full_pool_fails_alone_and_changes_nothing(tiny):
    model, tokenizer = tiny
    pools = app.SharedPools(model, 24)
    pool = pools.pool(16)
    with PagedCache(model, pool=pool) as other:  # another session holding most of the pool
        model.generate(**ragged_batch([0, 2], 80), cache=other, max_new_tokens=4, do_sample=False)
        held = [list(t) for t in other.block_tables.tables]
        free_before = pool.blocks.num_free
        with pytest.raises(PoolExhaustedError) as error:
            app.run_batch(model, tokenizer, pools, BATCH, max_new_tokens=16, block_size=16, block_budget=23)
        assert "pool is full" in app.pool_full_message(error.value)
        assert pool.blocks.num_free == free_before
        assert other.block_tables.tables == held
        assert all(pool.blocks.refcount(b) == 1 for t in held for b in t)
    result = app.run_batch(model, tokenizer, pools, BATCH, max_new_tokens=16, block_size=16, block_budget=23)
    assert len(result.outputs) == 3


def test_chat_turn_reuses_the_previous_turns_blocks(tiny):
    model, tokenizer = tiny
    pool = app.SharedPools(model, 64, block_sizes=(16,)).pool(16)
    first = app.run_chat_turn(model, tokenizer, pool, [], "Hello, how are you today?", max_new_tokens=8)
    history = [{"role": "user", "content": "Hello, how are you today?"}, {"role": "assistant", "content": first.answer}]
    second = app.run_chat_turn(model, tokenizer, pool, history, "Tell me more.", max_new_tokens=8)
    assert first.reused_tokens == 0
    assert second.reused_tokens >= first.prompt_tokens // 16 * 16 > 0
    assert second.computed_tokens == second.prompt_tokens - second.reused_tokens
    assert pool.blocks.num_free == pool.blocks.capacity
    with pytest.raises(app.InputError, match="Type a message"):
        app.run_chat_turn(model, tokenizer, pool, history, "   ")


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
def served(browser, tiny) -> Iterator[tuple[str, app.SharedPools, PreTrainedModel]]:
    if REAL_MODEL:
        from hf_paged_cache.models.default_model import DEFAULT_MODEL, load_model_and_tokenizer

        (model, tokenizer), name = load_model_and_tokenizer(), DEFAULT_MODEL
    else:
        (model, tokenizer), name = tiny, "tiny random Llama (test)"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRADIO_ANALYTICS_ENABLED", "False")
        pools = app.SharedPools(model, 128)
        demo = app.build_app(model, tokenizer, pools=pools, model_name=name)
        port = _free_port()
        demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True)
        try:
            yield f"http://127.0.0.1:{port}/", pools, model
        finally:
            demo.close()


def test_browser_batch_pool_picture_memory_and_chat(browser, served, tmp_path):
    url, pools, model = served
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    page.goto(url)

    # a ragged batch of 3 prompts
    page.locator("#batch-prompts textarea").fill(BATCH)
    if not REAL_MODEL:  # the tiny model reads 256 characters at most
        page.locator("#batch-system textarea").fill("Be brief and kind; answer in one sentence.")
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

    # another session holds nearly the whole pool: this request is told, the other one keeps its blocks
    with PagedCache(model, pool=pools.pool(16)) as other:
        model.generate(**ragged_batch([0] * 7 + [10], 240), cache=other, max_new_tokens=1, do_sample=False)
        assert pools.pool(16).blocks.num_free < 10
        held = [list(t) for t in other.block_tables.tables]
        page.locator("#batch-prompts textarea").fill(BATCH)
        page.locator("#run-batch").click()
        page.locator("#batch-status", has_text="pool is full").wait_for()
        assert rows.count() == 0
        assert other.block_tables.tables == held
    page.locator("#run-batch").click()
    page.locator("#batch-status", has_text="ran 3 prompts").wait_for()
    assert rows.count() == 3

    # two sessions at once on the same pools: both get their answers, and every block comes back
    other_page = browser.new_page()
    other_page.set_default_timeout(60_000)
    other_page.goto(url)
    other_page.locator("#batch-prompts textarea").fill("Name a colour.\nName a fruit.")
    if not REAL_MODEL:
        other_page.locator("#batch-system textarea").fill("Be brief.")
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
    page.locator("#chat-system textarea").fill("Be brief.")  # keeps the tiny model's 256-token context enough
    for turn, message in enumerate(("Hello! What is a KV cache?", "Why split it into blocks?"), start=1):
        page.locator("#chat-input textarea").fill(message)
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
