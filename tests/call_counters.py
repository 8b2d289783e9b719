"""Counting calls without changing them: which decode strategy ran, how often a function was called."""

import hf_paged_cache.attention.decode as decode_module


def count_strategy(monkeypatch, name: str) -> list[int]:
    """A list that grows by one each time a decode step tries strategy `name` (`decode.DECODE_STRATEGIES`)."""
    calls: list[int] = []
    original = decode_module.DECODE_STRATEGIES[name]
    monkeypatch.setitem(decode_module.DECODE_STRATEGIES, name, lambda *args: calls.append(1) or original(*args))
    return calls


def count_calls(monkeypatch, module, name: str) -> list[int]:
    """A list that grows by one at each call of ``module.name`` (which still runs), for the test's duration.

    `module` may be a class: the counting function then becomes its method and gets ``self`` first, as the original."""
    calls: list[int] = []
    original = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args: calls.append(1) or original(*args))
    return calls
