"""Scoring from the prefix cache: prompt log-probabilities kept by block (`PromptScores`), so that a prompt whose
context is cached computes only its own positions, with the numbers a full computation gives."""

import pytest
import torch
from batcher_helpers import assert_pool_empty
from tiny_models import VOCAB, tiny_model

from hf_paged_cache import ContinuousBatcher
from hf_paged_cache.engine.logprobs import TokenLogprob
from hf_paged_cache.engine.prompt_scores import PromptScores

BLOCK = 4


def scored(tokens: list[int], k: int = 2) -> list[TokenLogprob]:
    """Made-up log-probabilities of tokens 1.. (each a function of the prefix, as the model's are)."""
    return [TokenLogprob(t, -float(sum(tokens[: i + 2])), tuple((a, -float(a)) for a in range(k)))
            for i, t in enumerate(tokens[1:])]


def test_blocks_keep_the_log_probabilities_of_their_tokens():
    scores = PromptScores(BLOCK, capacity=8)
    prompt = list(range(10, 24))  # 14 tokens: 3 full blocks (12 tokens), 2 more
    scores.store(prompt, scored(prompt), k=2)
    assert len(scores) == 3
    assert scores.lookup(prompt, 2) == scored(prompt)[:11]  # tokens 1..11: the full blocks' own
    assert scores.lookup(prompt[:9], 2) == scored(prompt)[:7]  # a shorter prompt: its 2 full blocks
    assert [lp.top for lp in scores.lookup(prompt, 1)] == [lp.top[:1] for lp in scored(prompt)[:11]]
    assert scores.lookup(prompt, 3) == []  # kept with 2 alternatives: not enough for 3
    other = prompt[:9] + [99] + prompt[10:]  # token 9 differs: block 2 (tokens 8..11) is another block
    assert scores.lookup(other, 2) == scored(prompt)[:7]


def test_only_computed_tokens_are_kept_and_the_least_recent_block_goes_first():
    scores = PromptScores(BLOCK, capacity=3)
    prompt = list(range(30, 50))
    scores.store(prompt, scored(prompt)[:6], k=1)  # tokens 1..6: block 0 full, block 1 (4..7) not yet
    assert len(scores) == 1 and len(scores.lookup(prompt, 1)) == 3
    scores.store(prompt, scored(prompt, k=1), k=1)  # all 20: 5 blocks, the 3 last kept
    assert len(scores) == 3 and scores.lookup(prompt, 1) == []  # block 0 went first, so nothing from the start


def contexts_and_endings(count: int, context: int, seed: int = 0) -> list[tuple[list[int], list[list[int]]]]:
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(3, VOCAB, (context,), generator=generator).tolist(),
             [torch.randint(3, VOCAB, (3,), generator=generator).tolist() for _ in range(4)]) for _ in range(count)]


def score_all(batcher, work) -> list[list[list[TokenLogprob]]]:
    """Each context with each of its 4 endings, submitted together (as lm-eval sends a multiple-choice question)."""
    handles = [[batcher.submit(context + ending, max_new_tokens=1, prompt_logprobs=1) for ending in endings]
               for context, endings in work]
    results = []
    for row in handles:
        for handle in row:
            handle.result(timeout=120)
        results.append([handle.prompt_logprobs for handle in row])
    return results


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_a_shared_context_is_computed_once(invariant):
    """4 endings of 6 contexts of 21 tokens: the first ending computes its context, the 3 others take its blocks
    and their log-probabilities and compute 4 positions each (the context's last, then their 3 tokens). The
    numbers are the model's (within float rounding of a whole forward) and, in batch-invariant mode, bitwise
    those of a batcher that computes every prompt whole."""
    model = tiny_model("llama")
    work = contexts_and_endings(6, 21)
    with ContinuousBatcher(model, block_size=BLOCK, batch_invariant=invariant) as batcher:
        reused = score_all(batcher, work)
        hits, computed = batcher.stats().prefix_hit_tokens, batcher.stats().steps.prompt_tokens
    assert_pool_empty(batcher)
    assert hits == 6 * 3 * 19  # each later ending: 5 blocks (20 tokens) less the one computed again
    assert computed == 6 * (24 + 3 * 5)  # each context once (24 tokens), then 5 positions per later ending
    with ContinuousBatcher(model, block_size=BLOCK, batch_invariant=invariant, reuse_prompt_scores=False) as cold:
        whole = score_all(cold, work)
        assert cold.stats().prefix_hit_tokens == 0 and cold.stats().steps.prompt_tokens == 6 * 4 * 24
    for (context, endings), theirs, mine in zip(work, whole, reused):
        for ending, full, reuse in zip(endings, theirs, mine):
            tokens = context + ending
            assert [lp.token for lp in reuse] == tokens[1:]
            if invariant:
                assert reuse == full  # bitwise: logprobs and alternatives
            else:
                assert [lp.logprob for lp in reuse] == pytest.approx([lp.logprob for lp in full], abs=1e-5)


def test_more_alternatives_than_kept_are_computed():
    model = tiny_model("llama")
    context, endings = contexts_and_endings(1, 21, seed=3)[0]
    with ContinuousBatcher(model, block_size=BLOCK) as batcher:
        batcher.submit(context + endings[0], max_new_tokens=1, prompt_logprobs=1).result(timeout=60)
        more = batcher.submit(context + endings[1], max_new_tokens=1, prompt_logprobs=3)
        more.result(timeout=60)
        assert batcher.stats().prefix_hit_tokens == 0  # kept with 1 alternative, asked for 3: computed whole
        assert all(len(lp.top) == 3 for lp in more.prompt_logprobs)
        fewer = batcher.submit(context + endings[2], max_new_tokens=1, prompt_logprobs=2)
        fewer.result(timeout=60)
        assert batcher.stats().prefix_hit_tokens == 19  # the blocks now kept with 3
    assert [lp.top[:2] for lp in fewer.prompt_logprobs[:19]] == [lp.top[:2] for lp in more.prompt_logprobs[:19]]
