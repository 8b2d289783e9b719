"""CompiledForward: the batcher's forwards as one inductor graph around the paged attention, same greedy tokens.

One model is compiled for the module (a compile takes seconds even for a tiny model): every shape family of the
batcher (decode rows, prompt chunks, packed steps, drafts) runs through its single graph.
"""

import threading

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, requests
from faults import Injected
from tiny_models import tiny_config, tiny_model
from transformers import AutoModelForCausalLM

from hf_paged_cache import CompiledForward, ContinuousBatcher, PagedCache, set_paged_attention
from hf_paged_cache.cache.packed_caches import Segment
from hf_paged_cache.cache.packed_forward import packed_forward
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
    results: dict[int, list[int]] = {}
    with ContinuousBatcher(model, block_size=4, max_step_tokens=48, max_running=12, **kwargs) as batcher:

        def client(first: int) -> None:
            handles = [(i, batcher.submit(work[i][0], max_new_tokens=work[i][1])) for i in range(first, len(work), 4)]
            for i, handle in handles:
                results[i] = handle.result(timeout=300)

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert_pool_empty(batcher)
    return [results[i] for i in range(len(work))], batcher


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


@pytest.mark.parametrize("model_type", ["qwen3", "gemma3_text"])  # q/k norms; sliding-window and full layers
def test_other_architectures_compiled_give_the_tokens_alone(model_type):
    other = tiny_model(model_type)
    set_paged_attention(other)
    work = requests(8, seed=5)
    expected = [alone(other, prompt, max_new_tokens=new) for prompt, new in work]
    got, _ = _run_batcher(other, work, compile=True)
    assert got == expected


def test_compiled_packed_forward_matches_eager_logits(model, compiled):
    generator = torch.Generator().manual_seed(0)

    def forward(run_compiled: bool) -> torch.Tensor:
        first = PagedCache(model, num_blocks=64, block_size=4, manual_commit=True)
        second = PagedCache(model, num_blocks=64, block_size=4, manual_commit=True)
        prompts = torch.randint(3, 96, (3, 9), generator=generator.manual_seed(1))
        segments = [Segment(first, prompts, torch.arange(9).expand(3, 9)),
                    Segment(second, prompts[:1, :5], torch.arange(5).unsqueeze(0))]
        logits = [packed_forward(model, segments, list(range(32)), compiled if run_compiled else None)]
        first.commit(), second.commit()
        step = [Segment(first, prompts[:, :1], torch.full((3, 1), 9)),
                Segment(second, prompts[:1, 5:], torch.arange(5, 9).unsqueeze(0))]
        logits.append(packed_forward(model, step, list(range(7)), compiled if run_compiled else None))
        return torch.cat(logits)

    with torch.no_grad():  # as the batcher runs it: the pool holds no gradients
        eager, got = forward(False), forward(True)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), eager.argmax(-1))


@torch.no_grad()
def test_a_failing_forward_leaves_the_cache_as_it_was(model, compiled, monkeypatch):
    cache = PagedCache(model, num_blocks=64, block_size=4, manual_commit=True)
    prompt = torch.randint(3, 96, (1, 10), generator=torch.Generator().manual_seed(2))
    packed_forward(model, [Segment(cache, prompt, torch.arange(10).unsqueeze(0))], [9], compiled)
    cache.commit()
    free = [blocks.num_free for blocks in cache.pool.groups]
    real = running_attention.attend_packed
    calls = []

    def fails_at_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Injected("in the second layer's attention")
        return real(*args, **kwargs)

    monkeypatch.setattr(running_attention, "attend_packed", fails_at_the_second_layer)
    with pytest.raises(Injected):
        packed_forward(model, [Segment(cache, prompt[:, :1], torch.full((1, 1), 10))], [0], compiled)
    monkeypatch.undo()
    assert cache.get_seq_length() == 10
    assert [blocks.num_free for blocks in cache.pool.groups] == free
    logits = packed_forward(model, [Segment(cache, prompt[:, :1], torch.full((1, 1), 10))], [0], compiled)
    assert logits.shape == (1, model.config.vocab_size)


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
