"""Faults to inject into a tiny model's forward or a request's token choice, for the batcher's isolation tests.

Each fault raises `Injected` (or another error) from a hook on the model, so the model itself is untouched:

- `poison(model, token)`: any forward whose input ids hold `token` fails, every time. That is a request's
  own fault: the request that carries the token must fail alone, the others keep exact tokens.
- `fail_next(module, times)`: the next `times` forwards through `module` fail, whatever they hold (or only those
  whose inputs `when` accepts). Once is a transient fault, which must cost nobody anything; always is a fault
  outside any request. Set `times` on the fault to arm it later (hooks are registered before the batcher runs:
  torch's hook dicts are not safe to change while another thread runs a forward).
- `RaiseInChoice`: a logits processor (passed to `submit(logits_processor=...)`) that raises, to fail a
  request's token choice `times` times.
- `Force`: a logits processor that makes a request pick a given token at a given step (a token the model
  then refuses, with `poison`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from transformers import LogitsProcessor


class Injected(Exception):
    """The failure a test injects."""


class Fault:
    """A hook that raises `Injected`, at most `times` times (None: always); `fired` counts its raises."""

    def __init__(self, times: int | None = None, error=None):
        self.times = times
        self.error = error  # builds the exception to raise (default: Injected)
        self.fired = 0
        self._lock = threading.Lock()
        self.handle = None

    def armed(self) -> bool:
        return self.times is None or self.fired < self.times

    def remove(self) -> None:
        self.handle.remove()

    def _raise(self, where: str) -> None:
        with self._lock:
            self.fired += 1
        raise self.error() if self.error is not None else Injected(f"injected {where}")


def poison(model: torch.nn.Module, token: int) -> Fault:
    """Every forward of `model` whose ``input_ids`` hold `token` raises (before any layer runs)."""
    fault = Fault()

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and bool((ids == token).any()):
            fault._raise(f"by token {token}")

    fault.handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return fault


def fail_next(module: torch.nn.Module, times: int | None = 1, after: bool = True, error=None,
              when: Callable[[tuple], bool] | None = None) -> Fault:
    """The next `times` forwards through `module` raise (None: every one), after it runs or before; `error()`
    builds the exception (default: `Injected`); `when(inputs)`, if given, picks the forwards that count (the
    module's positional inputs)."""
    fault = Fault(times, error)

    def hook(module, inputs, *output):
        if fault.armed() and (when is None or when(inputs)):
            fault._raise(f"in {type(module).__name__}")

    fault.handle = module.register_forward_hook(hook) if after else module.register_forward_pre_hook(hook)
    return fault


class RaiseInChoice(LogitsProcessor):
    """Raises `Injected` in the first `times` token choices it sees (None: in all of them)."""

    def __init__(self, times: int | None = 1):
        self.times, self.fired = times, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.times is None or self.fired < self.times:
            self.fired += 1
            raise Injected("injected in token choice")
        return scores


class Force(LogitsProcessor):
    """Makes the request pick `token` at its `at`-th new token."""

    def __init__(self, token: int, at: int, prompt_length: int):
        self.token, self.at, self.prompt_length = token, at, prompt_length

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_length == self.at:
            scores = torch.full_like(scores, -float("inf"))
            scores[:, self.token] = 0
        return scores
