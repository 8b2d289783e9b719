"""Row tiles: a linear layer whose every row comes out the same whatever rows share its call.

A CPU matrix product picks its kernel and blocking by the shape it is given: the same input row, multiplied
alone, beside 6 others or beside 63, can be summed in another order and round differently (measured on a 2-core
AMD EPYC, float32: MKL's ``F.linear`` by up to 2.6e-6, oneDNN's packed product by up to 7.6e-6 at 1,536 inputs,
where one row takes another kernel than two or more). Called with a row count that is always a multiple of a
small number (there: 1, any count, for oneDNN's other shapes, 2 at 1,536 inputs, 4 for MKL), at most
`MAX_ROWS_PER_CALL` rows at a time, every kernel measured there gives each row the same bits whatever the others
are and wherever the row sits. Where no multiple does (on an Intel Xeon with AMX, oneDNN's bfloat16 products and
MKL's ``addmm`` sum a call of 64 rows in another order than one of 16), calls of exactly one row count do: the
kernel then always sees one shape. `tile_rows` finds the tile for each layer on the machine at hand (`tiles_probe`,
trying `ROW_TILES` in turn) and makes the layer use it (`tiled_forward`: its input's rows padded with zeros to
whole tiles, the output cut back). The layer's class, parameters and ``state_dict`` stay as they are, and
`untile_rows` gives it its own forward back.

What this costs: a decode step of one row multiplies a tile's rows in the layers that need one (2: nearly free on
weights that stream from memory; 16 rows for exact tiles), and a prefill longer than `MAX_ROWS_PER_CALL` tokens
(or than an exact tile) is cut into calls of that many rows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from .int4_linear import Int4Linear
from .int8_linear import Int8Linear
from .packed_linear import PackedLinear

MAX_ROWS_PER_CALL = 256
"""A tiled layer's input of more rows is multiplied in calls of this many (the last one padded to a tile), so the
kernels see row counts `tiles_probe` checked."""


@dataclass(frozen=True)
class RowTile:
    """How a tiled layer groups its rows: calls of a multiple of `rows` rows (at most `MAX_ROWS_PER_CALL`), or, when
    `exact`, calls of exactly `rows` rows."""

    rows: int
    exact: bool = False

    @property
    def rows_per_call(self) -> int:
        """The most rows one call multiplies."""
        return self.rows if self.exact else MAX_ROWS_PER_CALL

    def __str__(self) -> str:
        return f"in calls of exactly {self.rows} rows" if self.exact else f"in multiples of {self.rows} rows"


ROW_TILES = (*(RowTile(rows) for rows in (1, 2, 4, 8, 16)), RowTile(16, exact=True), RowTile(64, exact=True))
"""The tiles `tile_rows` tries for a layer, cheapest first: every product of the layer then has a multiple of the
rows of the first one `tiles_probe` accepts (1: any count, where one row takes the same kernel as several; on the
CPUs measured, some shapes take another kernel for one row), or exactly its rows (where a kernel's summation order
changes with the row count however it is rounded)."""
TILED_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, Conv1D, Int8Linear, Int4Linear)
"""The layers `tile_rows` tiles (`PackedLinear` is an `nn.Linear`; transformers' `Conv1D` is GPT-2's linear layer)."""
_PROBE_ROWS = (2, 7, 16, 17, 64, 300)
_PROBE_TARGETS = 64
_LARGE = 2.0**20  # `_cancelling`'s inputs: a product of ~2**15 holds a sum of ~1 to about 2**-9 (float32's 24 bits)


def tiled_forward(module: nn.Module, tile: RowTile, x: torch.Tensor) -> torch.Tensor:
    """`module`'s output for `x` ``[..., K]``, its rows multiplied as whole tiles: padded with zero rows to the next
    multiple of the tile's rows, in calls of at most `RowTile.rows_per_call` rows, the padding cut off again."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    flat = x.reshape(rows, x.shape[-1])  # [R, K]: the 2-D products the probe checked
    per_call = tile.rows_per_call
    if rows % tile.rows == 0 and 0 < rows <= per_call:  # whole tiles already: one call, nothing to pad
        out = module.forward_untiled(flat)
        return out.view(*x.shape[:-1], out.shape[-1])
    if rows % tile.rows or not rows:
        flat = F.pad(flat, (0, 0, 0, tile.rows - rows % tile.rows))  # [R', K]: zero rows to the next multiple
    if flat.shape[0] <= per_call:
        out = module.forward_untiled(flat)  # [R', N]
    else:
        out = torch.cat([module.forward_untiled(part) for part in flat.split(per_call)])
    return out[:rows].reshape(*x.shape[:-1], out.shape[-1])


def tile_rows(model: nn.Module) -> int:
    """Tile the rows of every layer of `model` of the `TILED_TYPES`, in place (idempotent), each with the first of
    `ROW_TILES` that `tiles_probe` accepts for its kind and shape; returns how many layers it tiled.

    A tiled `PackedLinear` packs every product (``stock_below`` 0): the stock kernel for the smallest calls would
    make the kernel depend on the rows.

    Raises:
        RuntimeError: no tile gives some layer's rows the same bits beside other rows on this machine (then no
            layer is changed).
    """
    dtype = getattr(model, "dtype", torch.float32)  # the activations' dtype
    layers = [m for m in model.modules() if isinstance(m, TILED_TYPES) and not is_tiled(m)]
    tiles = [row_tile(type(layer), *_features(layer), dtype) for layer in layers]  # probes, first
    for layer, tile in zip(layers, tiles):
        if isinstance(layer, PackedLinear):
            layer.stock_below = 0
        _install(layer, tile)
    return len(layers)


def row_tile(kind: type[nn.Module], in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> RowTile:
    """The first of `ROW_TILES` that gives a layer of this kind, shape and bias each row's same bits beside any
    other rows here (`tiles_probe`, at the current thread count).

    Raises:
        RuntimeError: none does.
    """
    threads = torch.get_num_threads()
    problems = []
    for tile in ROW_TILES:
        problem = tiles_probe(kind, in_features, out_features, bias, dtype, threads, tile)
        if not problem:
            return tile
        problems.append(f"{tile}: {problem}")
    raise RuntimeError(f"batch-invariant products are not available for {kind.__name__}({in_features}, "
                       f"{out_features}) in {dtype}: " + "; ".join(problems))


def is_tiled(module: nn.Module) -> bool:
    """Whether `tile_rows` tiled `module`."""
    return "forward_untiled" in module.__dict__


def untile_rows(model: nn.Module) -> int:
    """Give every layer of `model` that `tile_rows` tiled its class's own forward back; returns how many. (A
    `PackedLinear` keeps packing every product: its ``stock_below`` stays 0.)"""
    layers = [m for m in model.modules() if is_tiled(m)]
    for layer in layers:
        del layer.forward, layer.forward_untiled
    return len(layers)


def _features(layer: nn.Module) -> tuple[int, int, bool]:
    """`layer`'s input and output widths, and whether it adds a bias (a kernel may fuse it: another kernel)."""
    if isinstance(layer, Conv1D):
        return layer.nx, layer.nf, True
    return layer.in_features, layer.out_features, getattr(layer, "bias", None) is not None


def _install(layer: nn.Module, tile: RowTile) -> None:
    """Route `layer`'s calls through `tiled_forward` in `tile`s (an instance attribute over the class's ``forward``,
    which ``nn.Module.__call__`` and its hooks go on calling as before)."""
    layer.forward_untiled = layer.forward  # the class's own product, bound
    layer.forward = functools.partial(tiled_forward, layer, tile)


@functools.cache
def tiles_probe(kind: type[nn.Module], in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                threads: int, tile: RowTile) -> str:
    """Why a layer of this kind, shape and bias, tiled in `tile`s, would not give a row of
    `dtype` the same bits whatever rows share its call, at `threads` threads; "" when it does. Checked on random
    weights: `_PROBE_TARGETS` rows, each computed alone, then among random inputs of `_PROBE_ROWS` rows (as many of
    them as fit, at the start and at the end). Half the target rows' inputs cancel (`_cancelling`), because on
    random inputs another summation order changes only a few of a row's outputs (in bfloat16 about one in ten
    thousand: measured, 1,536 inputs, one row against 32). Cached.
    """
    with torch.inference_mode(False), torch.no_grad():  # plain tensors, even when asked under inference mode
        return _probe(kind, in_features, out_features, bias, dtype, threads, tile)


def _probe(kind: type[nn.Module], in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
           threads: int, tile: RowTile) -> str:
    generator = torch.Generator().manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=torch.float32)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features ** 0.5  # [N, K]
    half = in_features // 2
    weight[:, half : 2 * half] = weight[:, :half]  # input j and j + K/2 meet the same weights: see `_cancelling`
    linear.weight.copy_(weight)
    if bias:
        linear.bias.copy_(torch.randn(out_features, generator=generator))
    layer = _probe_layer(kind, linear, dtype)
    _install(layer, tile)
    targets = torch.randn(_PROBE_TARGETS, in_features, generator=generator)  # [T, K]
    _cancelling(targets[_PROBE_TARGETS // 2 :], generator)  # half random, half cancelling: each shows other orders
    targets = targets.to(dtype)
    alone = torch.cat([layer(row) for row in targets.split(1)])  # [T, N], each row in a call of its own
    for rows in _PROBE_ROWS:
        count = min(rows, _PROBE_TARGETS)
        for at in (0, rows - count):  # the targets first, then last
            batch = torch.randn(rows, in_features, generator=generator).to(dtype)  # [rows, K]
            batch[at : at + count] = targets[:count]
            if not torch.equal(layer(batch)[at : at + count], alone[:count]):
                return f"a row's product changed among {rows} rows (rows {at}-{at + count - 1}) at {threads} threads"
    return ""


def _cancelling(rows: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """`rows` ``[T, K]`` with, in each row, a large input and its negative at a random j and j + K/2 (the probe's
    weights are equal there), so that each output holds a sum whose rounding shows the order of its terms.

    The two products cancel exactly, but the terms summed while only one of them is in the running sum lose their
    low bits to it, and which terms those are depends on how the kernel splits and orders the sum. Measured on an
    Intel Xeon with AMX, whose bfloat16 ``nn.Linear(576, 576)`` rounds rows from the 33rd of a call on in another
    order than a row alone: 64 rows put there changed 0.005% of their outputs (2 rows) on random inputs, which a
    probe of random rows missed, and 45% (all 64 rows) on these.
    """
    half = rows.shape[1] // 2
    if half:
        at = torch.randint(0, half, (rows.shape[0],), generator=generator)  # [T]
        picked = torch.arange(rows.shape[0])
        rows[picked, at] = _LARGE
        rows[picked, at + half] = -_LARGE
    return rows


def _probe_layer(kind: type[nn.Module], linear: nn.Linear, dtype: torch.dtype) -> nn.Module:
    """A `kind` layer made from `linear`, taking `dtype` activations, for `tiles_probe`."""
    if issubclass(kind, PackedLinear):
        return kind(linear.to(dtype))
    if issubclass(kind, (Int8Linear, Int4Linear)):
        return kind(linear)
    if issubclass(kind, Conv1D):
        layer = kind(linear.out_features, linear.in_features)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.T)  # [K, N]
            layer.bias.copy_(linear.bias if linear.bias is not None else torch.zeros_like(layer.bias))
        return layer.to(dtype)
    layer = kind(linear.in_features, linear.out_features, bias=linear.bias is not None)  # nn.Linear's signature
    layer.load_state_dict(linear.state_dict())
    return layer.to(dtype)
