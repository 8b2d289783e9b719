"""ContinuousBatcher: log-probabilities of new and prompt tokens, finish reasons, and n choices of one prompt."""

import pytest
import torch
from batcher_helpers import alone, assert_pool_empty, requests
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher, RequestCancelled


def model_logprobs(model, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of `tokens` (no cache): ``[len, V]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_logprobs_are_the_models_log_softmax(model_type):
    model = tiny_model(model_type)
    work = requests(6, seed=5)
    with ContinuousBatcher(model, block_size=4, max_step_tokens=16) as batcher:  # prompts cross chunks and blocks
        handles = [batcher.submit(prompt, max_new_tokens=new, logprobs=3, prompt_logprobs=2) for prompt, new in work]
        for (prompt, new), handle in zip(work, handles):
            tokens = handle.result(timeout=60)
            assert tokens == alone(model, prompt, max_new_tokens=new)
            reference = model_logprobs(model, prompt + tokens)  # [P + N, V]
            # each new token: its log-probability where it was picked, and the 3 most likely there
            assert [lp.token for lp in handle.logprobs] == tokens
            for i, lp in enumerate(handle.logprobs):
                row = reference[len(prompt) - 1 + i]
                assert lp.logprob == pytest.approx(float(row[lp.token]), abs=1e-4)
                top_ids = row.topk(3).indices.tolist()
                assert [token for token, _ in lp.top] == top_ids
                assert [value for _, value in lp.top] == pytest.approx(row[top_ids].tolist(), abs=1e-4)
            # prompt tokens 1..P-1, each under the logits of the position before it
            assert [lp.token for lp in handle.prompt_logprobs] == prompt[1:]
            for j, lp in enumerate(handle.prompt_logprobs, start=1):
                assert lp.logprob == pytest.approx(float(reference[j - 1, prompt[j]]), abs=1e-4)
                assert len(lp.top) == 2
            assert handle.finish_reason == "length"
    assert_pool_empty(batcher)


def test_prompt_logprobs_are_computed_even_when_the_prefix_is_cached():
    """A prompt whose blocks the pool already holds is still computed whole when its log-probabilities are
    asked for (cached blocks hold keys and values, not logits)."""
    model = tiny_model("llama")
    prompt = requests(1, seed=7)[0][0] * 3  # long enough for several full blocks
    with ContinuousBatcher(model, block_size=4) as batcher:
        batcher.submit(prompt, max_new_tokens=2).result(timeout=60)
        handle = batcher.submit(prompt, max_new_tokens=1, prompt_logprobs=0)
        handle.result(timeout=60)
        assert batcher.stats().prefix_hit_tokens == 0
    reference = model_logprobs(model, prompt)
    expected = [float(reference[j - 1, prompt[j]]) for j in range(1, len(prompt))]
    assert [lp.logprob for lp in handle.prompt_logprobs] == pytest.approx(expected, abs=1e-4)


def test_finish_reason_is_stop_at_eos_and_length_at_max_new_tokens():
    model = tiny_model("llama")
    prompt = requests(1, seed=3)[0][0]
    free = alone(model, prompt, max_new_tokens=6)
    with ContinuousBatcher(model, block_size=4) as batcher:
        stopped = batcher.submit(prompt, max_new_tokens=6, eos_token_id=free[2])
        full = batcher.submit(prompt, max_new_tokens=6)
        assert stopped.result(timeout=60) == free[: free.index(free[2]) + 1]
        assert stopped.finish_reason == "stop"
        assert full.result(timeout=60) == free
        assert full.finish_reason == "length"


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_n_choices_share_one_prefill_and_equal_requests_alone(model_type):
    model = tiny_model(model_type)
    prompt = requests(1, seed=11)[0][0] * 2
    sampling = dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=0)
    with ContinuousBatcher(model, block_size=4, max_step_tokens=64) as batcher:
        singles = [batcher.submit(prompt, seed=100 + i, **sampling).result(timeout=60) for i in range(4)]
        computed_before = batcher.stats().prefix_hit_tokens
        handles = batcher.submit_group(prompt, 4, seed=100, logprobs=0, prompt_logprobs=0, **sampling)
        choices = [handle.result(timeout=60) for handle in handles]
        # asked for the prompt's log-probabilities, the group computed its prompt instead of reusing its blocks
        assert batcher.stats().prefix_hit_tokens == computed_before
        greedy = batcher.submit_group(prompt, 3, max_new_tokens=8)
        greedy_choices = [handle.result(timeout=60) for handle in greedy]
    assert choices == singles  # choice i draws with seed 100 + i, as a request of its own would
    assert len({tuple(c) for c in choices}) > 1
    assert greedy_choices == [alone(model, prompt, max_new_tokens=8)] * 3
    assert all(handle.prompt_logprobs == handles[0].prompt_logprobs for handle in handles)
    assert len(handles[0].prompt_logprobs) == len(prompt) - 1
    assert_pool_empty(batcher)


def test_n_choices_hold_the_prompts_blocks_once():
    """While 4 choices decode, the prompt's full blocks are held once, each choice holding its own tail."""
    model = tiny_model("llama")
    prompt = list(range(3, 3 + 40))  # 10 full blocks of 4
    with ContinuousBatcher(model, block_size=4) as batcher:
        handles = batcher.submit_group(prompt, 4, max_new_tokens=30, do_sample=True, seed=0)
        stream = iter(handles[0])
        for _ in range(3):
            next(stream)  # all 4 are decoding now (they joined together)
        usage = batcher.stats().groups[0]
        for handle in handles:
            handle.result(timeout=60)
        assert batcher.stats().groups[0].kv_utilization == 0.0  # nothing held
    used = usage.blocks_used
    # 4 rows in 4-token blocks (the prompt's, shared, counted once): only the rows' last blocks have empty slots
    assert 0.75 < usage.kv_utilization <= 1.0
    # alone, 4 requests of 43+ tokens would hold 4 * 11 blocks; sharing, 10 prompt blocks + 1 or 2 each
    assert 10 + 4 <= used <= 10 + 4 * 2


def test_cancelling_the_leader_of_a_group_keeps_the_others():
    model = tiny_model("llama")
    prompt = requests(1, seed=13)[0][0] * 4
    expected = alone(model, prompt, max_new_tokens=6)
    with ContinuousBatcher(model, block_size=4, max_step_tokens=8) as batcher:  # a prefill of several steps
        handles = batcher.submit_group(prompt, 3, max_new_tokens=6)
        handles[0].cancel()
        with pytest.raises(RequestCancelled):
            handles[0].result(timeout=60)
        assert [handle.result(timeout=60) for handle in handles[1:]] == [expected, expected]
        everyone = batcher.submit_group(prompt, 2, max_new_tokens=6)
        for handle in everyone:
            handle.cancel()
        for handle in everyone:
            with pytest.raises(RequestCancelled):
                handle.result(timeout=60)
    assert_pool_empty(batcher)


@pytest.mark.parametrize("bad", [-1, 21, 1.5, True])
def test_logprobs_out_of_range_are_refused_at_submit(bad):
    model = tiny_model("llama")
    with ContinuousBatcher(model, block_size=4) as batcher:
        with pytest.raises(ValueError, match="logprobs must be an integer from 0 to 20"):
            batcher.submit([5, 6, 7], max_new_tokens=2, logprobs=bad)
        with pytest.raises(ValueError, match="prompt_logprobs"):
            batcher.submit_group([5, 6, 7], 2, max_new_tokens=2, prompt_logprobs=bad)


def test_a_group_too_big_for_the_pool_at_once_runs_its_choices_one_by_one():
    """4 choices of a 30-token prompt with 10 new tokens each: 10 blocks of 4 for the first, 3 more for each
    other (the prompt's 7 full blocks are shared). A pool of 13 holds one choice but not all four: the group
    splits and its choices run one after another, with the same tokens."""
    model = tiny_model("llama")
    prompt = requests(1, seed=17)[0][0][:10] * 3
    sampling = dict(max_new_tokens=10, do_sample=True, top_k=0)
    singles = [alone_sampled(model, prompt, seed=7 + i, **sampling) for i in range(4)]
    with ContinuousBatcher(model, block_size=4, num_blocks=14) as batcher:  # 13 usable (block 0 is the null block)
        handles = batcher.submit_group(prompt, 4, seed=7, **sampling)
        assert [handle.result(timeout=60) for handle in handles] == singles
        assert batcher.preemptions == 0
    assert_pool_empty(batcher)


def alone_sampled(model, prompt, seed, **kwargs):
    torch.manual_seed(seed)  # generate() samples from torch's generator: the batcher's request draws the same
    return alone(model, prompt, **kwargs)
