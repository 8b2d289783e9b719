"""Weight-only int8 linear layers (`quantize_weights`): the codes stand for the weight within half a scale step and
the product is ATen's on those codes (closeness to the float model and the cache's exactness on it:
`test_int4_linear.py`, for both widths)."""

import pytest
import torch
from tiny_models import tiny_model
from torch import nn

from hf_paged_cache.kernels import Int8Linear, pack_linears, quantize_weights


def test_the_codes_stand_for_the_weight_and_the_product_is_theirs():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Int8Linear(linear)
    assert layer.codes.dtype == torch.int8 and int(layer.codes.abs().max()) <= 127
    step = layer.scale.float().unsqueeze(1)  # [N, 1]
    assert bool(((layer.dequantized() - linear.weight).abs() <= step / 2 + 1e-7).all())
    x = torch.randn(3, 5, 64)
    expected = x.bfloat16().float() @ layer.dequantized().T + linear.bias  # the same product in float32
    out = layer(x)
    assert out.shape == (3, 5, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.detach(), rtol=2e-2, atol=2e-2)
    float_out = linear(x).detach()
    assert float((out - float_out).norm() / float_out.norm()) < 2e-2


def test_the_output_head_too_when_asked():
    model = tiny_model("llama")
    linears = sum(type(module) is nn.Linear for module in model.modules())
    assert quantize_weights(model, output_head=True) == linears
    assert isinstance(model.get_output_embeddings(), Int8Linear) and pack_linears(model) == 0


def test_other_widths_are_refused():
    with pytest.raises(ValueError, match="bits=8 .* or bits=4"):
        quantize_weights(tiny_model("llama"), bits=3)
