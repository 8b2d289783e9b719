"""What a cache learns about each forward: which new tokens are padding, their ids and positions, and its end.

transformers passes a cache the new keys and values, never the ``attention_mask``, ``input_ids`` or
``position_ids``. `install_input_hook` therefore gives a model one forward pre-hook, shared by every cache
built from it: before each forward, it hands whatever cache the forward was given (if it observes inputs)
those three tensors, which the cache keeps in a `PendingInputs` until the forward's first ``update``.

A forward hook, run even when the forward raises (``always_call``), then tells the cache how the forward
ended (`InputObserver.forward_ended`): the cache keeps the forward once the whole forward, LM head included,
has succeeded, and rolls it back at once when any part of it raised.

A first forward whose rows repeat each other (`generate` repeats every prompt ``k`` times for beams and for
``num_return_sequences``) is computed once per distinct row: the pre-hook cuts the forward's row arguments to
the distinct rows (`distinct_rows`), and the forward hook repeats the cache's rows (sharing their blocks) and
the output's logits back to the batch the caller gave. Only forwards whose arguments hold nothing else per row
are cut (token ids, padding mask, positions); any other argument, or a request for per-row outputs, leaves the
forward as it is.

The hooks hold no cache, so a cache that is dropped leaves nothing behind on the model, and any number
of caches (in any number of threads) can share one model without seeing each other's inputs.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import EncoderDecoderCache

from ..attention.paged_sdpa import PAGED_ATTENTION_NAMES

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

    def computes_repeats_once(self) -> bool: ...

    def repeat_rows_after_forward(self, rows: torch.Tensor) -> None: ...

    def take_rows_after_forward(self) -> torch.Tensor | None: ...

    def batch_select_indices(self, indices: torch.Tensor) -> None: ...

    @property
    def batch_size(self) -> int: ...


ROW_ARGUMENTS = ("input_ids", "attention_mask", "position_ids")
"""A first forward's arguments that hold rows: cut to its distinct rows when its other rows repeat them."""

SHARED_ARGUMENTS = frozenset(
    {"cache", "past_key_values", "cache_position", "logits_to_keep", "use_cache", "return_dict"}
)
"""The arguments a forward cut to its distinct rows may carry besides `ROW_ARGUMENTS` (none holds rows);
any other one given (not None or False) leaves the forward whole."""


def repeated_rows(
    new_ids: torch.Tensor | None, new_real: torch.Tensor | None, positions: torch.Tensor | None
) -> list[int] | None:
    """Per row, the first row with the same token ids, padding and positions; None when ids are unknown or
    no row repeats another.

    A row that repeats an earlier one computes the same keys and values, so it can share that row's blocks.
    """
    if new_ids is None:
        return None
    columns = [new_ids]  # [B, q] each
    if new_real is not None:
        columns.append(new_real.to(new_ids.device, new_ids.dtype))
    if positions is not None and positions.ndim == 2 and positions.shape[0] == new_ids.shape[0]:
        columns.append(positions.to(new_ids.device, new_ids.dtype))
    keys = [tuple(row) for row in torch.cat(columns, dim=1).tolist()]
    first: dict[tuple[int, ...], int] = {}
    sources = [first.setdefault(key, row) for row, key in enumerate(keys)]
    return sources if len(first) < len(keys) else None


OUTPUT_ARGUMENTS = frozenset({"output_hidden_states", "output_attentions", "output_router_logits", "labels"})
"""Arguments that ask a forward for more outputs (or a loss) and change no key or value."""


def carries_more_than_tokens(bound: dict) -> bool:
    """Whether a forward gives its rows inputs besides their token ids (images, audio, an encoder's output): then
    their keys and values depend on more than the ids (an image's patches sit behind placeholder tokens that every
    image shares). Arguments that only ask for outputs (`OUTPUT_ARGUMENTS`) do not count."""
    return _given_besides(bound, ROW_ARGUMENTS, SHARED_ARGUMENTS, OUTPUT_ARGUMENTS)


def _given_besides(bound: dict, *known: Collection[str]) -> bool:
    """Whether `bound` gives an argument (not None or False) that none of `known` names."""
    return any(
        all(name not in names for names in known) and value is not None and value is not False
        for name, value in bound.items()
    )


def distinct_rows(
    target: InputObserver, config: object, bound: dict
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For a first forward whose rows repeat each other: ``(kept, rows)``, the distinct rows to compute ``[B']``
    and, for each row of the batch, which of them it is ``[B]``. None when the forward must run as given: the
    cache is not empty, no row repeats another, or an argument (or the config) asks for more than logits."""
    input_ids = bound.get("input_ids")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or input_ids.shape[0] < 2:
        return None
    if not target.computes_repeats_once():  # first: most forwards continue a cache
        return None
    if _given_besides(bound, ROW_ARGUMENTS, SHARED_ARGUMENTS):
        return None  # other arguments may hold rows (labels, images) or ask for per-row outputs (hidden states)
    if getattr(config, "output_hidden_states", False) or getattr(config, "output_attentions", False):
        return None
    return_dict = bound.get("return_dict")
    if (getattr(config, "return_dict", True) if return_dict is None else return_dict) is False:
        return None  # a tuple comes back: only a model output's fields are repeated by name
    batch_size, length = input_ids.shape
    mask, positions = bound.get("attention_mask"), bound.get("position_ids")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != (batch_size, length)):
        return None
    if positions is not None and (
        not isinstance(positions, torch.Tensor) or positions.ndim != 2 or positions.shape[0] not in (1, batch_size)
    ):
        return None
    sources = repeated_rows(input_ids, None if mask is None else mask.bool(), positions)
    if sources is None:
        return None
    kept = sorted(set(sources))
    rows = [kept.index(source) for source in sources]
    return torch.tensor(kept, device=input_ids.device), torch.tensor(rows, device=input_ids.device)


def _cut_rows(bound: dict, kept: torch.Tensor, batch_size: int) -> dict:
    """`bound` with its row arguments cut to rows `kept` (a ``[1, q]`` position tensor serves every row)."""
    return {
        name: value.index_select(0, kept)
        if name in ROW_ARGUMENTS and isinstance(value, torch.Tensor) and value.shape[0] == batch_size
        else value
        for name, value in bound.items()
    }


def _repeat_output(output: object, rows: torch.Tensor, computed: int) -> object:
    """The forward's output with every tensor field of `computed` rows (logits) repeated to rows `rows` ``[B]``."""
    if not isinstance(output, Mapping):
        return output
    for name, value in list(output.items()):
        if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == computed:
            output[name] = value.index_select(0, rows)
    return output


class PendingInputs:
    """The next forward's padding mask, token ids and positions, kept from the pre-hook to its first layer."""

    def __init__(self) -> None:
        self.mask: torch.Tensor | None = None  # [B, q] True for real new tokens
        self.ids: torch.Tensor | None = None  # [B, q] the new tokens' ids
        self.positions: torch.Tensor | None = None  # [B or 1, q] their position ids, if the forward got any
        self.attention: str | None = None  # the model's attention implementation for this forward
        self.hooked = False  # observed by the model's pre-hook: its forward hook reports the forward's end
        self.query_length: int | None = None  # the next forward's new tokens per row; None when none is observed
        self.next_keys: torch.Tensor | None = None  # [B, q] ids to key the next forward's blocks by, if not its own

    def observe(
        self,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        query_length: int,
        position_ids: torch.Tensor | None = None,
        attention: str | None = None,
        hooked: bool = False,
    ) -> None:
        """Keep the last `query_length` columns of a 2-D ``[B, past + q]`` mask, 2-D `input_ids` (or the ids
        `next_keys` holds) and positions.

        Anything else means "no padding", "ids unknown" and "default positions". `attention` names the
        model's attention implementation (None when unknown); `hooked` says the model's forward hook will
        report how this forward ends.
        """
        self.mask = None
        if isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2:
            if attention_mask.shape[1] >= query_length:
                self.mask = attention_mask[:, attention_mask.shape[1] - query_length :].bool()
        self.ids = input_ids if isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2 else None
        if self.next_keys is not None:
            self.ids, self.next_keys = self.next_keys, None
        self.positions = position_ids if isinstance(position_ids, torch.Tensor) else None
        self.attention = attention
        self.hooked = hooked
        self.query_length = query_length

    @property
    def observed(self) -> bool:
        """Whether a forward was observed and has not begun yet (its first layer takes the inputs)."""
        return self.query_length is not None

    def batch_size(self) -> int | None:
        """The observed forward's rows, when its token ids or padding mask show them."""
        shown = self.ids if self.ids is not None else self.mask
        return None if shown is None else shown.shape[0]

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
        self.mask = self.ids = self.positions = self.attention = self.query_length = self.next_keys = None
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


_MODULE_CALL = torch.nn.Module._call_impl.__code__  # the frame every hooked model's forward runs under


def forward_running(model: PreTrainedModel) -> bool:
    """Whether `model`'s forward is running on this thread: a read from inside it (a model that asks its cache
    for its length mid-forward, as Llama 4's NoPE layers do), not after it was interrupted.

    A ``KeyboardInterrupt`` reaches no forward hook, so only the stack tells a forward still in flight from one
    left unfinished: this looks for `model`'s own ``Module._call_impl`` frame on this thread's stack.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _MODULE_CALL and frame.f_locals.get("self") is model:
            return True
        frame = frame.f_back
    return False


def refuse_paged_attention(attention: str | None, dense_kinds: Sequence[str]) -> None:
    """Raise `NotImplementedError` when a forward would run a paged attention (`attention`) over layers it
    cannot attend (`dense_kinds`, see `memory.dense_attention_kinds`): chunked attention, KV sharing."""
    if dense_kinds and attention in PAGED_ATTENTION_NAMES:
        raise NotImplementedError(
            f"{attention!r} cannot attend {', '.join(dense_kinds)} layers: keep the "
            f"model's default attention with this PagedCache"
        )


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
    if isinstance(target, EncoderDecoderCache):  # generate wraps a decoder's cache with a cross-attention cache
        target = target.self_attention_cache
    return (target if callable(getattr(target, "forward_ended", None)) else None), bound


def _decoder_inputs(bound: dict) -> dict:
    """An encoder-decoder model's forward arguments as the decoder's cache sees them: its decoder mask and
    positions under the decoder-only names, and no token ids (the decoder's ids, or embeddings, stand as
    ``inputs_embeds``, which give only the forward's shape): the keys and values of decoder tokens depend on the
    encoder's input too, so the ids neither key prefix blocks nor tell repeated rows."""
    inputs = bound.get("decoder_input_ids")
    return {"input_ids": None, "attention_mask": bound.get("decoder_attention_mask"),
            "position_ids": bound.get("decoder_position_ids"),
            "inputs_embeds": inputs if inputs is not None else bound.get("decoder_inputs_embeds")}


def _input_hook(names: list[str]):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None = None) -> None:
        if kwargs is None:
            # torch registers a kwargs hook in two forwards; a forward running in another thread meanwhile
            # calls it without kwargs. That forward started before the hook existed: nothing to observe.
            return
        target, bound = _observer(names, args, kwargs)
        if target is None:
            return
        if bound.get("use_cache") is False:
            # the model would still write into the cache while the caller re-feeds the whole sequence
            # (generate(use_cache=False) does), silently stacking duplicate positions
            raise ValueError("a PagedCache was passed with use_cache=False; pass use_cache=True or no cache")
        if getattr(module.config, "is_encoder_decoder", False):
            bound = _decoder_inputs(bound)
        input_ids = bound.get("input_ids")
        inputs = input_ids if input_ids is not None else bound.get("inputs_embeds")
        if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
            target.observe_inputs(None, None, 0)  # the model itself raises on inputs it cannot take
            return
        distinct = distinct_rows(target, module.config, bound)
        if distinct is not None:  # computed once per distinct row, repeated by the forward hook
            kept, rows = distinct
            bound = _cut_rows(bound, kept, rows.shape[0])
            input_ids = bound["input_ids"]
            target.repeat_rows_after_forward(rows)
        attention = getattr(module.config.get_text_config(decoder=True), "_attn_implementation", None)
        # the ids key prefix blocks and tell repeated rows only when the tokens are all a row's keys depend on
        keyed_ids = None if carries_more_than_tokens(bound) else input_ids
        target.observe_inputs(
            keyed_ids, bound.get("attention_mask"), inputs.shape[1], bound.get("position_ids"), attention,
            hooked=True,
        )
        if distinct is not None:
            return (), bound  # every argument by name (the bound ones included), the row ones cut

    return hook


def _end_hook(names: list[str]):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict | None, output: object) -> None:
        if kwargs is None:
            return  # registered while this forward ran (see the pre-hook): it was not observed either
        target, _ = _observer(names, args, kwargs)
        if target is None:
            return None
        rows = target.take_rows_after_forward()
        target.forward_ended(failed=output is None)  # torch passes None when the forward raised
        if rows is None or output is None:
            return None
        computed = target.batch_size
        target.batch_select_indices(rows)  # each repeated row shares its computed row's blocks
        return _repeat_output(output, rows, computed)

    return hook
