"""Weight-only int4 linear layers (`quantize_weights(model, bits=4)`): the codes stand for the weight within half
a step of their group, the product is ATen's on those codes; and of both widths: a quantized model's perplexity
stays near the float one's, and `PagedCache` is exact on it."""

import math

import pytest
import torch
from tiny_models import tiny_model
from torch import nn
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.kernels import Int4Linear, Int8Linear, pack_linears, quantize_by_name, quantize_weights


def test_the_codes_stand_for_the_weight_within_half_a_step_and_the_product_is_theirs():
    torch.manual_seed(0)
    linear = nn.Linear(64, 40)  # 40 outputs: padded to the kernel's 48 and cut off again
    layer = Int4Linear(linear)
    steps = layer.steps_and_midpoints[:, :40, 0].float().T  # [N, K/g]
    bound = steps.repeat_interleave(layer.group_size, dim=1) / 2  # [N, K]
    weight = linear.weight.detach()
    # dequantized() is read through the kernel in bfloat16: its rounding, a few parts in 1e3, comes on top
    assert bool(((layer.dequantized() - weight).abs() <= bound + 4e-3 * weight.abs() + 1e-6).all())
    x = torch.randn(3, 5, 64)
    expected = x.bfloat16().float() @ layer.dequantized().T + linear.bias
    out = layer(x)
    assert out.shape == (3, 5, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, expected.detach(), rtol=2e-2, atol=2e-2)
    float_out = linear(x).detach()
    assert float((out - float_out).norm() / float_out.norm()) < 0.15


def perplexity(model: nn.Module, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(float(model(ids, labels=ids).loss))


def test_perplexity_on_a_fixed_text_stays_near_the_float_models():
    """A tiny model trained for a few steps on a fixed repeating text, so that its perplexity means something
    (about 10, against about 96 untrained); int8 and int4 weights keep it within 1% and 3% (the goals on the
    real model: +0.5% and +3%)."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    text = torch.arange(3, 67).repeat(4).unsqueeze(0)  # [1, 256]: a text a model can learn
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(10):
        optimizer.zero_grad()
        model(text, labels=text).loss.backward()
        optimizer.step()
    model.eval()
    reference = perplexity(model, text)
    assert 3 < reference < 30  # part learned
    for bits, bound in ((8, 1.01), (4, 1.03)):
        quantized = tiny_model("llama")
        quantized.load_state_dict(model.state_dict())
        quantize_weights(quantized, bits=bits, output_head=True)
        assert perplexity(quantized, text) <= reference * bound, bits
        assert type(quantized.get_output_embeddings()) is not nn.Linear  # the head too


@pytest.mark.parametrize("bits, layer_type, similarity", [(8, Int8Linear, 0.999), (4, Int4Linear, 0.99)])
def test_a_quantized_model_is_close_to_the_float_one_and_the_cache_is_exact_on_it(bits, layer_type, similarity):
    model = tiny_model("llama")
    linears = sum(type(module) is nn.Linear for module in model.modules())
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(ids).logits
    assert quantize_weights(model, bits=bits) == linears - 1  # all but the output head
    assert isinstance(model.model.layers[0].mlp.down_proj, layer_type)
    assert type(model.get_output_embeddings()) is nn.Linear
    assert pack_linears(model) == 1  # the head, left in float
    with torch.no_grad():
        after = model(ids).logits
    assert float(torch.nn.functional.cosine_similarity(before.flatten(), after.flatten(), dim=0)) > similarity
    settings = dict(max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_logits=True)
    mask = torch.ones_like(ids)
    reference = model.generate(input_ids=ids, attention_mask=mask, cache=DynamicCache(config=model.config), **settings)
    with PagedCache(model) as cache:
        paged = model.generate(input_ids=ids, attention_mask=mask, cache=cache, **settings)
    assert torch.equal(paged.sequences, reference.sequences)
    for ours, theirs in zip(paged.logits, reference.logits, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_layers_whose_width_is_not_whole_groups_stay_in_float(caplog):
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 48), nn.Linear(48, 16))
    with caplog.at_level("WARNING"):
        assert quantize_weights(model, bits=4) == 2  # 48 inputs are not groups of 32
    assert [type(layer) for layer in model] == [Int4Linear, Int4Linear, nn.Linear]
    assert "[48]" in caplog.text
    with pytest.raises(ValueError, match="multiple of the group size 32"):
        Int4Linear(nn.Linear(48, 16))
    assert quantize_weights(nn.Sequential(nn.Linear(48, 16)), bits=4, group_size=16) == 1


def test_quantize_names_are_the_width_and_whether_the_head_too():
    linears = sum(type(module) is nn.Linear for module in tiny_model("llama").modules())
    assert quantize_by_name(tiny_model("llama"), "int4") == linears - 1
    assert quantize_by_name(tiny_model("llama"), "int8-all") == linears
    with pytest.raises(ValueError, match="int4-all"):
        quantize_by_name(tiny_model("llama"), "int3")
