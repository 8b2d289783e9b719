"""What a cache learns about each forward: which new tokens are padding, their ids and positions, and its end.

transformers passes a cache the new keys and values, never the ``attention_mask``, ``input_ids`` or
``position_ids``. `install_input_hook` therefore gives a model one forward pre-hook, shared by every cache
built from it: before each forward, it hands whatever cache the forward was given (if it observes inputs)
those three tensors, which the cache keeps in a `PendingInputs` until the forward's first ``update``.

A forward hook, run even when the forward raises (``always_call``), then tells the cache how the forward
ended (`InputObserver.forward_ended`): the cache keeps the step once the whole forward, LM head included,
has succeeded, and rolls it back at once when any part of it raised.

The hooks hold no cache, so a cache that is dropped leaves nothing behind on the model, and any number
of caches (in any number of threads) can share one model without seeing each other's inputs.
"""

from __future__ import annotations

import inspect
import os
import threading
from typing import Protocol

import torch
from transformers import PreTrainedModel

_HOOK_ATTRIBUTE = "_hf_paged_cache_input_hook"  # the model's two hook handles, set once per model
_ROOT_ATTRIBUTE = "_hf_paged_cache_prefix_root"  # the model's prefix-key root, set once per model
_INSTALL_LOCK = threading.Lock()  # makes the two set-once attributes above race-free across threads


class InputObserver(Protocol):
    def observe_inputs(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        query_length: int,
        position_ids: torch.Tensor | None = None,
        attention: str | None = None,
        hooked: bool = False,
    ) -> None: ...

    def forward_ended(self, failed: bool) -> None: ...


class PendingInputs:
    """The next forward's padding mask, token ids and positions, kept from the pre-hook to its first layer."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [B, q] True for real new tokens
        self.ids: torch.Tensor | None = None  # [B, q] the new tokens' ids
        self.positions: torch.Tensor | None = None  # [B or 1, q] their position ids, if the forward got any
        self.attention: str | None = None  # the model's attention implementation for this forward
        self.hooked = False  # observed by the model's pre-hook: its forward hook reports the forward's end

    def observe(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        query_length: int,
        position_ids: torch.Tensor | None = None,
        attention: str | None = None,
        hooked: bool = False,
    ) -> None:
        """Keep the last `query_length` columns of a 2-D ``[B, past + q]`` mask, 2-D `input_ids` and positions.

        Anything else means "no padding", "ids unknown" and "default positions". `attention` names the
        model's attention implementation (None when unknown); `hooked` says the model's forward hook will
        report how this forward ends.
        """
        self.mask = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            if attention_mask.shape[1] >= query_length:
                self.mask = attention_mask[:, attention_mask.shape[1] - query_length :].bool()
        self.ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else None
        self.positions = position_ids if isinstance(position_ids, torch.Tensor) else None
        self.attention = attention
        self.hooked = hooked

    def take(
        self, batch_size: int, query_length: int
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, str | None, bool]:
        """``(new_real, new_ids, positions, attention, hooked)`` for a forward of this shape, then forget them.

        Each tensor is None when unknown or when it does not match the forward's shape; `new_real` is also
        None when the mask shows no padding.
        """
        mask, ids, positions, attention, hooked = self.mask, self.ids, self.positions, self.attention, self.hooked
        self.clear()
        if mask is not None and (mask.shape != (batch_size, query_length) or bool(mask.all())):
            mask = None
        if ids is not None and ids.shape != (batch_size, query_length):
            ids = None
        return mask, ids, positions, attention, hooked

    def clear(self) -> None:
        self.mask = self.ids = self.positions = self.attention = None
        self.hooked = False


def install_input_hook(model: PreTrainedModel) -> None:
    """Give `model` (once) the forward pre-hook that shows an observing cache each forward's inputs, and the
    forward hook that tells it how the forward ended."""
    with _INSTALL_LOCK:
        if getattr(model, _HOOK_ATTRIBUTE, None) is None:
            names = list(inspect.signature(model.forward).parameters)
            handles = (
                model.register_forward_pre_hook(_input_hook(names), with_kwargs=True),
                model.register_forward_hook(_end_hook(names), with_kwargs=True, always_call=True),
            )
            object.__setattr__(model, _HOOK_ATTRIBUTE, handles)


def prefix_root(model: PreTrainedModel) -> bytes:
    """A random key that stands for `model` (its weights) at the root of its caches' prefix keys.

    Blocks written by one model object are never found by another's caches, even on one shared pool with the
    same config. Set once per model object; a model whose weights change in place keeps its key, so use a
    fresh pool after changing weights.
    """
    with _INSTALL_LOCK:
        root = getattr(model, _ROOT_ATTRIBUTE, None)
        if root is None:
            root = os.urandom(16)
            object.__setattr__(model, _ROOT_ATTRIBUTE, root)
        return root


def _observer(names: list[str], args: tuple, kwargs: dict) -> tuple[InputObserver | None, dict]:
    """The cache a forward was given, if it observes inputs, and the forward's arguments by name.

    Checked by its method rather than ``isinstance`` against the protocol, which costs tens of microseconds
    a call (it inspects every member), twice a forward.
    """
    bound = dict(zip(names, args)) | kwargs if args else kwargs
    target = bound.get("cache") if bound.get("cache") is not None else bound.get("past_key_values")
    return (target if callable(getattr(target, "forward_ended", None)) else None), bound


def _input_hook(names: list[str]):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if kwargs is None:
            # torch registers a kwargs hook in two steps; a forward running in another thread meanwhile
            # calls it without kwargs. That forward started before the hook existed: nothing to observe.
            return
        target, bound = _observer(names, args, kwargs)
        if target is None:
            return
        if bound.get("use_cache") is False:
            # the model would still write into the cache while the caller re-feeds the whole sequence
            # (generate(use_cache=False) does), silently stacking duplicate positions
            raise ValueError("a PagedCache was passed with use_cache=False; pass use_cache=True or no cache")
        input_ids = bound.get("input_ids")
        inputs = input_ids if input_ids is not None else bound.get("inputs_embeds")
        if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
            target.observe_inputs(None, None, 0)  # the model itself raises on inputs it cannot take
            return
        attention = getattr(module.config.get_text_config(decoder=True), "_attn_implementation", None)
        target.observe_inputs(
            input_ids, bound.get("attention_mask"), inputs.shape[1], bound.get("position_ids"), attention,
            hooked=True,
        )

    return hook


def _end_hook(names: list[str]):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None, output: object) -> None:
        if kwargs is None:
            return  # registered while this forward ran (see the pre-hook): it was not observed either
        target, _ = _observer(names, args, kwargs)
        if target is not None:
            target.forward_ended(failed=output is None)  # torch passes None when the forward raised

    return hook
