"""What the batcher's tests share: ragged requests, each request's reference alone, waiting, an empty pool."""

import threading
import time

import torch
from tiny_models import VOCAB
from transformers import DynamicCache


def requests(count: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """`count` ragged prompts (3 to 40 tokens) with their own max_new_tokens (1 to 16)."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        length = int(torch.randint(3, 41, (1,), generator=generator))
        prompt = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
        out.append((prompt, int(torch.randint(1, 17, (1,), generator=generator))))
    return out


def alone(model, prompt: list[int], **kwargs) -> list[int]:
    """What generate() with a DynamicCache gives for this request alone."""
    ids = torch.tensor([prompt])
    kwargs.setdefault("do_sample", False)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(config=model.config),
                         **kwargs)
    return out[0, len(prompt):].tolist()


def from_four_clients(batcher, work: list[tuple[list[int], int]], timeout: float = 120.0) -> list[list[int]]:
    """Each request's tokens, submitted by 4 client threads (request i by client i % 4), in request order."""
    results: dict[int, list[int]] = {}

    def client(first: int) -> None:
        handles = [(i, batcher.submit(work[i][0], max_new_tokens=work[i][1])) for i in range(first, len(work), 4)]
        for i, handle in handles:
            results[i] = handle.result(timeout=timeout)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [results[i] for i in range(len(work))]


def wait_until(condition, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def assert_pool_empty(batcher):
    assert all(blocks.num_used == 0 for blocks in batcher.pool.groups)
    assert batcher.pool.states.ids.num_used == 0
