"""`release_openmp_pool`: the calling thread's OpenMP workers end, and a batcher started on a thread that ran
parallel torch work ends that thread's workers."""

import os
import threading
import time

import pytest
import torch
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.kernels.openmp_pool import _loaded_libgomp, release_openmp_pool

pytestmark = pytest.mark.skipif(_loaded_libgomp() is None, reason="PyTorch runs another OpenMP runtime here")


def on_a_thread_of_its_own(fn):
    """`fn()` on a new thread at 2 torch threads (the thread count restored after), its result returned."""
    out = {}

    def target():
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            out["result"] = fn()
        finally:
            torch.set_num_threads(before)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return out["result"]


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_settle_at(expected: int) -> int:
    """The thread count once it is `expected` (threads of earlier tests may still be ending), or after 5 s."""
    deadline = time.monotonic() + 5
    while threads_now() != expected and time.monotonic() < deadline:
        time.sleep(0.01)
    return threads_now()


def parallel_work() -> None:
    torch.randn(512, 512) @ torch.randn(512, 512)
    torch.randn(1 << 20).exp_()


def test_the_calling_threads_workers_end():
    def run():
        parallel_work()
        with_pool = threads_now()
        assert release_openmp_pool()
        without = threads_settle_at(with_pool - 1)
        parallel_work()  # a new pool, on demand
        return with_pool, without, threads_settle_at(with_pool)

    with_pool, without, again = on_a_thread_of_its_own(run)
    assert without == with_pool - 1  # the one worker of a 2-thread pool
    assert again == with_pool
    assert release_openmp_pool()  # a thread without a pool: nothing to end


def test_a_batcher_ends_the_workers_of_the_thread_that_starts_it():
    model = tiny_model("llama")

    def run():
        parallel_work()
        with_pool = threads_now()
        with ContinuousBatcher(model) as batcher:
            batcher.submit([5, 6, 7], max_new_tokens=2).result(timeout=60)
            started = threads_settle_at(with_pool + 1)
        return with_pool, started

    with_pool, started = on_a_thread_of_its_own(run)
    # the loop's thread and its worker came, this thread's worker went
    assert started == with_pool - 1 + 2
