"""`LayerKind`: what one kind of decoder layer keeps in a `PagedCache`, and how it is shared."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LayerKind:
    """One of transformers' cache layer types (``config.layer_types``), as a `PagedCache` stores it.

    A kind keeps keys and values per token in blocks of the pool (`tokens`: attention), conv and recurrent
    states per sequence in state slots of the pool (`state`: linear attention, SSM, short convolutions), both
    (hybrid layers), or nothing (MLP-only layers, layers that reuse another layer's keys and values).

    Blocks are shared between rows by reference count and written only where a row owns them; a state slot is
    shared the same way until a forward writes it, which then gives each row that shared it a slot of its own
    (a state is overwritten in place every step, so a fork copies it when the fork's first forward runs).
    """

    name: str  # transformers' layer type, e.g. "linear_attention"
    tokens: bool  # keys and values per token, in blocks
    state: bool  # conv and recurrent states per sequence, in state slots
    windowed: bool = False  # the tokens kept are the last `sliding_window` (sliding and chunked attention)
    # the paged attentions cannot run it: it attends with a mask of the model's own (chunked attention), to the keys
    # its indexer picks (DSA), or with the dense keys and values another layer's `update` returned (KV sharing)
    dense_only: bool = False
    indexer: bool = False  # one more key per token, in the same blocks: DSA's indexer key (`update_indexer`)

    def spec(self, layer_kwargs: dict[str, Any]) -> LayerSpec:
        """One layer of this kind, with the arguments transformers gives its cache layer."""
        window = layer_kwargs.get("sliding_window") if self.windowed else None
        return LayerSpec(self, window, layer_kwargs.get("number_of_states", 1) if self.state else 0)


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer as a `PagedCache` stores it."""

    kind: LayerKind
    window: int | None  # the span of tokens it keeps: its sliding window, or None (every token, or none)
    number_of_states: int  # conv / recurrent state pairs per sequence (0 for a kind that keeps none)
