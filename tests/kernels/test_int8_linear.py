"""Weight-only int8 linear layers (`quantize_weights`): the codes stand for the weight within half a scale step,
the product is ATen's on those codes, a quantized model stays close to the float one, and `PagedCache` is exact
on it (the cache keeps what the quantized model computes)."""

import pytest
import torch
from tiny_models import tiny_model
from torch import nn
from transformers import DynamicCache

from hf_paged_cache import PagedCache
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


def test_a_quantized_model_is_close_to_the_float_one_and_the_cache_is_exact_on_it():
    model = tiny_model("llama")
    linears = sum(type(module) is nn.Linear for module in model.modules())
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    assert quantize_weights(model) == linears - 1  # all but the output head
    assert type(model.get_output_embeddings()) is nn.Linear
    assert pack_linears(model) == 1  # the head, left in float
    with torch.no_grad():
        after = model(ids).logits
    assert float(torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0)) > 0.999
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    mask = torch.ones_like(ids)
    reference = model.generate(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config), **settings)
    with PagedCache(model) as cache:
        paged = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **settings)
    assert torch.equal(paged.sequences, reference.sequences)
    for ours, theirs in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_the_output_head_too_when_asked():
    model = tiny_model("llama")
    linears = sum(type(module) is nn.Linear for module in model.modules())
    assert quantize_weights(model, output_head=True) == linears
    assert isinstance(model.get_output_embeddings(), Int8Linear) and pack_linears(model) == 0


def test_other_widths_are_refused():
    with pytest.raises(ValueError, match="bits=8 .* or bits=4"):
        quantize_weights(tiny_model("llama"), bits=3)
