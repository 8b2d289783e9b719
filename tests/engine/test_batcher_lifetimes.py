"""Lifetimes around the batcher: cancellation, a bounded queue, sleeping instead of spinning, handles read by
several threads, readers of its caches, close(timeout) and a batcher dropped without close()."""

import gc
import threading
import time

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, requests, wait_until
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher, KVPool, PagedCache, QueueFullError, RequestCancelled


def test_cancel_mid_stream_ends_the_handle_and_gives_the_blocks_back():
    model = tiny_model("llama")
    prompt = list(range(3, 3 + 33))  # 8 full blocks of 4, then one more token
    with ContinuousBatcher(model, block_size=4, num_blocks=64) as batcher:
        handle = batcher.submit(prompt, max_new_tokens=100)
        tokens = []
        with pytest.raises(RequestCancelled):
            for token in handle:
                tokens.append(token)
                if len(tokens) == 3:
                    handle.cancel()
        assert tokens[:3] == alone(model, prompt, max_new_tokens=3) and len(tokens) < 100
        with pytest.raises(RequestCancelled):
            handle.result(timeout=1)
        handle.cancel()  # again: nothing happens
        assert_pool_empty(batcher)  # its blocks went back...
        assert batcher.pool.blocks.prefix_stats().cached_blocks >= 8  # ...and the full ones stay findable
        stats = batcher.stats()
        assert (stats.cancelled, stats.running, stats.finished) == (1, 0, 0)
        done = batcher.submit(prompt, max_new_tokens=2)
        assert done.result(timeout=60) == alone(model, prompt, max_new_tokens=2)
        done.cancel()  # a finished request: a no-op
        assert done.result() == alone(model, prompt, max_new_tokens=2)
        assert batcher.stats().prefix_hit_tokens == 32  # the second request reused the 8 blocks


def test_cancel_from_many_threads_while_waiting_prefilling_or_running():
    model = tiny_model("llama")
    work = requests(24, seed=21)
    with ContinuousBatcher(model, block_size=4, max_running=6, max_step_tokens=16) as batcher:
        handles = [batcher.submit(prompt, max_new_tokens=16) for prompt, _ in work]
        doomed = handles[1::2]  # some are running, some prefilling, some waiting when cancelled

        def cancel_all():
            for handle in doomed:
                handle.cancel()
                handle.cancel()

        threads = [threading.Thread(target=cancel_all) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index, handle in enumerate(handles):
            if index % 2:
                try:
                    handle.result(timeout=60)  # it may have finished before its cancellation came
                except RequestCancelled:
                    pass
            else:
                assert handle.result(timeout=60) == alone(model, work[index][0], max_new_tokens=16)
        stats = batcher.stats()
        assert stats.cancelled + stats.finished == 24 and stats.cancelled > 0
    assert_pool_empty(batcher)


def test_max_waiting_refuses_what_would_wait_beyond_it():
    model = tiny_model("llama")
    with ContinuousBatcher(model, block_size=4, max_waiting=3) as batcher:
        with batcher._inbox._changed:  # the loop takes nothing meanwhile: all three wait
            handles = [batcher.submit([5, 6, 7], max_new_tokens=2) for _ in range(3)]
            with pytest.raises(QueueFullError, match="3 requests already wait"):
                batcher.submit([5, 6, 7], max_new_tokens=2)
        assert [h.result(timeout=60) for h in handles] == [alone(model, [5, 6, 7], max_new_tokens=2)] * 3
        assert batcher.submit([5, 6, 7], max_new_tokens=2).result(timeout=60)  # room again


def test_a_request_waiting_for_blocks_held_elsewhere_sleeps_until_they_come_back():
    """Another cache holds the whole pool: the loop sleeps (before this change it spun a whole core), and the
    request starts as soon as the blocks are released."""
    model = tiny_model("llama")
    pool = KVPool.for_config(model.config, num_blocks=12, block_size=4)
    other = PagedCache(model, pool=pool)
    with torch.no_grad():
        model(input_ids=torch.arange(3, 3 + 44).unsqueeze(0), cache=other)  # 11 blocks: all of them
    with ContinuousBatcher(model, pool=pool) as batcher:
        handle = batcher.submit([5, 6, 7], max_new_tokens=3)
        wait_until(lambda: batcher._thread is not None and batcher.stats().waiting == 1)
        clock = time.pthread_getcpuclockid(batcher._thread.ident)
        before = time.clock_gettime(clock)
        time.sleep(0.5)
        busy = time.clock_gettime(clock) - before
        assert busy < 0.05, f"the waiting loop used {busy:.2f} s of CPU in 0.5 s"
        assert not handle.done()
        other.release()
        assert handle.result(timeout=60) == alone(model, [5, 6, 7], max_new_tokens=3)


def test_two_threads_iterating_one_handle_both_get_every_token():
    model = tiny_model("llama")
    prompt = requests(1, seed=22)[0][0]
    with ContinuousBatcher(model, block_size=4) as batcher:
        handle = batcher.submit(prompt, max_new_tokens=12)
        streams = [[], []]
        readers = [threading.Thread(target=lambda out=out: out.extend(handle)) for out in streams]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(timeout=60)
        assert not any(reader.is_alive() for reader in readers)  # before this change one of them hung
        assert streams[0] == streams[1] == handle.result() == alone(model, prompt, max_new_tokens=12)


def test_readers_on_other_threads_never_change_a_step():
    """stats(), the running cache's stats / seq length / repr read in a tight loop from two threads while the
    batcher serves: every request exact (before this change readers rolled steps back: wrong tokens)."""
    model = tiny_model("gemma3_text")
    work = requests(16, seed=23)
    expected = [alone(model, prompt, max_new_tokens=new) for prompt, new in work]
    with ContinuousBatcher(model, block_size=4, max_step_tokens=24) as batcher:
        stop = threading.Event()

        def read():
            while not stop.is_set():
                batcher.stats()
                batcher.running_cache.stats()
                batcher.running_cache.get_seq_length()
                repr(batcher.running_cache)

        readers = [threading.Thread(target=read) for _ in range(2)]
        for reader in readers:
            reader.start()
        try:
            handles = [batcher.submit(prompt, max_new_tokens=new) for prompt, new in work]
            assert [h.result(timeout=120) for h in handles] == expected
        finally:
            stop.set()
            for reader in readers:
                reader.join()
    assert_pool_empty(batcher)


@pytest.mark.parametrize("tokens_first", [1, 2, 3, 4])
def test_without_reservation_a_long_prefill_never_preempts_a_running_row(tokens_first):
    """Two requests decode while a long prompt (one new token: it never runs) prefills in small chunks on a
    pool that holds the two at their longest but not the prompt beside them. The prompt gives way: it goes
    back to the queue, and no running request is preempted. Before this change the prompt's chunks kept the
    blocks and a running row was preempted (1 of the 4 arrival times here)."""
    model = tiny_model("llama")
    shorts, long_prompt = [[5, 6, 7], [8, 9, 10, 11]], [3 + (i % 90) for i in range(60)]
    with ContinuousBatcher(model, block_size=4, num_blocks=24, max_step_tokens=4, reserve_new_tokens=False) as batcher:
        running = [batcher.submit(prompt, max_new_tokens=28) for prompt in shorts]  # 8 blocks each at their longest
        wait_until(lambda: len(running[-1]._output) >= tokens_first)
        prompt = batcher.submit(long_prompt, max_new_tokens=1)  # 15 blocks
        assert [h.result(timeout=120) for h in running] == [alone(model, p, max_new_tokens=28) for p in shorts]
        assert prompt.result(timeout=120) == alone(model, long_prompt, max_new_tokens=1)
        assert batcher.stats().preemptions == 0
    assert_pool_empty(batcher)


def test_close_with_a_timeout_lets_requests_finish_then_fails_the_rest():
    model = tiny_model("llama")
    work = requests(4, seed=24)
    batcher = ContinuousBatcher(model, block_size=4)
    quick = [batcher.submit(prompt, max_new_tokens=3) for prompt, _ in work]
    batcher.close(timeout=60)
    assert [h.result() for h in quick] == [alone(model, p, max_new_tokens=3) for p, _ in work]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit([5, 6])
    assert_pool_empty(batcher)

    batcher = ContinuousBatcher(model, block_size=4, max_running=1)
    slow = [batcher.submit(prompt, max_new_tokens=200) for prompt, _ in work]
    started = time.monotonic()
    batcher.close(timeout=0.2)
    assert time.monotonic() - started < 30
    with pytest.raises(RuntimeError, match="closed before this request finished"):
        slow[-1].result(timeout=1)
    assert all(h.done() for h in slow)
    assert_pool_empty(batcher)


def test_a_batcher_dropped_without_close_finishes_its_requests_then_ends_its_thread():
    """Before this change its loop thread held it: it was never collected and the thread ran on."""
    model = tiny_model("llama")
    pool = KVPool.for_config(model.config, num_blocks=64, block_size=4)
    batcher = ContinuousBatcher(model, pool=pool)
    handle = batcher.submit([5, 6, 7, 8], max_new_tokens=6)
    thread = batcher._thread
    del batcher
    gc.collect()
    assert handle.result(timeout=60) == alone(model, [5, 6, 7, 8], max_new_tokens=6)
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert pool.blocks.num_used == 0
