"""`time_linear_shapes` and packing by its verdict: one group per shape and dtype, each timed on both kernels at
every row count; `pack_linears(where=...)` packs just the groups picked; the verdict's rule."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from hf_paged_cache.kernels import PackedLinear, PackedShape, pack_linears, packed_linears_supported, time_linear_shapes
from hf_paged_cache.kernels.linear_timing import PACKED_FASTER, linear_key

pytestmark = pytest.mark.skipif(not packed_linears_supported(), reason="this PyTorch build has no oneDNN")


def test_every_shape_is_timed_on_both_kernels_and_nothing_changes():
    model = tiny_model("llama")
    before = {name: type(module) for name, module in model.named_modules()}
    shapes = time_linear_shapes(model, rows=(1, 4), repeats=2)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    assert len(shapes) == len({s.key for s in shapes}) and {s.key for s in shapes} == {linear_key(m) for m in linears}
    assert sum(s.layers for s in shapes) == len(linears)
    for shape in shapes:
        assert set(shape.stock_ms) == set(shape.packed_ms) == {1, 4}
        assert all(t > 0 for t in (*shape.stock_ms.values(), *shape.packed_ms.values()))
        assert shape.describe().startswith(f"{shape.layers} x [{shape.in_features} -> {shape.out_features}]")
    assert {name: type(module) for name, module in model.named_modules()} == before


def test_pack_linears_packs_only_the_layers_picked():
    model = tiny_model("llama")
    head = linear_key(model.lm_head)
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    expected = sum(linear_key(m) == head for m in linears)
    assert pack_linears(model, where=lambda layer: linear_key(layer) == head) == expected
    assert type(model.lm_head) is PackedLinear
    assert all((type(m) is PackedLinear) == (linear_key(m) == head)
               for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("packed_ms, faster", [
    ({1: 0.5, 16: 0.5}, True),  # twice as fast
    ({1: 1.2, 16: 0.7}, True),  # geometric mean 0.92
    ({1: 1.0, 16: 0.96}, False),  # within the margin: stock keeps its memory
    ({1: 2.0, 16: 0.9}, False),
])
def test_a_group_is_packed_when_clearly_faster_over_the_rows(packed_ms, faster):
    shape = PackedShape(8, 8, torch.float32, 3, stock_ms={1: 1.0, 16: 1.0}, packed_ms=packed_ms)
    assert shape.packed_faster is faster and (shape.ratio < PACKED_FASTER) is faster
