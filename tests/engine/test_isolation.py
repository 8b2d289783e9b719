"""One request cannot hurt another: a batcher step is all or nothing, and a failure is pinned on its cause.

References are each request alone through generate() with a DynamicCache. Faults come from tests/faults.py:
a transient fault (once) must cost nobody anything; a request's own fault fails that request alone; a fault
that recurs outside any request fails the requests of that step with it, never with a wrong token.
"""

import time

import pytest
from batcher_helpers import alone, assert_pool_empty, requests
from faults import Force, Injected, RaiseInChoice, fail_next, poison
from tiny_models import VOCAB, tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged_cache import ContinuousBatcher


def unused_token(work, expected) -> int:
    """A token id no prompt holds and no reference output picks: poisoning it hurts only who carries it."""
    used = {t for prompt, _ in work for t in prompt} | {t for tokens in expected for t in tokens}
    return min(set(range(3, VOCAB)) - used)


def submit_together(batcher, work, **extra):
    """Submit every request before the loop takes any, so that they share steps from the first."""
    with batcher._inbox._changed:
        return [batcher.submit(prompt, max_new_tokens=new, **extra) for prompt, new in work]


def injection_points(model):
    """Where a transient fault can strike a llama forward: a layer before / after it writes the cache, after
    the last layer (the final norm), and in the LM head."""
    layers = model.model.layers
    return {
        "first layer, before": (layers[0], False),
        "last layer, after": (layers[-1], True),
        "final norm": (model.model.norm, True),
        "LM head": (model.lm_head, True),
    }


@pytest.mark.parametrize("pack_steps", [True, False])
@pytest.mark.parametrize("where", ["first layer, before", "last layer, after", "final norm", "LM head"])
@pytest.mark.parametrize("after_steps", [0, 3])
def test_a_transient_fault_anywhere_in_a_step_costs_nobody_anything(where, pack_steps, after_steps):
    """A fault that strikes one forward once, in a packed or an unpacked step, at the first step or later.

    Before this change, a packed step that failed after its last layer wrote the caches was computed again
    on caches that already held it: 9 of 20 requests came back wrong. Now every request is exact."""
    model = tiny_model("llama")
    work = requests(12, seed=11)
    expected = [alone(model, prompt, max_new_tokens=new) for prompt, new in work]
    module, after = injection_points(model)[where]
    fault = fail_next(module, times=0 if after_steps else 1, after=after)
    with ContinuousBatcher(model, block_size=4, max_step_tokens=40, pack_steps=pack_steps) as batcher:
        handles = submit_together(batcher, work)
        if after_steps:  # let some requests start decoding, then arm the fault for the next forward
            while batcher.stats().running < after_steps:
                time.sleep(0.001)
            fault.times = 1
        assert [h.result(timeout=120) for h in handles] == expected
        assert fault.fired == 1 and batcher.stats().failed == 0
    fault.remove()
    assert_pool_empty(batcher)


def test_a_fault_that_recurs_outside_any_request_fails_its_step_never_a_wrong_token():
    """The final norm raises on every forward for a while: the requests in flight fail with that error
    (none returns a token list); once it stops, the batcher serves exactly, from a pool with nothing left."""
    model = tiny_model("llama")
    work = requests(6, seed=12)
    with ContinuousBatcher(model, block_size=4) as batcher:
        fault = fail_next(model.model.norm, times=None)
        handles = submit_together(batcher, work)
        for handle in handles:
            with pytest.raises(Injected):
                handle.result(timeout=120)
        fault.remove()
        assert_pool_empty(batcher)
        assert batcher.generate([p for p, _ in work[:3]], max_new_tokens=5) == [
            alone(model, p, max_new_tokens=5) for p, _ in work[:3]
        ]
    assert_pool_empty(batcher)


@pytest.mark.parametrize("pack_steps", [True, False])
def test_a_request_whose_prompt_breaks_the_model_fails_alone(pack_steps):
    model = tiny_model("llama")
    work = requests(8, seed=13)
    expected = [alone(model, p, max_new_tokens=n) for p, n in work]
    bad = unused_token(work, expected)
    fault = poison(model, bad)
    with ContinuousBatcher(model, block_size=4, max_step_tokens=64, pack_steps=pack_steps) as batcher:
        broken = submit_together(batcher, [([7, 8, 9, bad, 10], 4)])[0]
        handles = submit_together(batcher, work)
        with pytest.raises(Injected, match=f"by token {bad}"):
            broken.result(timeout=120)
        assert [h.result(timeout=120) for h in handles] == expected
    fault.remove()
    assert_pool_empty(batcher)


def test_a_decode_row_that_breaks_the_model_fails_alone_the_others_go_on():
    """A running request picks a token the model refuses at its next decode step: the decode forward fails
    twice, each row is tried alone, and only that request fails; the others' tokens are exact."""
    model = tiny_model("llama")
    work = [(p, 12) for p, _ in requests(6, seed=14)]
    expected = [alone(model, p, max_new_tokens=n) for p, n in work]
    prompt = [7, 8, 9, 10, 11]
    bad = unused_token([*work, (prompt, 0)], [*expected, alone(model, prompt, max_new_tokens=3)])
    fault = poison(model, bad)
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = submit_together(batcher, work)
        force = LogitsProcessorList([Force(bad, 3, len(prompt))])
        broken = batcher.submit(prompt, max_new_tokens=10, logits_processor=force)
        tokens = []
        with pytest.raises(Injected):
            for token in broken:
                tokens.append(token)
        assert len(tokens) == 4 and tokens[-1] == bad  # it streamed its tokens up to the one that broke it
        assert [h.result(timeout=120) for h in handles] == expected
    fault.remove()
    assert_pool_empty(batcher)


@pytest.mark.parametrize("times, fails", [(1, False), (None, True)])
def test_token_choice_that_raises_fails_only_its_request(times, fails):
    """A request's own logits processor raises: once, it is picked again (nobody pays); always, that request
    fails alone. Before this change, one request's failing choice failed every request in flight."""
    model = tiny_model("llama")
    work = requests(8, seed=15)
    expected = [alone(model, p, max_new_tokens=n) for p, n in work]
    prompt = work[0][0]
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = submit_together(batcher, work)
        odd = batcher.submit(prompt, max_new_tokens=6, logits_processor=LogitsProcessorList([RaiseInChoice(times)]))
        if fails:
            with pytest.raises(Injected, match="token choice"):
                odd.result(timeout=120)
        else:
            assert odd.result(timeout=120) == alone(model, prompt, max_new_tokens=6)
        assert [h.result(timeout=120) for h in handles] == expected
    assert_pool_empty(batcher)


class NaNScores(LogitsProcessor):
    def __call__(self, input_ids, scores):
        return scores * float("nan")


def test_scores_without_a_finite_maximum_fail_their_request_with_a_clear_error():
    """A processor that turns scores into NaN: generate() would pick an arbitrary token; the batcher fails that
    request alone, saying why."""
    model = tiny_model("llama")
    work = requests(4, seed=16)
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = submit_together(batcher, work)
        odd = batcher.submit(work[0][0], max_new_tokens=3, logits_processor=LogitsProcessorList([NaNScores()]))
        with pytest.raises(ValueError, match="no finite score"):
            odd.result(timeout=120)
        assert [h.result(timeout=120) for h in handles] == [alone(model, p, max_new_tokens=n) for p, n in work]
    assert_pool_empty(batcher)
