"""Admission with reservation: the peak of the blocks in flight, a request admitted beside a longer one, and where
a prompt chunk of a model with states ends."""

from hypothesis import given, settings
from hypothesis import strategies as st
from batcher_helpers import alone, assert_pool_empty, requests
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.engine.admission import Lifetime, peak_blocks
from hf_paged_cache.engine.admission_rules import snapshot_chunk_end


def every_step_peak(lifetimes: list[Lifetime], block_size: int, cap: int) -> int:
    """The peak by brute force: the blocks held at every step, one at a time."""
    steps = range(1, max(life.last for life in lifetimes) + 1)
    return max(
        sum(min(-(-min(life.base + t, life.top) // block_size), cap) for life in lifetimes if t <= life.last)
        for t in steps
    )


lifetime = st.builds(
    lambda base, extra, last: Lifetime(base=base, top=base + extra, last=last),
    st.integers(0, 60), st.integers(0, 60), st.integers(1, 80),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(lifetime, min_size=1, max_size=12), st.integers(1, 8), st.integers(1, 40))
def test_the_peak_is_the_most_held_at_any_step(lifetimes, block_size, cap):
    assert peak_blocks(lifetimes, block_size, cap) == every_step_peak(lifetimes, block_size, cap)


def test_lifetimes_bound_what_a_request_stores():
    """A request of 8 prompt tokens and 5 new ones stores 8, 9, ..., 12 tokens in its 5 steps (the last
    token is never fed back), starting in the step its prompt is done."""
    prefilling = Lifetime.prefilling(8, max_length=13, ready=2)
    stored = {2: 9, 3: 10, 4: 11, 5: 12}  # step -> tokens stored after it (step 2: prompt and first token)
    assert prefilling.last == 5
    assert all(min(prefilling.base + t, prefilling.top) >= n for t, n in stored.items())
    running = Lifetime.running(10, max_length=13)  # 2 new tokens so far: 9 stored, 3 steps to go
    assert (running.last, min(running.base + running.last, running.top)) == (3, 12)


def test_a_short_request_runs_beside_a_long_one_it_could_not_join_at_its_longest():
    """Capacity 9 blocks of 4 tokens. The long request ends at 31 tokens (8 blocks), the short one at 15
    (4 blocks): 12 at their longest together, but when the short one ends the long one holds only 4, so both
    run at once, and neither is preempted."""
    model = tiny_model("llama")
    long_prompt, short_prompt = (prompt[:8] for prompt, _ in requests(2, seed=5))
    expected = [alone(model, long_prompt, max_new_tokens=24), alone(model, short_prompt, max_new_tokens=8)]
    with ContinuousBatcher(model, block_size=4, num_blocks=10) as batcher:
        long_run = batcher.submit(long_prompt, max_new_tokens=24)
        short_run = batcher.submit(short_prompt, max_new_tokens=8)
        assert [long_run.result(timeout=60), short_run.result(timeout=60)] == expected
        assert short_run.finish_time < long_run.finish_time
        assert batcher.preemptions == 0
    assert_pool_empty(batcher)


@settings(max_examples=300, deadline=None)
@given(length=st.integers(1, 200), budgets=st.lists(st.integers(1, 80), min_size=1, max_size=400),
       size=st.sampled_from([1, 4, 16]))
def test_chunks_of_a_model_with_states_cover_the_prompt_and_stop_at_its_last_block_boundary(length, budgets, size):
    """Whatever each step's budget, the chunks cover the prompt in order, each within its budget, and one of them
    ends at the last block boundary before the prompt's end (where a repeat of the prompt starts)."""
    done, ends = 0, []
    for budget in budgets:
        if done == length:
            break
        end = snapshot_chunk_end(done, done + budget, length, size)
        assert done < end <= min(done + budget, length)
        done = end
        ends.append(end)
    last = (length - 1) // size * size
    assert last == 0 or done < last or last in ends
