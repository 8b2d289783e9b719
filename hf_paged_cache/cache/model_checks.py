"""What `PagedCache(model)` refuses before the first token, naming the model and the reason."""

from __future__ import annotations

import functools
import typing

from transformers import Cache, DynamicCache, PreTrainedConfig, PreTrainedModel

from ..kinds import LayerSpec


def check_model(config: PreTrainedConfig, model: PreTrainedModel | None, specs: list[LayerSpec]) -> None:
    """Raise `NotImplementedError` for what a `PagedCache` cannot keep (the unsupported layer kinds were
    refused already, by `kinds.layer_kinds`):

    - conv / recurrent states or indexer keys in a cache built from a config: they are kept per forward, which
      only the model's forward hooks delimit;
    - a model whose code demands a cache class of its own (MiniMax's lightning attention rejects any other);
    - a model that runs layers more than once per forward, appending cache layers for each extra pass.
    """
    if model is None and any(spec.kind.state or spec.kind.indexer for spec in specs):
        raise NotImplementedError(
            f"model type {config.model_type!r} has layers with conv / recurrent states or indexer keys, which a "
            "PagedCache keeps only when built from the model (PagedCache(model)): its forward hooks say when each "
            "forward ends"
        )
    if model is not None:
        own = own_cache_class(model)
        if own is not None:
            raise NotImplementedError(
                f"{type(model).__name__} keeps its own cache class ({own.__name__}), and its forward refuses any "
                "other cache: use the model's default cache"
            )
    text = config.get_text_config(decoder=True)
    if (getattr(text, "loop_num_passes", None) or 1) > 1:
        raise NotImplementedError(
            f"model type {config.model_type!r} runs some of its layers {text.loop_num_passes} times per forward, "
            "appending cache layers for each extra pass: a PagedCache keeps one per layer of the config"
        )


def own_cache_class(model: PreTrainedModel) -> type | None:
    """The `Cache` subclass `model`'s base model declares for its ``cache`` argument, when it is one of the
    model's own (not `Cache` or `DynamicCache`); None otherwise."""
    return _declared_cache_class(type(model.base_model))


@functools.cache  # a class's annotations do not change; resolving them costs more than a cache's construction
def _declared_cache_class(model_class: type) -> type | None:
    try:
        hints = typing.get_type_hints(model_class.forward)
    except Exception:  # noqa: BLE001 (annotations that do not resolve say nothing about the cache)
        return None
    declared = hints.get("cache", hints.get("past_key_values"))
    for kind in typing.get_args(declared) or (declared,):
        if isinstance(kind, type) and issubclass(kind, Cache) and kind not in (Cache, DynamicCache):
            return kind
    return None
