"""How keys and values are stored in the pool: the element type, and for 8-bit types their scales.

`KVFormat` says what one stored vector (one token's keys, or values, for one head) costs and how it is
encoded; `StoredStates` is one layer's keys (or values) in the pool: it writes new states through the
format and reads them back in the model's dtype.

Formats (`kv_format`):

- the model's dtype (the default): stored as computed, read back bit for bit;
- ``"bfloat16"``, ``"float16"`` (or ``"float32"``) under another model dtype: a plain cast when written;
- ``"int8"``: symmetric, one float32 scale per token and head (``absmax / 127``), so a vector of ``D``
  elements costs ``D + 4`` bytes instead of ``4 D`` (0.27x of float32 for ``D = 64``);
- ``"float8_e4m3fn"``: the same, with the scale mapping ``absmax`` to 448, where torch has the type.

Why per token and head: a token's keys are quantized once, when written, and never again (a scale per
block and head would change as the block fills and force its earlier tokens to be quantized again, or be
fixed by the block's first token). A scale per token also follows the outlier tokens of attention (the
first token's keys are often far larger than the rest) without coarsening their neighbours. The scales cost
4 bytes per head-vector: 6% of an int8 vector of 64 elements.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormat:
    """The element type keys and values are stored in, and whether they carry a scale per token and head."""

    name: str  # as the user spells it: "int8", "float8_e4m3fn", "bfloat16", ...
    storage: torch.dtype  # element type of the stored vectors
    qmax: float | None = None  # scaled formats: the largest magnitude an element encodes; None: a plain cast

    @property
    def scaled(self) -> bool:
        return self.qmax is not None

    def vector_bytes(self, dim: int) -> int:
        """Bytes one stored vector of `dim` elements costs, its scale included."""
        return dim * self.storage.itemsize + (SCALE_DTYPE.itemsize if self.scaled else 0)

    def encode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[N, H, D]`` states as stored: ``(elements [N, H, D], scales [N, H, 1] or None)``."""
        if not self.scaled:
            return states.to(self.storage), None
        states = states.to(SCALE_DTYPE)
        scale = states.abs().amax(dim=-1, keepdim=True) / self.qmax  # [N, H, 1]
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero vector: any scale
        scaled = (states / scale).clamp_(-self.qmax, self.qmax)  # rounding may put absmax a hair past qmax
        if self.storage == torch.int8:
            scaled = scaled.round_()
        return scaled.to(self.storage), scale

    def decode(self, elements: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """Stored `elements` ``[..., D]`` (with `scale` ``[..., 1]``) back in `dtype`."""
        if scale is None:
            return elements.to(dtype)
        return (elements.to(SCALE_DTYPE) * scale).to(dtype)

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
        return KVFormat(name, storage, qmax=127.0)
    if storage.is_floating_point and torch.finfo(storage).bits == 8:
        return KVFormat(name, storage, qmax=float(torch.finfo(storage).max))
    return KVFormat(name, storage)


@dataclass(frozen=True)
class StoredStates:
    """One layer's stored keys (or values) in the pool, read back in the model's dtype.

    `data` is the layer's ``[slots, H, D]`` tensor of the format's elements and `scale` its ``[slots, H, 1]``
    scales (None for a plain format). A *row* is one head of one slot: row ``slot * H + head`` of the flat
    ``[slots * H, D]`` view, which is how attention addresses them.
    """

    data: torch.Tensor  # [slots, H, D]
    scale: torch.Tensor | None  # [slots, H, 1] float32, or None
    format: KVFormat
    dtype: torch.dtype  # what reads return: the model's dtype

    @property
    def num_heads(self) -> int:
        return self.data.shape[1]

    @property
    def dim(self) -> int:
        return self.data.shape[-1]

    @property
    def plain(self) -> torch.Tensor | None:
        """The ``[slots, H, D]`` data when it is stored exactly as read (views of it are ready operands), else None."""
        return self.data if self.scale is None and self.data.dtype == self.dtype else None

    def write(self, slots: torch.Tensor, new: torch.Tensor) -> None:
        """Store `new` ``[N, H, D]`` at `slots` ``[N]``."""
        elements, scale = self.format.encode(new.detach())  # the pool never joins an autograd graph
        writable(self.data).index_copy_(0, slots, writable(elements))
        if scale is not None:
            self.scale.index_copy_(0, slots, scale)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """``[R, D]`` in `dtype`: rows `rows` ``[R]`` of the flat ``[slots * H, D]`` view (a copy)."""
        elements = self.data.view(-1, self.dim).index_select(0, rows)  # [R, D]
        scale = None if self.scale is None else self.scale.view(-1, 1).index_select(0, rows)  # [R, 1]
        if self.plain is not None:
            return elements
        return self.format.decode(elements, scale, self.dtype)


def writable(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, viewed as bytes where CPU kernels lack its type (index_copy_ has no float8 kernel)."""
    return tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.is_floating_point() else tensor
