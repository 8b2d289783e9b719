"""`time_linear_shapes` and packing by its verdict (`pack_timed`): one group per shape and dtype, each timed on both
kernels at every row count; the verdict's rule; `pack_linears(where=...)` packs just the groups picked, and a
`PackedLinear` takes the stock kernel below its `stock_below` rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model
from torch import nn

from hf_paged_cache.kernels import (
    PackedLinear, PackedShape, pack_linears, pack_timed, packed_linears_supported, time_linear_shapes,
)
from hf_paged_cache.kernels.linear_timing import linear_key

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


@pytest.mark.parametrize("packed_ms, packed_from", [
    ({1: 0.5, 4: 0.5, 16: 0.5}, 1),  # faster at every size
    ({1: 1.2, 4: 0.9, 16: 0.7}, 4),  # slower for one row
    ({1: 0.5, 4: 1.1, 16: 0.7}, 16),  # faster at 1 and 16 but not 4: stock below 16
    ({1: 1.0, 4: 0.97, 16: 0.96}, None),  # within the margin everywhere: stock keeps its memory
    ({1: 0.5, 4: 0.5, 16: 1.2}, None),  # slower at the largest size
])
def test_a_group_is_packed_from_the_rows_where_it_stays_clearly_faster(packed_ms, packed_from):
    shape = PackedShape(8, 8, torch.float32, 3, stock_ms={1: 1.0, 4: 1.0, 16: 1.0}, packed_ms=packed_ms)
    assert shape.packed_from == packed_from
    assert shape.describe().endswith("stock" if packed_from is None else f"packed from {packed_from} rows")


def test_pack_timed_packs_each_group_from_its_rows_and_smaller_products_take_the_stock_kernel():
    model = tiny_model("llama")
    shapes = time_linear_shapes(model, rows=(1, 4), repeats=1)
    verdicts = [{1: 0.5, 4: 0.5}, {1: 2.0, 4: 0.5}] + [{1: 2.0, 4: 2.0}] * (len(shapes) - 2)
    for shape, ratios in zip(shapes, verdicts):
        shape.packed_ms = {rows: shape.stock_ms[rows] * ratio for rows, ratio in ratios.items()}
    expected = {shapes[0].key: 1, shapes[1].key: 4}
    assert pack_timed(model, shapes) == shapes[0].layers + shapes[1].layers
    for layer in model.modules():
        if isinstance(layer, nn.Linear):
            assert (type(layer) is PackedLinear) == (linear_key(layer) in expected)
            if type(layer) is PackedLinear:
                assert layer.stock_below == expected[linear_key(layer)]
    layer = next(m for m in model.modules() if type(m) is PackedLinear and m.stock_below == 4)
    packed = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), layer.batch_hint)
    for rows in (1, 3, 4, 9):
        x = torch.randn(rows, layer.in_features)
        kernel = (F.linear(x, layer.weight, layer.bias) if rows < 4
                  else torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], ""))
        with torch.no_grad():
            assert torch.equal(layer(x), kernel)  # bit for bit: the kernel its rows call for
    with torch.no_grad():
        x = torch.randn(2, 2, layer.in_features)  # 4 rows in two leading dimensions: packed
        assert torch.equal(layer(x), torch.ops.mkldnn._linear_pointwise(x, packed, layer.bias, "none", [], ""))
