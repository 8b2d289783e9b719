"""`hf_paged_cache.kernels.pack_linears`: oneDNN-packed linear layers give the stock products, rounding apart."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model
from torch import nn
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.kernels import PackedLinear, pack_linears, packed_linears_supported, packing_probe

pytestmark = pytest.mark.skipif(not packed_linears_supported(), reason="this PyTorch build has no oneDNN")


def _packed(dtype: torch.dtype, tolerance: float):
    """A dtype case that runs where oneDNN multiplies `dtype` on this CPU, and else skips with the probe's reason."""
    probe = packing_probe(dtype)
    return pytest.param(dtype, tolerance, marks=pytest.mark.skipif(not probe.supported, reason=probe.reason))


@pytest.mark.parametrize("dtype, tolerance", [_packed(torch.float32, 1e-5), _packed(torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(7, 48), (2, 5, 48), (3, 0, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_output_matches_linear(dtype, tolerance, shape, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 40, bias=bias, dtype=dtype)
    packed = PackedLinear(linear)
    x = torch.randn(shape, dtype=dtype)
    with torch.inference_mode():
        got, expected = packed(x), linear(x)
    assert got.shape == expected.shape and got.dtype == dtype
    if expected.numel():
        assert (got - expected).abs().max().item() <= tolerance * expected.abs().max().item()


def test_gradients_take_the_stock_path():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8)
    packed = PackedLinear(linear)
    x = torch.randn(4, 16, requires_grad=True)
    out = packed(x)
    assert torch.equal(out, linear(x))  # F.linear itself: bit-identical
    out.sum().backward()
    assert linear.weight.grad is not None and x.grad is not None


def test_a_changed_or_replaced_weight_is_packed_again():
    torch.manual_seed(0)
    linear = nn.Linear(16, 8, bias=False)
    packed = PackedLinear(linear)
    x = torch.randn(3, 16)
    with torch.no_grad():
        packed(x)
        linear.weight.mul_(2)  # in place: the version counter moves
        assert torch.allclose(packed(x), F.linear(x, linear.weight), rtol=1e-5, atol=1e-6)
        packed.weight = nn.Parameter(torch.randn(8, 16))
        assert torch.allclose(packed(x), F.linear(x, packed.weight), rtol=1e-5, atol=1e-6)


def test_pack_linears_keeps_parameters_ties_and_state():
    model = tiny_model("llama")
    model.config.tie_word_embeddings = True
    model.tie_weights()
    keys = set(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert pack_linears(model) == linears > 0
    assert pack_linears(model) == 0  # idempotent
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    assert set(model.state_dict()) == keys


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_paged_cache_stays_exact_on_a_packed_model(model_type):
    """Packing changes the model, not the cache: on the packed model `PagedCache` gives `DynamicCache`'s tokens."""
    model = tiny_model(model_type)
    reference = model.generate(input_ids=torch.tensor([[5, 9, 3, 7]]), max_new_tokens=12, do_sample=False,
                               cache=DynamicCache(config=model.config))
    pack_linears(model)
    inputs = {"input_ids": torch.tensor([[5, 9, 3, 7], [0, 0, 4, 8]]),
              "attention_mask": torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1]])}
    dense = model.generate(**inputs, max_new_tokens=12, do_sample=False, cache=DynamicCache(config=model.config))
    paged = model.generate(**inputs, max_new_tokens=12, do_sample=False, cache=PagedCache(model))
    assert torch.equal(dense, paged)
    assert torch.equal(dense[:1], reference)  # and, on this prompt, the stock model's tokens
