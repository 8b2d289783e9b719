"""`quantize_weights`: make a model's linear layers weight-only int8 (`Int8Linear`) or int4 (`Int4Linear`).

The keys and values the quantized model computes go to the cache as they come: the cache stays exact for the
quantized model, which is not the float one (its quality is measured on held-out text: docs/memory.md).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .int4_linear import GROUP_SIZE, Int4Linear, fits
from .int8_linear import Int8Linear

logger = logging.getLogger(__name__)

BITS = (8, 4)
"""The widths `quantize_weights` takes."""


def quantize_weights(model: nn.Module, bits: int = 8, *, output_head: bool = False,
                     group_size: int = GROUP_SIZE) -> int:
    """Make every plain `nn.Linear` of `model` an `Int8Linear` (``bits=8``) or an `Int4Linear` (``bits=4``, a
    step and a midpoint per `group_size` inputs), in place; returns how many it changed.

    The output head (``model.get_output_embeddings()``) stays as it is unless `output_head`: quantizing it too is
    the fastest (a third of a small model's decode step is its head) and costs the most (SmolLM2-135M's
    perplexity at int8: +0.56% against +0.32% without it). Call it before `pack_linears`, which leaves these
    layers alone. A tied output head is quantized apart from the embedding it shares its weight with. At 4 bits,
    a layer whose input width is not a multiple of `group_size` stays in float, with one log line.

    Raises:
        ValueError: for other `bits` than 8 or 4.
        NotImplementedError: when this PyTorch build has no kernel for that width on the model's device.
    """
    if bits not in BITS:
        raise ValueError(f"quantize_weights takes bits=8 (int8 weights) or bits=4 (int4 weights), got {bits}")
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linears = [(parent, name, child) for parent in list(model.modules()) for name, child in parent.named_children()
               if type(child) is nn.Linear and (output_head or child is not head)]
    if bits == 4:
        left = [child for _, _, child in linears if not fits(child, group_size)]
        if left:
            logger.warning("left %d linear layers in float: their input widths (%s) are not multiples of the int4 "
                           "group size %d", len(left), sorted({c.in_features for c in left}), group_size)
        linears = [entry for entry in linears if fits(entry[2], group_size)]
    if linears:
        _check_kernel(bits, linears[0][2].weight.device)
    for parent, name, child in linears:
        setattr(parent, name, _quantized(child, bits, group_size))
    return len(linears)


def _quantized(linear: nn.Linear, bits: int, group_size: int) -> nn.Module:
    """`linear` as an `Int8Linear` (``bits=8``) or an `Int4Linear` (``bits=4``, groups of `group_size`)."""
    return Int8Linear(linear) if bits == 8 else Int4Linear(linear, group_size)


def _check_kernel(bits: int, device: torch.device) -> None:
    """`NotImplementedError` naming the device when ATen's product for `bits`-wide weights does not run there: a
    tiny layer of that width is built and run, as every layer will be."""
    try:
        _quantized(nn.Linear(32, 16, device=device), bits, 32)(torch.ones(1, 32, device=device))
    except (RuntimeError, NotImplementedError) as error:
        kernel = "_weight_int8pack_mm" if bits == 8 else "_weight_int4pack_mm_for_cpu"
        raise NotImplementedError(f"int{bits} weights need ATen's {kernel}, which does not run on {device} "
                                  f"here: {error}") from error


QUANTIZE_CHOICES = ("int8", "int8-all", "int4", "int4-all")
"""The names ``--quantize`` takes (server, scripts): the width, and ``-all`` for the output head too."""


def quantize_by_name(model: nn.Module, name: str) -> int:
    """`quantize_weights` as ``--quantize name`` asks (one of `QUANTIZE_CHOICES`); returns how many layers changed."""
    if name not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {', '.join(QUANTIZE_CHOICES)}, got {name!r}")
    width, _, head = name.partition("-")
    return quantize_weights(model, bits=int(width.removeprefix("int")), output_head=head == "all")
