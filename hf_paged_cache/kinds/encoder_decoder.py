"""The decoder of an encoder-decoder model (T5, BART, mBART, Marian, Whisper): the self-attention layers a
`PagedCache` keeps, read from the config's decoder attributes.

An encoder-decoder config describes two stacks, and its generic names (``num_hidden_layers``,
``num_attention_heads``) point at the encoder's on some models (T5's ``num_layers``, BART's
``encoder_attention_heads``). The decoder's own names are read here: ``num_decoder_layers`` (T5) or
``decoder_layers``, ``decoder_attention_heads`` (else ``num_heads``), and the head size ``d_kv`` (T5) or
``d_model / heads``. Every decoder self-attention layer attends to every earlier decoder token (full attention);
the cross-attention keys and values, one set per request, are not kept here.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedConfig


@dataclass(frozen=True)
class DecoderShape:
    """The decoder's self-attention layers: how many, their key/value heads, and the head size."""

    num_layers: int
    num_heads: int
    head_dim: int


def is_encoder_decoder(config: PreTrainedConfig) -> bool:
    return bool(getattr(config, "is_encoder_decoder", False))


def decoder_shape(config: PreTrainedConfig) -> DecoderShape:
    """The decoder self-attention layers of an encoder-decoder `config`; `NotImplementedError`, naming the model
    type, when its config names them in a way not read here."""
    layers = _first(config, "num_decoder_layers", "decoder_layers")
    heads = _first(config, "decoder_attention_heads", "num_heads")
    head_dim = _first(config, "d_kv") or (config.d_model // heads if heads and getattr(config, "d_model", None) else None)
    if not (layers and heads and head_dim):
        raise NotImplementedError(
            f"PagedCache reads an encoder-decoder model's decoder from its config (num_decoder_layers or "
            f"decoder_layers, decoder_attention_heads or num_heads, d_kv or d_model); {config.model_type!r} names "
            "them otherwise: use the model's default cache"
        )
    return DecoderShape(layers, heads, head_dim)


def _first(config: PreTrainedConfig, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cross_attention_share(config: PreTrainedConfig) -> float:
    """The part of one memory budget for the cross-attention's keys and values: what one request of the longest
    encoder input holds there against the longest output in the decoder's self-attention (both keep the same
    bytes a position: the decoder's heads and head size), ``encoder / (encoder + decoder)`` positions: Whisper's
    1,500 against 448 gives 0.77. Half when the config names no such lengths (T5's relative positions)."""
    encoder = _first(config, "max_source_positions", "max_position_embeddings", "n_positions")
    decoder = _first(config, "max_target_positions", "max_position_embeddings", "n_positions")
    return encoder / (encoder + decoder) if encoder and decoder else 0.5
