"""Where a `ContinuousBatcher` step's time goes, by wall-clock timers around its parts: decode steps, or prompt steps.

``torch.profiler`` records every op with an overhead of its own, and on SmolLM2 it reported times that untraced
runs did not reproduce (bfloat16 prompt steps' packed linear layers at a ninth of their untraced speed). This
script instead wraps a handful of functions in ``time.perf_counter`` timers (a microsecond or two each) and
runs the batcher in process on the requests of ``bench_http.py`` (the same seeded ShareGPT-shaped workload:
48 requests of at most 256 prompt tokens, 16 clients, each submitting its next request when one ends). It
times every step of one kind (``--steps``):

- ``decode``: every decode step that runs alone (decode rows only; steps with prompt chunks are not counted);
- ``prompt``: every step that computes prompt tokens: a packed forward (prompt chunks, with the running rows'
  next tokens when there are any) or a chunk's forward of its own; its tokens are all those it computes.

and, within each:

- ``linear``: the forwards of the linear layers (`PackedLinear`, as the server packs them);
- ``attention``: the paged attention function as transformers calls it, and within it ``gather`` (copying
  keys and values out of the pool) and ``sdpa`` (``F.scaled_dot_product_attention`` calls);
- ``cache update``: `PagedCache.update`, and within it ``writes`` (storing the step's new keys and values);
- ``other``: the rest of the forward: norms, rotary embeddings, residuals, the embedding, the modules' Python.

The timers are installed only around the timed steps (`unittest.mock.patch`) and add a little to ``other``
and ``linear`` (about 210 linear calls a step). Medians over the steps, with the quartiles; each part's share is
of the mean step.

Commands (the numbers in docs/benchmarks.md)::

    python scripts/bench/serving/profile_steps.py --threads 2 --out results/profile_decode_float32_t2.json
    python scripts/bench/serving/profile_steps.py --threads 2 --dtype bfloat16 --out results/profile_decode_bfloat16_t2.json
    python scripts/bench/serving/profile_steps.py --steps prompt --threads 2 --num-requests 48 --max-prompt 400 --max-new 1 \
        --output-scale 1 --out results/profile_prompt_float32_t2.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.attention import PAGED_ATTENTION_NAMES, decode, set_paged_attention
from hf_paged_cache.attention.paged_sdpa import decode_kernel
from hf_paged_cache.bench import (
    add_common_args,
    add_workload_args,
    format_table,
    load,
    prompt_token_range,
    sharegpt_workload,
    write_json,
)
from hf_paged_cache.bench.timing import in_fresh_thread
from hf_paged_cache.cache import layer_io
from hf_paged_cache.cache.paged_cache import PagedCache
from hf_paged_cache.engine import forwards
from hf_paged_cache.heap import pad_heap
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.kernels.packed_linear import PackedLinear
from hf_paged_cache.pool.kv_format import StoredStates

PARTS = ("linear", "attention", "gather", "sdpa", "cache update", "writes", "other")
STEP_KINDS = ("decode", "prompt")


class StepTimers:
    """Seconds spent in each part during the steps being timed, one `Counter` per step."""

    def __init__(self) -> None:
        self.steps: list[Counter[str]] = []
        self.tokens: list[int] = []  # per step, the tokens it computes (a decode step's: its rows)
        self._current: Counter[str] | None = None  # while a timed step runs on the batcher's thread

    def timed(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """`fn`, adding its wall time to `part` when called inside a timed step."""

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            current = self._current
            if current is None:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[part] += time.perf_counter() - start

        return wrapper

    def step(self, fn: Callable[..., Any], tokens: Callable[[tuple[Any, ...]], int]) -> Callable[..., Any]:
        """`fn`, a step's forward, timed whole as ``step`` with its parts; `tokens` counts, from its positional
        arguments, the tokens it computes."""

        def wrapper(*args: Any) -> Any:
            self._current = Counter()
            start = time.perf_counter()
            try:
                return fn(*args)
            finally:
                self._current["step"] = time.perf_counter() - start
                self.steps.append(self._current)
                self.tokens.append(tokens(args))
                self._current = None

        return wrapper


@contextmanager
def installed(timers: StepTimers, kind: str, attention: str) -> Iterator[None]:
    """The timers around the batcher's forwards of `kind` (`STEP_KINDS`) and their parts (the model's paged
    `attention` among them), for the duration of the block."""
    with ExitStack() as stack:
        patch = stack.enter_context
        step_forwards = forwards.StepForwards
        if kind == "decode":  # (self, cache, requests): one token a request
            patch(mock.patch.object(step_forwards, "decode",
                                    timers.step(step_forwards.decode, lambda args: len(args[2]))))
        else:  # a packed forward (model, segments, logits_at), or a chunk alone (self, chunk)
            patch(mock.patch.object(forwards, "packed_forward", timers.step(
                forwards.packed_forward, lambda args: sum(segment.input_ids.numel() for segment in args[1]))))
            patch(mock.patch.object(step_forwards, "chunk",
                                    timers.step(step_forwards.chunk, lambda args: len(args[1].tokens))))
        patch(mock.patch.object(PackedLinear, "forward", timers.timed("linear", PackedLinear.forward)))
        patch(mock.patch.object(decode, "_gather_row_major", timers.timed("gather", decode._gather_row_major)))
        patch(mock.patch.object(StoredStates, "gather", timers.timed("gather", StoredStates.gather)))
        patch(mock.patch.object(F, "scaled_dot_product_attention",
                                timers.timed("sdpa", F.scaled_dot_product_attention)))
        patch(mock.patch.object(PagedCache, "update", timers.timed("cache update", PagedCache.update)))
        patch(mock.patch.object(layer_io, "write_new_tokens", timers.timed("writes", layer_io.write_new_tokens)))
        attend = AttentionInterface()[attention]
        AttentionInterface.register(attention, timers.timed("attention", attend))
        stack.callback(AttentionInterface.register, attention, attend)
        yield


def drive(batcher: ContinuousBatcher, prompts: list[list[int]], max_tokens: list[int], clients: int) -> None:
    """`clients` threads, each submitting its next request when its last one ends (as `bench_http.py`)."""

    def one(i: int) -> None:
        batcher.submit(prompts[i], max_new_tokens=max_tokens[i], do_sample=False, eos_token_id=None).result()

    with ThreadPoolExecutor(max_workers=clients) as pool:
        list(pool.map(one, range(len(prompts))))


def run_round(model: PreTrainedModel, prompts: list[list[int]], max_tokens: list[int], clients: int,
              warmup: list[list[int]], kind: str, attention: str) -> StepTimers:
    """One fresh batcher: `warmup`'s prompts (16 tokens each), then the timed requests."""
    timers = StepTimers()
    with ContinuousBatcher(model) as batcher:
        drive(batcher, warmup, [16] * len(warmup), clients)
        with installed(timers, kind, attention):
            drive(batcher, prompts, max_tokens, clients)
    return timers


def summarise(timers: list[StepTimers], kind: str) -> dict[str, Any]:
    steps = [step for t in timers for step in t.steps]
    if not steps:
        raise SystemExit(f"no {kind} step was timed: give more requests, or longer outputs for decode steps alone")
    for step in steps:
        step["other"] = step["step"] - step["linear"] - step["attention"] - step["cache update"]
    tokens = [n for t in timers for n in t.tokens]

    def quartiles(part: str) -> dict[str, float]:
        values = [step[part] * 1e3 for step in steps]
        q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values * 3)
        return {"median_ms": median, "q1_ms": q1, "q3_ms": q3}

    mean_step = statistics.fmean(s["step"] for s in steps)
    return {
        "steps": len(steps),
        "tokens": sum(tokens),
        "tokens_per_step": statistics.fmean(tokens),
        "step": quartiles("step"),
        "parts": {part: quartiles(part) | {"share": statistics.fmean(s[part] for s in steps) / mean_step}
                  for part in PARTS},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser, out="results/profile_steps.json")
    parser.add_argument("--steps", choices=STEP_KINDS, default="decode",
                        help="which steps to time: decode steps alone, or steps computing prompt tokens "
                             "(default: decode)")
    add_workload_args(parser, num_requests=48)  # bench_http.py's
    parser.add_argument("--concurrency", type=int, default=16, help="clients (default: 16)")
    parser.add_argument("--repeats", type=int, default=2, help="timed rounds, each on a fresh batcher (default: 2)")
    parser.add_argument("--no-packed-linears", action="store_true", help="keep the model's stock linear layers")
    parser.add_argument("--attention", choices=PAGED_ATTENTION_NAMES, default=PAGED_ATTENTION_NAMES[0],
                        help=f"the batcher's paged attention (default: {PAGED_ATTENTION_NAMES[0]})")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    model, tokenizer = load(args)
    if not args.no_packed_linears:
        pack_linears(model)  # as the server does by default
    pad_heap()  # as the server does at start-up
    set_paged_attention(model, decode=decode_kernel(args.attention))
    token_range = prompt_token_range(model, tokenizer)
    workload = sharegpt_workload(args.num_requests, seed=args.seed, max_prompt=args.max_prompt,
                                 max_output=10**6, token_range=token_range)
    prompts = [list(request.prompt_ids) for request in workload.requests]
    max_tokens = workload.scaled_output_lens(args.output_scale, args.max_new)
    # the warm-up's prompts from another seed, as bench_http.py's: none of the timed prompts is cached by prefix
    warmup = sharegpt_workload(args.concurrency, seed=args.seed + 1, max_prompt=args.max_prompt, max_output=16,
                               token_range=token_range)
    warmup_prompts = [list(request.prompt_ids) for request in warmup.requests]
    rounds = [in_fresh_thread(run_round, model, prompts, max_tokens, args.concurrency, warmup_prompts, args.steps,
                              args.attention) for _ in range(args.repeats)]
    summary = summarise(rounds, args.steps)
    payload = {"benchmark": "profile_steps", "kind": args.steps, "args": vars(args),
               "threads": torch.get_num_threads(), "dtype": str(model.dtype)} | summary
    print_report(payload)
    write_json(args.out, payload, args.device)
    return payload


def print_report(payload: dict[str, Any]) -> None:
    print(f"{payload['steps']} {payload['kind']} steps of {payload['tokens_per_step']:.1f} tokens on average, "
          f"{payload['dtype']}, {payload['threads']} threads: {payload['step']['median_ms']:.1f} ms a step "
          f"({payload['step']['q1_ms']:.1f}-{payload['step']['q3_ms']:.1f})")
    rows = [{"part": part, "ms a step": f"{v['median_ms']:.2f}", "quartiles": f"{v['q1_ms']:.2f}-{v['q3_ms']:.2f}",
             "share": f"{v['share']:.0%}"} for part, v in payload["parts"].items()]
    print(format_table(rows, ["part", "ms a step", "quartiles", "share"]))


if __name__ == "__main__":
    main()
