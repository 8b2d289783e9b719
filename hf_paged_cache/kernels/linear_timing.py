"""`time_linear_shapes`: whether a model's linear layers multiply faster packed for oneDNN or on the stock kernels,
timed on this CPU.

Which kernel wins depends on the CPU, not only on its instruction sets: on a 2-core AMD EPYC, MKL (the stock
float32 path) passes over its fast kernels and the packed layers ran a decode step 1.8x to 4x faster; on a
2-core Intel Xeon (Sapphire Rapids), where MKL takes them, the packed decoder layers ran a one-row step 0.80x
the stock ones and were level at 16 rows, while the output head gained (1.16x at one row, 1.36x at 16). So
the choice is measured, per group of layers of one shape: every layer of the group is multiplied in turn (each
its own weight, as a forward streams them, not one weight again from the cache) by a batch of each size in
`rows`, stock and packed alternated, and the group is packed when packed is clearly faster over those sizes
(`PackedShape.packed_faster`). A tie stays stock: packing doubles the memory of those weights.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .packed_linear import BATCH_HINT, packing_probe

ROWS = (1, 16)
"""Batch sizes a group is timed at: one client's decode step, and a full one."""
REPEATS = 5
"""Timed passes of each kernel (after one warm-up pass), medians taken."""
PACKED_FASTER = 0.95
"""The geometric mean over `ROWS` of packed / stock time below which a group is packed."""


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
    def ratio(self) -> float:
        """Packed time over stock time, the geometric mean over the rows timed."""
        ratios = [self.packed_ms[rows] / self.stock_ms[rows] for rows in self.stock_ms]
        return math.exp(sum(map(math.log, ratios)) / len(ratios))

    @property
    def packed_faster(self) -> bool:
        return self.ratio < PACKED_FASTER

    def describe(self) -> str:
        times = ", ".join(f"{rows} rows {self.stock_ms[rows]:.2f} / {self.packed_ms[rows]:.2f} ms"
                          for rows in self.stock_ms)
        choice = "packed" if self.packed_faster else "stock"
        return (f"{self.layers} x [{self.in_features} -> {self.out_features}] {self.dtype}: stock / packed {times}, "
                f"{self.ratio:.2f}x the time packed: {choice}")


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
