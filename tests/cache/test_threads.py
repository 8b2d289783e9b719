"""Many caches on one pool, used from concurrent threads."""

import threading

import torch

from hf_paged_cache import KVPool, PagedCache, PoolExhaustedError
from tiny_models import ragged_batch, tiny_model

MODEL = tiny_model("qwen2")
THREADS, CALLS = 8, 5


def request(thread: int, call: int) -> dict:
    """Thread `thread`'s call `call`: a ragged 2-row batch and a length, all different."""
    batch = ragged_batch([0, (thread + call) % 5], 6 + 3 * call + thread, seed=100 * thread + call)
    return dict(**batch, max_new_tokens=4 + (thread * 3 + call) % 9, do_sample=False)


def run(pool: KVPool, thread: int) -> list[torch.Tensor]:
    outputs = []
    for call in range(CALLS):
        with PagedCache(MODEL, pool=pool) as cache:
            outputs.append(MODEL.generate(**request(thread, call), cache=cache))
    return outputs


def test_concurrent_generates_match_sequential_ones():
    pool = KVPool.for_config(MODEL.config, num_blocks=THREADS * 2 * 4 + 1)  # room for every request at once
    sequential = [run(pool, t) for t in range(THREADS)]
    concurrent: dict[int, list[torch.Tensor]] = {}
    errors: list[BaseException] = []
    too_big: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            concurrent[t] = run(pool, t)
        except BaseException as error:  # surfaced by the assertion below
            errors.append(error)

    def greedy_request() -> None:  # asks for more than the whole pool (8 rows of 9 blocks, 64 usable): fails alone
        try:
            with PagedCache(MODEL, pool=pool) as cache:
                MODEL.generate(**ragged_batch([0] * 8, 130), max_new_tokens=2, do_sample=False, cache=cache)
        except PoolExhaustedError as error:
            too_big.append(error)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(THREADS)]
    threads.append(threading.Thread(target=greedy_request))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "threads did not finish in time"
    assert not errors, errors
    assert len(too_big) == 1
    for t in range(THREADS):
        for ours, theirs in zip(concurrent[t], sequential[t], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert pool.blocks.num_free == pool.blocks.capacity
