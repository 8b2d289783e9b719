"""`time_linear_shapes` and `pack_timed`: which kernel multiplies a model's linear layers faster on this CPU, for
each batch size, timed rather than assumed.

Which kernel wins depends on the CPU and on the rows of a product, not only on instruction sets: on a 2-core
AMD EPYC, MKL (the stock float32 path) passes over its fast kernels and the packed layers ran a decode step 1.8x
to 4x faster; on a 2-core Intel Xeon (Sapphire Rapids), where MKL takes them, a one-row step ran 0.80x as fast
packed, while at 16 rows the MLP's layers and the output head ran faster packed. So the choice is measured,
per group of layers of one shape: every layer of the group is multiplied in turn (each its own weight, as a
forward streams them, not one weight again from the cache) by a batch of each size in `rows`, stock and packed
alternated. A group is packed from the fewest rows at which packed is clearly faster (`PACKED_FASTER`) at that
size and every larger one timed (`PackedShape.packed_from`); smaller products keep the stock kernel on the
weight the layer holds anyway (`PackedLinear.stock_below`). A group packed at no size stays stock: packing
doubles the memory of those weights.
"""


from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import BATCH_HINT, PackedLinear, pack_linears, packing_probe

ROWS = (1, 4, 16)
"""Batch sizes a group is timed at: one client's decode step, a few, and a full one."""
REPEATS = 5
"""Timed passes of each kernel (after one warm-up pass), medians taken."""
PACKED_FASTER = 0.95
"""The packed / stock time below which packed is taken to be faster at a batch size (a tie stays stock)."""


@dataclass
class PackedShape:
    """One group of same-shaped linear layers and its timings: ``rows -> median milliseconds`` for a pass of
    every layer of the group, on each kernel."""

    in_features: int
    out_features: int
    dtype: torch.dtype
    layers: int
    stock_ms: dict[int, float] = field(default_factory=dict)
    packed_ms: dict[int, float] = field(default_factory=dict)

    @property
    def key(self) -> tuple[int, int, torch.dtype]:
        return self.in_features, self.out_features, self.dtype

    @property
    def packed_from(self) -> int | None:
        """The fewest rows timed from which packed is clearly faster at that size and every larger one timed
        (None: at none)."""
        sizes = sorted(self.stock_ms)
        for number, rows in enumerate(sizes):
            if all(self.packed_ms[size] < PACKED_FASTER * self.stock_ms[size] for size in sizes[number:]):
                return rows
        return None

    def describe(self) -> str:
        times = ", ".join(f"{rows} rows {self.stock_ms[rows]:.2f} / {self.packed_ms[rows]:.2f} ms"
                          for rows in sorted(self.stock_ms))
        choice = "stock" if self.packed_from is None else f"packed from {self.packed_from} rows"
        shape = f"{self.layers} x [{self.in_features} -> {self.out_features}] {self.dtype}"
        return f"{shape}: stock / packed {times}: {choice}"


def linear_key(layer: nn.Linear) -> tuple[int, int, torch.dtype]:
    """The group a linear layer is timed in."""
    return layer.in_features, layer.out_features, layer.weight.dtype


@torch.no_grad()
def time_linear_shapes(model: nn.Module, rows: tuple[int, ...] = ROWS, repeats: int = REPEATS) -> list[PackedShape]:
    """Each group of `model`'s plain CPU `nn.Linear` layers of one shape and dtype (one the packing probe takes),
    timed stock and packed at `rows` rows (module docstring). Nothing of `model` changes."""
    groups: dict[tuple[int, int, torch.dtype], list[nn.Linear]] = {}
    for layer in model.modules():
        on_cpu = type(layer) is nn.Linear and layer.weight.device.type == "cpu"
        if on_cpu and packing_probe(layer.weight.dtype).supported:
            groups.setdefault(linear_key(layer), []).append(layer)
    shapes = []
    for (in_features, out_features, dtype), layers in groups.items():
        shape = PackedShape(in_features, out_features, dtype, len(layers))
        weights = [layer.weight.detach() for layer in layers]  # [out, in] each
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight, BATCH_HINT) for weight in weights]
        for count in rows:
            x = torch.randn(count, in_features).to(dtype)  # [rows, in]
            stock_pass = [lambda w=w: F.linear(x, w) for w in weights]
            packed_pass = [lambda p=p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
            stock, packed_times = [], []
            for repeat in range(repeats + 1):  # the first pass of each warms up
                for calls, times in ((stock_pass, stock), (packed_pass, packed_times)):
                    start = time.perf_counter()
                    for call in calls:
                        call()
                    if repeat:
                        times.append((time.perf_counter() - start) * 1e3)
            shape.stock_ms[count] = statistics.median(stock)
            shape.packed_ms[count] = statistics.median(packed_times)
        shapes.append(shape)
    return shapes


def pack_timed(model: nn.Module, shapes: list[PackedShape]) -> int:
    """Pack the layers of `model` whose group `shapes` (`time_linear_shapes`) found faster packed at some size,
    each taking the stock kernel below its group's `PackedShape.packed_from` rows; returns how many it packed."""
    packed_from = {shape.key: shape.packed_from for shape in shapes if shape.packed_from is not None}
    count = pack_linears(model, where=lambda layer: linear_key(layer) in packed_from)
    for layer in model.modules():
        if isinstance(layer, PackedLinear) and linear_key(layer) in packed_from:
            layer.stock_below = packed_from[linear_key(layer)]
    return count
