"""`pack_linears`: run a model's `nn.Linear` layers through oneDNN on weights packed once, on CPUs.

A decode step multiplies a handful of rows by every weight of the model. PyTorch's CPU wheels send float32
``F.linear`` to MKL, whose small-batch kernels run far below the machine's speed on some CPUs (measured on a
2-core AMD EPYC with AVX-512: a ``[16, 576] x [576, 1536]`` product in 391 us against 177 us through oneDNN, and
SmolLM2-135M's ``[49152, 576]`` output head at 16 rows in 30.6 ms against 7.7 ms). oneDNN (which PyTorch ships
as ``mkldnn``) multiplies by a weight reordered once into its blocked layout; `PackedLinear` keeps that packed
copy beside the weight and uses it whenever no gradient is wanted.

The results are the same products summed in another order: float32 rounding apart (relative differences
about 1e-6), so greedy tokens agree with the stock model except at exact near-ties of the two top logits.
The packed copies double the memory of the linear weights. Nothing changes for training or autograd, for
other devices, or for dtypes oneDNN does not take here (only float32 and bfloat16 are packed).

Whether oneDNN takes a dtype on this CPU is asked, not assumed (`packing_probe`): PyTorch's bfloat16 path needs
AVX-512 BW/VL/DQ or AVX-NE-CONVERT, and on an AVX2-only CPU it raises at the first product. `pack_linears`
leaves the layers of a dtype the probe refuses on the stock kernels, with one log line naming the reason, and
`PackedLinear` itself takes the stock path for such a dtype (a model cast after packing).

Under ``torch.compile`` a `PackedLinear` calls ``torch.ops.hf_paged_cache.packed_linear``, an operator opaque to
inductor whose body runs the layer's own eager forward (a graph can hold the layer's number, not the layer or its
packed weight, which is no tensor inductor can trace): so a compiled forward keeps the packed products, which
inductor would otherwise replace with ``mm`` calls for any shape it does not know in advance.
"""

from __future__ import annotations

import functools
import itertools
import logging
import weakref
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .cpu_capability import BFLOAT16_PACKING_LEVEL, cpu_capability

logger = logging.getLogger(__name__)

PACKED_DTYPES = (torch.float32, torch.bfloat16)
BATCH_HINT = 16
"""Rows oneDNN tunes the packed layout for: a decode step's batch (any row count works, this one best)."""


def packed_linears_supported() -> bool:
    """Whether this PyTorch build has the oneDNN linear operators `PackedLinear` calls."""
    if not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    return hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")


class Probe(NamedTuple):
    """A probe's answer: whether the path runs here and, when it does not, why."""

    supported: bool
    reason: str  # "" when supported


@functools.cache
def packing_probe(dtype: torch.dtype) -> Probe:
    """Whether `PackedLinear` can multiply `dtype` through oneDNN on this CPU (cached per dtype).

    Asked by running one packed product on a tiny tensor and comparing it with ``F.linear``'s: a build or CPU
    that cannot run it answers no with the operator's own error. ``HF_PAGED_CACHE_CPU_CAPABILITY`` below
    ``avx512`` refuses bfloat16 as an AVX2-only CPU does (`cpu_capability`).
    """
    if dtype not in PACKED_DTYPES:
        return Probe(False, f"only {' and '.join(map(str, PACKED_DTYPES))} are packed, not {dtype}")
    if not packed_linears_supported():
        return Probe(False, "this PyTorch build has no oneDNN (mkldnn) linear operators")
    capability = cpu_capability()
    if dtype == torch.bfloat16 and capability.capped_by and not capability.at_least(BFLOAT16_PACKING_LEVEL):
        return Probe(False, f"oneDNN's bfloat16 products need AVX-512 (BW, VL, DQ); CPU: {capability.describe()}")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=generator).to(dtype)  # [rows, in]
    weight = torch.randn(8, 32, generator=generator).to(dtype)  # [out, in]
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # [rows, out]
    except RuntimeError as error:
        return Probe(False, f"oneDNN refused a {dtype} product here: {str(error).splitlines()[0]}")
    expected = F.linear(x, weight)
    if got.shape != expected.shape or not torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2):
        return Probe(False, f"oneDNN's {dtype} product differs from F.linear's here")
    return Probe(True, "")


_LAYERS: weakref.WeakValueDictionary[int, PackedLinear] = weakref.WeakValueDictionary()
"""The `PackedLinear` layers alive, by `PackedLinear.number`: what the compiled operator looks its layer up in."""
_NUMBERS = itertools.count()


def _packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, number: int) -> torch.Tensor:
    """`PackedLinear` `number`'s product of `x` ``[..., in]`` (its `weight` and `bias` are passed so the graph
    orders the call after any change to them): ``[..., out]``."""
    layer = _LAYERS.get(number)
    if layer is None:
        raise RuntimeError(f"packed linear layer {number} no longer exists")
    return layer.eager_forward(x)


# defined with the low-level API: `torch.library.custom_op`'s wrapper costs ~35 us a call, as much as a small product
_LIBRARY = torch.library.Library("hf_paged_cache", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor weight, Tensor? bias, int number) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("hf_paged_cache::packed_linear", lib=_LIBRARY)
def _(x, weight, bias, number) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


class PackedLinear(nn.Linear):
    """An `nn.Linear` that multiplies by a oneDNN-packed copy of its weight when no gradient is wanted.

    It holds the original `weight` and `bias` parameters (shared, not copied: tied weights stay tied, and
    ``state_dict`` is unchanged). The packed copy is made on first use and again whenever the weight is
    replaced, moved, cast or changed in place (its version counter), so it never goes stale. A product of fewer
    than `stock_below` rows (the leading dimensions of its input, multiplied) takes the stock kernel on the
    weight it holds anyway: where timings found the stock kernel faster for small batches (`pack_timed`).
    """

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, stock_below: int = 0):
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.bias = linear.bias
        self.batch_hint = batch_hint
        self.stock_below = stock_below
        self._packed: torch.Tensor | None = None
        self._packed_from: tuple[int, int, torch.dtype, torch.device] | None = None
        self.number = next(_NUMBERS)  # this layer in `_LAYERS`, for the compiled operator
        _LAYERS[self.number] = self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and not (torch.is_grad_enabled() and self.weight.requires_grad):
            return torch.ops.hf_paged_cache.packed_linear(x, self.weight, self.bias, self.number)
        return self.eager_forward(x)

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The product, through the packed weight when no gradient is wanted (else the stock kernel)."""
        weight = self.weight
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
        small = self.stock_below and x.numel() < self.stock_below * x.shape[-1]  # fewer rows than stock_below
        stock = wants_grad or small or weight.device.type != "cpu" or x.dtype != weight.dtype
        packed = None if stock else self._packed_weight()
        if packed is None:
            return F.linear(x, weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")

    def _packed_weight(self) -> torch.Tensor | None:
        """The weight packed for oneDNN, packed again when it changed; None where `packing_probe` refuses its dtype
        (asked once per change of weight, not per product)."""
        weight = self.weight
        source = (id(weight), weight._version, weight.dtype, weight.device)
        if self._packed_from != source:
            self._packed = None
            if packing_probe(weight.dtype).supported:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), self.batch_hint)
            self._packed_from = source
        return self._packed

    def extra_repr(self) -> str:
        below = f" from {self.stock_below} rows" if self.stock_below > 1 else ""
        return f"{super().extra_repr()}, packed for oneDNN{below}"


def pack_linears(model: nn.Module, batch_hint: int = BATCH_HINT, *, strict: bool = False,
                 where: Callable[[nn.Linear], bool] | None = None) -> int:
    """Make every plain `nn.Linear` of `model` a `PackedLinear`, in place; returns how many it changed.

    Idempotent (a `PackedLinear` is left as it is). Subclasses of `nn.Linear` (quantized or parallel
    layers) keep their own forward. Layers whose weight's dtype `packing_probe` refuses on this CPU stay
    stock, with one log line per dtype naming the reason; with ``strict=True`` that is an error instead.
    `where`, when given, picks the layers to pack (e.g. those `time_linear_shapes` found faster packed).

    Raises:
        NotImplementedError: on a PyTorch build without oneDNN; with ``strict=True``, for a layer on the CPU
            whose dtype cannot be packed here.
    """
    if not packed_linears_supported():
        raise NotImplementedError("this PyTorch build has no oneDNN (mkldnn) linear operators to pack weights for")
    linears = [(parent, name, child) for parent in list(model.modules())
               for name, child in parent.named_children()
               if type(child) is nn.Linear and (where is None or where(child))]
    refused = Counter(child.weight.dtype for _, _, child in linears
                      if child.weight.device.type == "cpu" and not packing_probe(child.weight.dtype).supported)
    for dtype, count in refused.items():
        reason = packing_probe(dtype).reason
        if strict:  # before any layer changed
            raise NotImplementedError(f"cannot pack {count} {dtype} linear layers: {reason}")
        logger.warning("left %d %s linear layers on PyTorch's stock kernels: %s", count, dtype, reason)
    changed = 0
    for parent, name, child in linears:
        if child.weight.dtype not in refused or child.weight.device.type != "cpu":
            setattr(parent, name, PackedLinear(child, batch_hint))
            changed += 1
    return changed
