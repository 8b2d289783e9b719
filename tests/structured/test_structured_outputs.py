"""`hf_paged_cache.structured` on its own: grammars compiled and cached, the mask in ``generate`` with a
`PagedCache` and in the batcher, and a matcher that follows the tokens it is given (retries, dropped steps,
recomputation) rather than counting calls."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from json_tokenizer import json_tokenizer
from tiny_models import tiny_model

from hf_paged_cache import ContinuousBatcher, PagedCache
from hf_paged_cache.structured import GrammarError, Grammars, GrammarSpec, grammar_constraint

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {
    "type": "object",
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                   "kind": {"enum": ["a", "b"]},
                   "items": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
    "required": ["id", "kind", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return json_tokenizer(tmp_path_factory.mktemp("json-tokenizer"))


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, 96, [2])


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def test_compiled_grammars_are_cached_by_spec(grammars):
    before = grammars.compiled
    first = grammars.compile(GrammarSpec.json_schema(SCHEMA))
    assert grammars.compile(GrammarSpec.json_schema(SCHEMA)) is first
    assert grammars.compiled == before + 1


@pytest.mark.parametrize("spec, names", [
    (GrammarSpec.json_schema({"type": "frob"}), "frob"),
    (GrammarSpec.regex("(["), "regex"),
    (GrammarSpec.lark("start: missing"), "missing"),
    (GrammarSpec.choice([]), "choice"),
])
def test_an_uncompilable_spec_names_the_problem(grammars, spec, names):
    with pytest.raises(GrammarError, match=names):
        grammars.compile(spec)


def test_generate_with_paged_cache_gives_valid_json(model, tokenizer, grammars):
    processor, stop = grammar_constraint(grammars.compile(GrammarSpec.json_schema(SCHEMA)))
    ids = torch.tensor([tokenizer.encode("data: ")] * 2)  # [2, 6]: each row follows its own tokens
    with PagedCache(model, num_blocks=32) as cache:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=80,
                             do_sample=False, logits_processor=[processor], stopping_criteria=[stop], pad_token_id=0)
    for row in out[:, ids.shape[1]:]:
        jsonschema.validate(json.loads(tokenizer.decode(row, skip_special_tokens=True)), SCHEMA)


def test_mask_follows_the_tokens_not_the_calls(grammars, tokenizer):
    """Asked again for the same tokens (a retried pick), for fewer (a dropped step), or for others (another
    choice of the prompt), the processor masks as a fresh one would."""
    grammar = grammars.compile(GrammarSpec.regex(r"(ab|ac)[0-9]"))
    processor, _ = grammar_constraint(grammar, prompt_length=1)
    a, b, c = (tokenizer.convert_tokens_to_ids(t) for t in "abc")

    def allowed(generated: list[int]) -> set[int]:
        scores = processor(torch.tensor([[5, *generated]]), torch.zeros(1, 96))
        return set(torch.nonzero(scores[0] > -torch.inf).flatten().tolist())

    assert allowed([]) == {a}
    assert allowed([a]) == {b, c}
    assert allowed([a]) == {b, c}  # retried
    digits = allowed([a, b])
    assert len(digits) == 10
    assert allowed([a]) == {b, c}  # rolled back a token
    assert allowed([a, c]) == digits  # another branch
    fresh, _ = grammar_constraint(grammar, prompt_length=1)
    assert set(torch.nonzero(fresh(torch.tensor([[5, a, c]]), torch.zeros(1, 96))[0] > -torch.inf)
               .flatten().tolist()) == digits


def test_batcher_requests_stop_when_the_grammar_ends(model, tokenizer, grammars):
    grammar = grammars.compile(GrammarSpec.choice(["yes", "no"]))
    with ContinuousBatcher(model, num_blocks=64, tokenizer=tokenizer) as batcher:
        handles = []
        for seed in range(4):
            processor, stop = grammar_constraint(grammar, prompt_length=3)
            handles.append(batcher.submit(tokenizer.encode("ok?"), max_new_tokens=20, do_sample=True, top_k=5,
                                          seed=seed, logits_processor=[processor], stopping_criteria=[stop]))
        plain = batcher.submit(tokenizer.encode("ok?"), max_new_tokens=5, do_sample=False)
        for handle in handles:
            assert tokenizer.decode(handle.result(timeout=60), skip_special_tokens=True) in {"yes", "no"}
            assert handle.finish_reason == "stop"
        assert plain.result(timeout=60) == model.generate(torch.tensor([tokenizer.encode("ok?")]),
                                                          max_new_tokens=5, do_sample=False,
                                                          pad_token_id=0)[0, 3:].tolist()


def test_preempted_constrained_requests_equal_each_run_alone(model, tokenizer, grammars):
    """A pool too small for six sampled, constrained answers at once preempts some (their prompts and tokens
    computed again, their processors asked for the mask of tokens they saw before): every answer still equals
    the same request run alone, and is valid."""
    specs = [GrammarSpec.json_schema(SCHEMA), GrammarSpec.regex(r"[a-z]{50,58}"),
             GrammarSpec.choice(["x" * 55, "y" * 50])]

    def submit(batcher, number):
        grammar = grammars.compile(specs[number % len(specs)])
        prompt = tokenizer.encode(f"request {number}:")
        processor, stop = grammar_constraint(grammar, prompt_length=len(prompt))
        return batcher.submit(prompt, max_new_tokens=60, do_sample=True, top_p=0.9, seed=number,
                              logits_processor=[processor], stopping_criteria=[stop])

    alone = []
    with ContinuousBatcher(model, num_blocks=64, tokenizer=tokenizer) as batcher:
        for number in range(6):
            alone.append(submit(batcher, number).result(timeout=60))
    with ContinuousBatcher(model, num_blocks=14, tokenizer=tokenizer, reserve_new_tokens=False) as batcher:
        together = [submit(batcher, number) for number in range(6)]
        assert [handle.result(timeout=120) for handle in together] == alone
        assert batcher.stats().preemptions > 0
    jsonschema.validate(json.loads(tokenizer.decode(alone[0], skip_special_tokens=True)), SCHEMA)


def test_the_mask_leaves_the_callers_logits_alone(grammars):
    """Log-probabilities and the other choices of a prompt read the same logits after the processor ran."""
    processor, _ = grammar_constraint(grammars.compile(GrammarSpec.regex("[0-9]+")), prompt_length=0)
    logits = torch.randn(1, 96)
    before = logits.clone()
    masked = processor(torch.tensor([[]], dtype=torch.long), logits)
    torch.testing.assert_close(logits, before)
    assert 0 < int((masked > -torch.inf).sum()) <= 10


def test_many_rows_share_a_processor_within_its_matcher_bound(grammars, tokenizer):
    """Each row (of a batch in generate, or a choice of a prompt) keeps a matcher of its own, never rolled back
    onto another row's branch; past MAX_MATCHERS the least recently used go, and a row whose matcher went is
    replayed from its tokens, with the same mask."""
    from hf_paged_cache.structured.processor import MAX_MATCHERS

    processor, _ = grammar_constraint(grammars.compile(GrammarSpec.regex("[a-z]{3}[0-9]")), prompt_length=0)
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "abcdefghijklmnopqrstuvwxyz"]
    rows = [[a, b] for a in letters[:9] for b in letters[:9]]  # 81 rows, each its own matcher
    assert len(rows) > MAX_MATCHERS
    masks = [processor(torch.tensor([row]), torch.zeros(1, 96)) for row in rows]
    assert len(processor._matchers) == MAX_MATCHERS
    again = processor(torch.tensor([rows[0]]), torch.zeros(1, 96))  # its matcher was evicted: replayed
    torch.testing.assert_close(again, masks[0])
    assert int((masks[0] > -torch.inf).sum()) == 26


def test_prefetched_masks_are_the_masks_the_call_fills(grammars, tokenizer):
    """`MaskPrefetch` fills masks on its thread (several rows of three processors at once); each call then takes
    the one stored for its tokens, equal to what a fresh processor fills, and a mask for other tokens is
    filled as before."""
    from hf_paged_cache.structured.mask_prefetch import MaskPrefetch

    grammar = grammars.compile(GrammarSpec.json_schema(SCHEMA))
    answer = tokenizer.encode('{"id":12,"kind":"b","items":[true,false]}', add_special_tokens=False)
    held, other, third = (grammar_constraint(grammar, prompt_length=0)[0] for _ in range(3))
    prefetch = MaskPrefetch()
    try:
        for end in range(0, len(answer) - 2, 3):
            # two rows of one processor (choices of one prompt: filled one by one), two of one row each (together)
            rows = [(held, answer[:end]), (held, answer[: end + 1]), (other, answer[:end]), (third, answer[: end + 2])]
            prefetch.start(rows)
            prefetch.wait()
            assert set(held._prefetched) == {tuple(answer[:end]), tuple(answer[: end + 1])}
            for processor, tokens in rows:
                masked = processor(torch.tensor([tokens]), torch.zeros(1, 96))
                fresh = grammar_constraint(grammar, prompt_length=0)[0](torch.tensor([tokens]), torch.zeros(1, 96))
                torch.testing.assert_close(masked, fresh)
            assert not held._prefetched and not other._prefetched and not third._prefetched  # all taken
        prefetch.start([(held, answer[:2])])
        elsewhere = answer[:5]  # a call for other tokens fills its own, after the prefetch let go of the lock
        torch.testing.assert_close(held(torch.tensor([elsewhere]), torch.zeros(1, 96)),
                                   other(torch.tensor([elsewhere]), torch.zeros(1, 96)))
        assert list(held._prefetched) == [tuple(answer[:2])]
    finally:
        prefetch.close()


def test_the_batcher_fills_masks_while_the_forward_runs(model, tokenizer, grammars, monkeypatch):
    """Constrained requests in the batcher take masks the step prefetched, and answer as they do alone."""
    from hf_paged_cache.structured.processor import GrammarLogitsProcessor

    stored = []
    prefetched = GrammarLogitsProcessor.prefetched
    monkeypatch.setattr(GrammarLogitsProcessor, "prefetched",
                        lambda self, tokens, words: (stored.append(tuple(tokens)), prefetched(self, tokens, words)))
    grammar = grammars.compile(GrammarSpec.json_schema(SCHEMA))

    def answer(batcher, number):
        prompt = tokenizer.encode(f"ask {number}:")
        processor, stop = grammar_constraint(grammar, prompt_length=len(prompt))
        return batcher.submit(prompt, max_new_tokens=60, do_sample=True, seed=number,
                              logits_processor=[processor], stopping_criteria=[stop])

    with ContinuousBatcher(model, num_blocks=64, tokenizer=tokenizer) as batcher:
        together = [handle.result(timeout=60) for handle in [answer(batcher, number) for number in range(4)]]
        assert len(stored) > 20  # nearly every token choice
        alone = [answer(batcher, number).result(timeout=60) for number in range(4)]
    assert together == alone
    for tokens in together:
        jsonschema.validate(json.loads(tokenizer.decode(tokens, skip_special_tokens=True)), SCHEMA)


def test_importing_the_server_compiles_nothing():
    """``llguidance.torch`` runs ``torch.compile`` at import, loading inductor into every server (and failing
    where inductor cannot load); the structured room must reach llguidance only through its numpy helpers."""
    code = ("import sys, hf_paged_cache.server.http.app; "
            "print(sorted(m for m in sys.modules if m in ('llguidance.torch', 'torch._inductor.compile_fx')))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"
