"""Does a row keep its keys in consecutive blocks on a pool that has served many requests, and what does that buy a
decode step?

1. **aged pool** (no model): a `BlockPool` of ``--pool-blocks`` blocks serves ``--aging-requests`` requests, 16
   at a time (prompts of 20 to 400 random tokens, 20 to 300 new tokens, every full block registered for prefix
   caching, no two alike), then one client's ``--client-requests`` requests one after the other; reported: the
   share of that client's decode steps whose blocks follow one another from the first (`consecutive_runs`: the
   steps ``paged_sdpa`` reads as one view of the pool instead of gathering).
2. **decode step** (the default model, packed linear layers, ``paged_sdpa``): one row of ``--context`` tokens of
   the offline Wikipedia excerpt, in a fresh pool (consecutive blocks) and in a pool whose every other block is
   held elsewhere (no two of its blocks adjacent: gathered), decode steps alternated between the two (the order
   turned every step), the first 16 untimed; medians and quartiles of ``--steps`` steps.

Command (the numbers in docs/benchmarks.md)::

    OMP_NUM_THREADS=2 python scripts/bench/generate/bench_consecutive_blocks.py \
        --out results/bench_consecutive_blocks.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

import torch

from hf_paged_cache import BlockPool, KVPool, PagedCache, set_paged_attention
from hf_paged_cache.attention.reading import consecutive_runs
from hf_paged_cache.bench import write_json
from hf_paged_cache.cache.block_table import BlockTables
from hf_paged_cache.eval.corpora import load_corpus_text
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.models import load_model_and_tokenizer

BLOCK_SIZE = 16
VOCAB = 49152


class Requests:
    """Requests on a bare `BlockPool`: a row's tables, grown a token at a time, registered as the cache does."""

    def __init__(self, pool: BlockPool, seed: int):
        self.pool, self.rng = pool, random.Random(seed)

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(VOCAB) for _ in range(n)]

    def start(self) -> tuple[BlockTables, int]:
        """A new request's tables with its prompt stored, and how many tokens it will generate."""
        tables = BlockTables(self.pool, root=b"bench")
        tables.add_rows(1)
        prompt = self.rng.randint(20, 400)
        self.store(tables, prompt)
        return tables, self.rng.randint(20, 300)

    def store(self, tables: BlockTables, n: int) -> None:
        tables.append([n], [self.tokens(n)])
        tables.commit()
        tables.register_full_blocks()


def aged_pool_share(pool_blocks: int, aging: int, client: int, seed: int) -> tuple[int, int]:
    """(decode steps with consecutive blocks, decode steps) of one client after `aging` requests (see the docstring)."""
    requests = Requests(BlockPool(pool_blocks, BLOCK_SIZE), seed)
    active: list[list] = []
    done = 0
    while done < aging:
        while len(active) < 16:
            active.append(list(requests.start()))
        for entry in list(active):
            requests.store(entry[0], 1)
            entry[1] -= 1
            if entry[1] == 0:
                entry[0].release()
                active.remove(entry)
                done += 1
    for tables, _ in active:
        tables.release()
    consecutive = steps = 0
    for _ in range(client):
        tables, new = requests.start()
        for _ in range(new):
            requests.store(tables, 1)
            steps += 1
            consecutive += consecutive_runs(tables.view()) is not None
        tables.release()
    return consecutive, steps


def decode_steps(context: int, steps: int) -> dict[str, list[float]]:
    """Milliseconds of each timed decode step, per pool (see the docstring)."""
    model, tokenizer = load_model_and_tokenizer()
    pack_linears(model)
    set_paged_attention(model)
    ids = tokenizer(load_corpus_text("offline").text, return_tensors="pt").input_ids[:, :context]  # [1, L]
    blocks = -(-(context + steps) // BLOCK_SIZE)
    rows = {}
    for name in ("consecutive", "scattered"):
        pool = KVPool.for_config(model.config, num_blocks=2 * blocks + 2, block_size=BLOCK_SIZE)
        if name == "scattered":
            held = pool.blocks.allocate(2 * blocks)
            pool.blocks.free(held[1::2])  # every other block free: none of the row's blocks can follow another
        cache = PagedCache(model, pool=pool)
        with torch.inference_mode():
            logits = model(input_ids=ids, cache=cache, use_cache=True).logits
        rows[name] = [cache, logits[:, -1:].argmax(-1)]
    times: dict[str, list[float]] = {name: [] for name in rows}
    with torch.inference_mode():
        for step in range(steps):
            for name in (list(rows) if step % 2 else list(rows)[::-1]):
                cache, token = rows[name]
                start = time.perf_counter()
                logits = model(input_ids=token, cache=cache, use_cache=True).logits
                elapsed = time.perf_counter() - start
                rows[name][1] = logits[:, -1:].argmax(-1)
                if step >= 16:
                    times[name].append(1000 * elapsed)
    assert torch.equal(rows["consecutive"][1], rows["scattered"][1]), "the two pools' rows parted"
    return times


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pool-blocks", type=int, default=1024, help="the aged pool's blocks (default: 1024)")
    parser.add_argument("--aging-requests", type=int, default=1000, help="requests that age the pool (default: 1000)")
    parser.add_argument("--client-requests", type=int, default=20, help="the one client's requests (default: 20)")
    parser.add_argument("--context", type=int, default=512, help="the decoded row's prompt tokens (default: 512)")
    parser.add_argument("--steps", type=int, default=96, help="decode steps per pool, 16 untimed (default: 96)")
    parser.add_argument("--seed", type=int, default=0, help="the aged pool's requests (default: 0)")
    parser.add_argument("--out", type=Path, default=None, help="write the results to this JSON file (default: none)")
    args = parser.parse_args(argv)

    consecutive, steps = aged_pool_share(args.pool_blocks, args.aging_requests, args.client_requests, args.seed)
    print(f"aged pool: {consecutive}/{steps} of one client's decode steps with consecutive blocks "
          f"({consecutive / steps:.1%})", flush=True)
    times = decode_steps(args.context, args.steps)
    result = {"aged_pool": {"consecutive_steps": consecutive, "decode_steps": steps},
              "threads": torch.get_num_threads(), "context": args.context, "decode_ms": {}}
    for name, values in times.items():
        low, _, high = statistics.quantiles(values, n=4)
        result["decode_ms"][name] = {"median": statistics.median(values), "quartiles": [low, high]}
        print(f"{name}: {statistics.median(values):.2f} ms a decode step (quartiles {low:.2f}-{high:.2f})")
    ratio = result["decode_ms"]["scattered"]["median"] / result["decode_ms"]["consecutive"]["median"]
    result["scattered_over_consecutive"] = ratio
    print(f"scattered / consecutive: {ratio:.3f}x the time")
    if args.out:
        write_json(args.out, result, "cpu")
    return result


if __name__ == "__main__":
    main()
