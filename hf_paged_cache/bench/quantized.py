"""The parts the generate benchmarks of weights and modes share (``bench_quantized_weights.py``,
``bench_llama_cpp.py``, ``bench_batch_invariant.py``): the prompt, the models made from one float32 load, a greedy
run's timings and their alternated rounds, their summary in milliseconds, how long two greedy answers agree, and
the weights' bytes.

Imported by path (``hf_paged_cache.bench.quantized``); this package does not re-export it.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from .. import PagedCache
from ..kernels import Int4Linear, Int8Linear, pack_linears, quantize_by_name

PROMPT = ("The history of the city begins with a small settlement on the river, where traders from the north met "
          "farmers from the valley. Over the centuries it grew into a market town, then a port, and finally the "
          "capital of the region. Its old quarter still keeps")


def prompt_texts(rows: int) -> list[str]:
    """`rows` distinct prompts (one text behind a different first line each): none computed once for all."""
    return [f"Chapter {row + 1}. {PROMPT}" for row in range(rows)]


def quantized_models(base: nn.Module, names: tuple[str, ...]) -> dict[str, nn.Module]:
    """A copy of `base` per name (``float32`` or a ``--quantize`` name), each packed for oneDNN as the server packs
    it (`pack_linears`: the layers left in float)."""
    models = {}
    for name in names:
        model = copy.deepcopy(base)
        if name != "float32":
            quantize_by_name(model, name)
        pack_linears(model)
        models[name] = model
    return models


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the linear layers' weights as the model holds them (codes and scales; float32 weights)."""
    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):
            total += module.codes.numel() + 2 * module.scale.numel()
        elif isinstance(module, Int4Linear):
            total += module.packed.numel() + 2 * module.steps_and_midpoints.numel()
        elif isinstance(module, nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def greedy_run(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, *,
               batch_invariant: bool = False) -> tuple[float, float, torch.Tensor]:
    """The first token's seconds (the prompt's forward), a decode step's seconds (``(whole - first) / (new - 1)``)
    and the new tokens ``[rows, new]``, with a `PagedCache` (`batch_invariant` as given): one run of 1 token, then
    one of `new_tokens`."""
    with PagedCache(model, batch_invariant=batch_invariant) as cache, torch.inference_mode():
        start = time.perf_counter()
        model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - start
    with PagedCache(model, batch_invariant=batch_invariant) as cache, torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, cache=cache, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
        whole = time.perf_counter() - start
    return first, (whole - first) / (new_tokens - 1), out[:, ids.shape[1]:]


def alternated_runs(models: dict[str, nn.Module], ids: torch.Tensor, mask: torch.Tensor, new_tokens: int,
                    repeats: int, invariant: frozenset[str] = frozenset()) -> tuple[dict, dict, dict]:
    """`greedy_run` of every model in turn (the order turned every other round), a warm-up round then `repeats`
    timed ones; returns per name its first tokens' seconds, its decode steps' seconds (one per timed round) and its
    last answer ``[rows, new]``. The models named in `invariant` run with batch-invariant caches."""
    names = list(models)
    firsts: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    answers: dict[str, torch.Tensor] = {}
    for round_ in range(repeats + 1):  # round 0 warms up
        for name in (names if round_ % 2 else names[::-1]):
            first, step, answers[name] = greedy_run(models[name], ids, mask, new_tokens,
                                                    batch_invariant=name in invariant)
            if round_:
                firsts[name].append(first)
                steps[name].append(step)
    return firsts, steps, answers


def timing_summary(firsts: list[float], steps: list[float]) -> dict[str, float | list[float]]:
    """Milliseconds from `alternated_runs`' seconds: the first token's and a decode step's medians and ranges."""
    return {"first_ms": 1000 * statistics.median(firsts), "first_ms_range": [1000 * min(firsts), 1000 * max(firsts)],
            "step_ms": 1000 * statistics.median(steps), "step_ms_range": [1000 * min(steps), 1000 * max(steps)]}


def agreeing_tokens(answer: Sequence[int] | torch.Tensor, reference: Sequence[int] | torch.Tensor) -> int:
    """How many tokens two greedy answers of one length share before the first that differs."""
    ours = answer.tolist() if isinstance(answer, torch.Tensor) else list(answer)
    theirs = reference.tolist() if isinstance(reference, torch.Tensor) else list(reference)
    same = [a == b for a, b in zip(ours, theirs, strict=True)]
    return same.index(False) if False in same else len(same)

