"""Token choice in the batcher: plain greedy rows share one reduction, and choose what `Request.pick` would."""

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, requests
from tiny_models import VOCAB, tiny_model
from transformers import LogitsProcessorList, StoppingCriteria, StoppingCriteriaList, TopKLogitsWarper

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.engine.request import Request
from hf_paged_cache.engine.step_result import StepResult
from hf_paged_cache.engine.token_choice import choose_rows


class NeverStop(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def request(model, prompt=(5, 6, 7), **kwargs) -> Request:
    return Request(0, list(prompt), model, {"max_new_tokens": 4, "do_sample": False, **kwargs})


def test_plain_greedy_requests_know_how_they_stop(model):
    stops = request(model, eos_token_id=2).greedy
    assert stops is not None and stops.max_length == 3 + 4 and stops.eos_ids == {2}
    assert request(model, eos_token_id=[11, 12]).greedy.eos_ids == {11, 12}
    assert request(model, eos_token_id=None).greedy.eos_ids == frozenset()


@pytest.mark.parametrize("kwargs", [
    dict(do_sample=True),
    dict(repetition_penalty=1.3),
    dict(min_new_tokens=2, eos_token_id=2),  # EOS banned for 2 tokens: a processor
    dict(logprobs=1),
    dict(logits_processor=LogitsProcessorList([TopKLogitsWarper(5)])),
    dict(stopping_criteria=StoppingCriteriaList([NeverStop()])),
], ids=["sampling", "penalty", "min_new_tokens", "logprobs", "processor", "criterion"])
def test_anything_but_plain_greedy_picks_one_by_one(model, kwargs):
    assert request(model, **kwargs).greedy is None


def test_one_reduction_chooses_what_pick_chooses(model):
    """Rows with tied maxima (the first wins, as argmax), an EOS, the last allowed token, no finite maximum, and a
    request that is not plain greedy, side by side: each gets what `Request.pick` gives it alone."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, VOCAB, generator=generator)
    logits[1, [9, 4]] = 50.0  # a tie: the first maximum (4) is picked
    logits[2, 11] = 50.0  # an EOS id of its request
    logits[4] = float("nan")
    logits[5] = float("-inf")
    rows = [
        request(model),
        request(model),
        request(model, eos_token_id=[11, 12]),
        request(model, max_new_tokens=1),  # its first new token is its last
        request(model),
        request(model),
        request(model, repetition_penalty=1.3),
    ]
    result = StepResult()
    choose_rows(rows, logits, result)
    for row, req in enumerate(rows):
        try:
            expected = req.pick(logits[row])
        except ValueError:
            assert isinstance(result.failures[req], ValueError) and "no finite score" in str(result.failures[req])
            continue
        assert result.choices[req] == expected
    assert result.choices[rows[1]].token == 4
    assert result.choices[rows[2]].finished and result.choices[rows[3]].finished
    assert not result.choices[rows[0]].finished
    assert set(result.failures) == {rows[4], rows[5]}


def test_plain_and_other_requests_in_one_batch_equal_generate(model):
    """Plain greedy requests (one with two EOS ids) beside ones that pick one by one: every answer is generate()'s."""
    prompt = requests(1, seed=3)[0][0]
    first = alone(model, prompt, max_new_tokens=8)
    settings = [
        dict(max_new_tokens=8),
        dict(max_new_tokens=8, eos_token_id=[first[5], first[3]]),  # stops at the first of them
        dict(max_new_tokens=8, repetition_penalty=1.5),
        dict(max_new_tokens=8, logprobs=2),
    ]
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = [batcher.submit(prompt, **kwargs) for kwargs in settings]
        got = [handle.result(timeout=60) for handle in handles]
        assert handles[1].finish_reason == "stop" and handles[0].finish_reason == "length"
    assert got == [alone(model, prompt, **{k: v for k, v in kwargs.items() if k != "logprobs"}) for kwargs in settings]
    assert len(got[1]) == 1 + min(first.index(first[5]), first.index(first[3])) < 8
    assert_pool_empty(batcher)
