"""How keys and values are stored in the pool: the element type, and for 8-bit types their scales.

`KVFormat` says what one stored vector (one token's keys, or values, for one head) costs and how it is
encoded; `StoredStates` is one layer's keys (or values) in the pool: it writes new states through the
format and reads them back in the model's dtype.

Formats (`kv_format`):

- the model's dtype (the default): stored as computed, read back bit for bit;
- ``"bfloat16"``, ``"float16"`` (or ``"float32"``) under another model dtype: a plain cast when written;
- ``"int8"``: 8-bit codes, affine in groups of 32 elements: each group keeps its minimum and its step
  (``(max - min) / 255``) as a float16 pair, and an element is ``min + code * step``. A vector of ``D = 64``
  elements costs ``64 + 2 x 4 = 72`` bytes instead of 256 (0.28x of float32);
- ``"float8_e4m3fn"``: symmetric, one float32 scale per token and head mapping ``absmax`` to 448, where torch
  has the type (``D + 4`` bytes).

Why per token and head: a token's keys are quantized once, when written, and never again (a scale per
block and head would change as the block fills and force its earlier tokens to be quantized again, or be
fixed by the block's first token). A scale per token also follows the outlier tokens of attention (the
first token's keys are often far larger than the rest) without coarsening their neighbours.

Why int8 is affine in groups of 32: measured on the default model (greedy rows identical to float32 out of
32 ragged rows of text, with float32 pairs), symmetric codes with one scale per vector kept 20, symmetric
groups of 32 kept 18, affine codes per vector 19 and affine groups of 32 kept 30, as many as bfloat16 (29). Rotary keys sit off
zero within each half of a head (the halves are rotated as pairs), which a symmetric code spends half its
levels on. The pair is float16 to keep the cost at 8 bytes a vector: an int8 pool refuses (`ValueError`, the
pool left as it was) a group whose minimum or range float16 cannot hold (beyond 65504).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP = 32  # int8: elements per (minimum, step) pair, where the head dimension divides by it


@dataclass(frozen=True)
class KVFormat:
    """The element type keys and values are stored in, and how a vector's scales are kept (if it has any).

    Three kinds: plain (a cast, no scales), symmetric (``qmax`` set: one scale per vector, ``element x scale``)
    and affine (``affine``: a (minimum, step) pair per group of `GROUP` elements, ``minimum + code x step``).
    """

    name: str  # as the user spells it: "int8", "float8_e4m3fn", "bfloat16", ...
    storage: torch.dtype  # element type of the stored vectors
    qmax: float | None = None  # symmetric formats: the largest magnitude an element encodes
    affine: bool = False  # 8-bit codes 0..255 with a (minimum, step) pair per group

    @property
    def scaled(self) -> bool:
        """Whether vectors carry scales (`scale_shape`) beside their elements."""
        return self.qmax is not None or self.affine

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.float16 if self.affine else torch.float32

    @property
    def description(self) -> str:
        """The name, and for a scaled format how it keeps its scales (for logs and reports)."""
        if self.affine:
            return f"{self.name} with a float16 minimum and step per {GROUP} elements of each token and head"
        if self.qmax is not None:
            return f"{self.name} with a float32 scale per token and head"
        return self.name

    def scale_shape(self, dim: int) -> tuple[int, int]:
        """``(groups, values per group)`` of one vector's scales: ``(D / 32, 2)`` affine, ``(1, 1)`` symmetric."""
        if self.affine:
            return (dim // GROUP if dim % GROUP == 0 else 1), 2
        return 1, 1

    def vector_bytes(self, dim: int) -> int:
        """Bytes one stored vector of `dim` elements costs, its scales included."""
        if not self.scaled:
            return dim * self.storage.itemsize
        groups, per_group = self.scale_shape(dim)
        return dim * self.storage.itemsize + groups * per_group * self.scale_dtype.itemsize

    def encode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[..., D]`` states as stored: ``(elements [..., D], scales [..., G, P] or None)``."""
        if not self.scaled:
            return states.to(self.storage), None
        *lead, dim = states.shape
        groups, _ = self.scale_shape(dim)
        states = states.to(torch.float32).view(*lead, groups, dim // groups)  # [..., G, D/G]
        if self.affine:
            low, high = states.amin(dim=-1, keepdim=True), states.amax(dim=-1, keepdim=True)  # [..., G, 1]
            scales = torch.cat([low, (high - low) / 255], dim=-1).to(self.scale_dtype)  # [..., G, 2]
            if not torch.isfinite(scales).all():
                raise ValueError(f"kv_dtype={self.name!r} keeps each group's minimum and range as float16, and a "
                                 "key or value is beyond its 65504: use kv_dtype=None (or 'bfloat16')")
            low, step = scales.to(torch.float32).split(1, dim=-1)  # what decode will read back, [..., G, 1] each
            step = torch.where(step > 0, step, torch.ones_like(step))  # a constant group: every code 0
            codes = ((states - low) / step).round_().clamp_(0, 255)
        else:
            scales = states.abs().amax(dim=-1, keepdim=True) / self.qmax  # [..., 1, 1]
            scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero vector: any scale
            codes = (states / scales).clamp_(-self.qmax, self.qmax)  # rounding may put absmax a hair past qmax
        return codes.view(*lead, dim).to(self.storage), scales

    def decode(self, elements: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored `elements` ``[..., D]`` (with `scales` ``[..., G, P]``) back in `dtype`."""
        if scales is None:
            return elements.to(dtype)
        decoded = elements.to(torch.float32)  # a tensor of its own: scaled in place (out-of-place
        grouped = decoded.unflatten(-1, (scales.shape[-2], -1))  # broadcasts cost ~15x on a CPU), [..., G, D/G]
        scales = scales.to(torch.float32)
        if self.affine:
            grouped.mul_(scales[..., 1:]).add_(scales[..., :1])  # minimum + code x step
        else:
            grouped.mul_(scales)
        return decoded.to(dtype)

    def check_device(self, device: torch.device) -> None:
        """Raise `ValueError` if `device` cannot encode and decode this format."""
        try:
            probe = torch.ones(1, 1, 2, device=device)
            self.decode(*self.encode(probe), torch.float32)
        except (RuntimeError, TypeError, NotImplementedError) as error:
            raise ValueError(f"kv_dtype={self.name!r} is not supported on {device}: {error}") from None


KV_DTYPES = ("int8", "float8_e4m3fn", "bfloat16", "float16", "float32")
"""The names `kv_format` takes (besides None, the model's dtype)."""


def kv_format(kv_dtype: str | torch.dtype | None, model_dtype: torch.dtype) -> KVFormat:
    """The `KVFormat` for `kv_dtype`: a name from `KV_DTYPES` or a torch dtype; None is `model_dtype` itself.

    Raises `ValueError` for anything else (``"int4"``, say) or for a type this torch build does not have.
    """
    if kv_dtype is None:
        return KVFormat(str(model_dtype).removeprefix("torch."), model_dtype)
    name = str(kv_dtype).removeprefix("torch.") if isinstance(kv_dtype, (str, torch.dtype)) else None
    if name not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)} (or None: the model's dtype), got {kv_dtype!r}")
    storage = getattr(torch, name, None)
    if not isinstance(storage, torch.dtype):
        raise ValueError(f"kv_dtype={name!r} needs a torch build with torch.{name} (this is torch {torch.__version__})")
    if name == "int8":
        return KVFormat(name, torch.uint8, affine=True)
    if storage.is_floating_point and torch.finfo(storage).bits == 8:
        return KVFormat(name, storage, qmax=float(torch.finfo(storage).max))
    return KVFormat(name, storage)


@dataclass(frozen=True)
class StoredStates:
    """One layer's stored keys (or values) in the pool, read back in the model's dtype.

    `data` is the layer's head-major ``[H, slots, D]`` tensor of the format's elements and `scale` its
    ``[H, slots, G, P]`` scales (`KVFormat.scale_shape`; None for a plain format). Head-major, so that a run of
    consecutive slots is, for each head, one contiguous stretch of memory: a ready ``[H, n, D]`` SDPA operand
    (`run`) that reads like `DynamicCache`'s own tensors, and a gather by slot copies contiguous head rows.
    """

    data: torch.Tensor  # [H, slots, D]
    scale: torch.Tensor | None  # [H, slots, G, P] in the format's scale_dtype, or None
    format: KVFormat
    dtype: torch.dtype  # what reads return: the model's dtype

    @property
    def num_heads(self) -> int:
        return self.data.shape[0]

    @property
    def dim(self) -> int:
        return self.data.shape[-1]

    @property
    def plain(self) -> torch.Tensor | None:
        """The ``[H, slots, D]`` data when it is stored exactly as read (views of it are ready operands), else None."""
        return self.data if self.scale is None and self.data.dtype == self.dtype else None

    def write(self, slots: torch.Tensor, new: torch.Tensor) -> None:
        """Store `new` ``[H, N, D]`` at `slots` ``[N]``."""
        new = new.detach() if new.requires_grad else new  # the pool never joins an autograd graph
        if self.plain is not None:
            self.data.index_copy_(1, slots, new)
            return
        elements, scale = self.format.encode(new)
        writable(self.data).index_copy_(1, slots, writable(elements))
        if scale is not None:
            self.scale.index_copy_(1, slots, scale)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        """``[H, N, D]`` in `dtype`: every head at `slots` ``[N]`` (a copy)."""
        elements = self.data.index_select(1, slots)  # [H, N, D]
        if self.plain is not None:
            return elements
        scale = None if self.scale is None else self.scale.index_select(1, slots)  # [H, N, G, P]
        return self.format.decode(elements, scale, self.dtype)

    def run(self, first: int, count: int) -> torch.Tensor:
        """``[1, H, count, D]``: the `count` consecutive slots from `first`, a view of plain storage (no copy)."""
        return self.data[:, first : first + count].unsqueeze(0)


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, viewed as bytes where CPU kernels lack its type (index_copy_ has no float8 kernel)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor
