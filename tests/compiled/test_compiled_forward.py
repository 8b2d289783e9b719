"""CompiledForward: the batcher's decode forwards as one inductor graph around the paged attention, the same greedy
tokens and logits equal to float32 rounding.

One model is compiled for the module (a compile takes seconds even for a tiny model): every batch size and draft
length runs through one graph.
"""


import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, from_four_clients, requests
from faults import Injected
from tiny_models import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from hf_paged_cache import CompiledForward, ContinuousBatcher, PagedCache, set_paged_attention
from hf_paged_cache.compiled import running_attention
from hf_paged_cache.kernels import pack_linears
from hf_paged_cache.kernels.packed_linear import PackedLinear


@pytest.fixture(scope="module")
def model():
    model = tiny_model("llama")
    set_paged_attention(model)
    pack_linears(model)  # as the server runs it: the packed products stay operators of their own in the graph
    return model


@pytest.fixture(scope="module")
def compiled(model):
    return CompiledForward(model)


def _run_batcher(model, work, **kwargs):
    with ContinuousBatcher(model, block_size=4, max_step_tokens=48, max_running=12, **kwargs) as batcher:
        got = from_four_clients(batcher, work, timeout=300)
    assert_pool_empty(batcher)
    return got, batcher


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_batcher_compiled_gives_each_request_its_tokens_alone(model, speculative):
    work = requests(20, seed=3)
    work += [([5, 6, 7, 8] * 6, 12)]  # a prompt that repeats itself: n-gram drafts are found and verified
    expected = [alone(model, prompt, max_new_tokens=new) for prompt, new in work]
    got, batcher = _run_batcher(model, work, compile=True, speculative=speculative)
    assert got == expected
    assert batcher.packed_steps > 0
    if speculative == "ngram":
        assert batcher.stats().speculation.steps > 0  # drafts verified through the compiled graph


def test_sliding_window_layers_compiled_give_the_tokens_alone():
    other = tiny_model("gemma3_text")  # sliding-window and full layers, q/k norms
    set_paged_attention(other)
    work = requests(8, seed=5)
    expected = [alone(other, prompt, max_new_tokens=new) for prompt, new in work]
    got, _ = _run_batcher(other, work, compile=True)
    assert got == expected


def _prefilled(model, prompts: list[list[int]]) -> PagedCache:
    """A cache of ragged rows (left-padded), their prompts computed eagerly and kept."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    cache = PagedCache(model, num_blocks=64, block_size=4, manual_commit=True)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    cache.commit()
    return cache


def _step_inputs(cache: PagedCache, prompts: list[list[int]], new: torch.Tensor, step: int):
    positions = torch.tensor([[len(p) + step + j for j in range(new.shape[1])] for p in prompts])  # [B, q]
    mask = torch.cat([cache.is_real.long(), torch.ones_like(new)], dim=1)  # [B, L + q]
    return positions, mask


@torch.no_grad()  # as the batcher runs it: the pool holds no gradients
def test_compiled_decode_matches_the_eager_forward(model, compiled):
    """Ragged rows, one token a step, then three at once (drafts), through one graph."""
    prompts = [[5, 9, 13, 2, 7, 11, 3], [4, 8], [6, 10, 14, 18, 22]]
    eager_cache, compiled_cache = _prefilled(model, prompts), _prefilled(model, prompts)
    generator = torch.Generator().manual_seed(4)
    step = 0
    for q in [1, 1, 3, 1]:
        new = torch.randint(3, 96, (3, q), generator=generator)
        positions, mask = _step_inputs(eager_cache, prompts, new, step)
        eager = model(input_ids=new, attention_mask=mask, position_ids=positions, cache=eager_cache, use_cache=True,
                      logits_to_keep=0).logits
        got = compiled(compiled_cache, new, positions, mask)
        eager_cache.commit(), compiled_cache.commit()
        torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
        assert torch.equal(got.argmax(-1), eager.argmax(-1))
        step += q
    assert compiled_cache.get_seq_length() == eager_cache.get_seq_length()


@torch.no_grad()
def test_a_failing_forward_leaves_the_cache_as_it_was(model, compiled, monkeypatch):
    prompts = [[5, 9, 13, 2], [4, 8, 12]]
    cache = _prefilled(model, prompts)
    free = [blocks.num_free for blocks in cache.pool.groups]
    new = torch.tensor([[7], [9]])
    positions, mask = _step_inputs(cache, prompts, new, 0)
    real = running_attention.attend_from_pool
    calls = []

    def fails_at_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Injected("in the second layer's attention")
        return real(*args, **kwargs)

    monkeypatch.setattr(running_attention, "attend_from_pool", fails_at_the_second_layer)
    with pytest.raises(Injected):
        compiled(cache, new, positions, mask)
    monkeypatch.undo()
    assert cache.get_seq_length() == 4
    assert [blocks.num_free for blocks in cache.pool.groups] == free
    logits = compiled(cache, new, positions, mask)
    cache.commit()
    eager = model(input_ids=new, attention_mask=mask, position_ids=positions, cache=_prefilled(model, prompts),
                  use_cache=True, logits_to_keep=1).logits
    torch.testing.assert_close(logits[:, -1:], eager, rtol=1e-5, atol=1e-5)


def test_a_packed_linear_layer_compiles_to_its_own_operator():
    layer = PackedLinear(torch.nn.Linear(64, 96))
    graphs = []

    def record(graph, inputs):
        graphs.append(graph)
        return graph.forward

    compiled = torch.compile(layer, backend=record, dynamic=True, fullgraph=True)
    x = torch.randn(5, 64)
    with torch.no_grad():
        got, eager = compiled(x), layer(x)
    assert torch.equal(got, eager)  # the same packed product, not a product inductor chose
    targets = {node.target for node in graphs[0].graph.nodes}
    assert torch.ops.hf_paged_cache.packed_linear in targets


def test_the_operator_outside_a_compiled_forward_says_so():
    query = torch.zeros(1, 2, 1, 4)
    with pytest.raises(RuntimeError, match="outside a compiled forward"):
        torch.ops.hf_paged_cache.running_cache_attention(query, query, query, 0, None, None, None, "sdpa")


def test_unsupported_models_and_modes_are_refused_by_name(model):
    with pytest.raises(ValueError, match="batch_invariant"):
        ContinuousBatcher(model, num_blocks=32, compile=True, batch_invariant=True)
    eager = tiny_model("llama")  # its default attention: not read from the pool
    with pytest.raises(NotImplementedError, match="not one of"):
        CompiledForward(eager)
    hybrid = AutoModelForCausalLM.from_config(tiny_config("lfm2")).eval()
    with pytest.raises(NotImplementedError, match="'lfm2'"):
        CompiledForward(hybrid)
    training = tiny_model("qwen2")
    set_paged_attention(training)
    with pytest.raises(NotImplementedError, match="training"):
        CompiledForward(training.train())
