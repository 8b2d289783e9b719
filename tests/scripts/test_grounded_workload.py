"""The input-grounded workload (`hf_paged_cache.bench.grounded`): seeded, built from the standard library's text,
and every request's answer to be found in its own prompt. No model runs here."""

from __future__ import annotations

import ast
import random
import re

import pytest

from hf_paged_cache.bench.grounded import (
    KINDS,
    MAX_TOKENS_EXTRA,
    default_count_tokens,
    grounded_workload,
    misspell,
    prose,
    rename,
    sentences,
)


@pytest.fixture(scope="module")
def workload():
    return grounded_workload(48, seed=0)


def test_seeded_and_each_request_independent_of_the_count(workload) -> None:
    assert grounded_workload(48, seed=0) == workload
    assert grounded_workload(10, seed=0).requests == workload.requests[:10]  # a head of the same stream
    other = grounded_workload(10, seed=1)
    assert other.requests != workload.requests[:10] and other.fingerprint() != workload.fingerprint()


def test_kinds_cycle_and_nothing_is_used_twice(workload) -> None:
    assert len(workload) == 48
    assert [r.kind for r in workload.requests] == [KINDS[i % len(KINDS)] for i in range(48)]
    assert len({r.source for r in workload.requests}) == 48
    assert len({r.prompt for r in workload.requests}) == 48
    summary = workload.summary()
    assert sum(summary["kinds"].values()) == 48 and summary["fingerprint"] == workload.fingerprint()


def test_every_answer_is_grounded_in_its_prompt(workload) -> None:
    for r in workload.requests:
        assert len(r.messages) == 1 and r.messages[0]["role"] == "user", r.source
        assert r.grounding in r.prompt, r.source
        reference = r.expected if r.expected is not None else r.grounding
        assert r.max_tokens >= default_count_tokens(reference) + MAX_TOKENS_EXTRA, r.source
        if r.kind == "repeat":
            assert r.expected == r.grounding
        elif r.kind == "quote":
            assert r.expected in r.grounding and r.expected in sentences(r.grounding)
            (word,) = re.findall(r'contains the word "(\w+)"', r.prompt)
            hits = [s for s in sentences(r.grounding) if word in s.lower()]
            assert hits == [r.expected], r.source  # the word names one sentence only
        elif r.kind == "correct":
            right, wrong = r.expected.split(), r.grounding.split()
            assert len(right) == len(wrong)
            changed = [(a, b) for a, b in zip(right, wrong, strict=True) if a != b]
            assert 0 < len(changed) <= len(right) // 2, r.source
            assert all(sorted(a) == sorted(b) for a, b in changed)  # letters swapped, none added
        elif r.kind == "rename":
            old, new = re.findall(r"rename the variable `(\w+)` to `(\w+)`", r.prompt)[0]
            assert old != new and new not in r.grounding
            assert r.expected == rename(r.grounding, old, new) and r.expected != r.grounding
            assert ast.dump(ast.parse(r.expected)) != ast.dump(ast.parse(r.grounding))  # still Python
            assert rename(r.expected, new, old) == r.grounding  # only that name changed
        else:
            assert r.kind == "summarise" and r.expected is None


def test_caps_follow_the_given_token_counter() -> None:
    words = grounded_workload(5, seed=3, count_tokens=lambda text: len(text.split()))
    chars = grounded_workload(5, seed=3)
    assert [r.messages for r in words.requests] == [r.messages for r in chars.requests]
    for r in words.requests:
        reference = r.expected if r.expected is not None else r.grounding
        assert r.max_tokens == -(-len(reference.split()) * 5 // 4) + MAX_TOKENS_EXTRA


def test_kinds_can_be_chosen() -> None:
    only = grounded_workload(4, seed=0, kinds=("rename",))
    assert {r.kind for r in only.requests} == {"rename"}
    with pytest.raises(ValueError, match="kinds must be some of"):
        grounded_workload(1, kinds=("translate",))


def test_rename_leaves_attributes_strings_and_comments() -> None:
    code = 'def f(x, y):\n    x.x = x  # x\n    return "x" + y.x + x\n'
    assert rename(code, "x", "z") == 'def f(z, y):\n    z.x = z  # x\n    return "x" + y.x + z\n'


def test_misspell_swaps_inner_letters() -> None:
    text = "Returns the smallest element greater than the argument, or nothing."
    wrong, count = misspell(text, random.Random(0), every=1)
    assert count > 0 and wrong != text and len(wrong) == len(text)
    assert wrong.split()[1] == "the"  # short words are left alone


def test_prose_drops_code_and_cuts_at_a_sentence() -> None:
    doc = "First sentence here. Second one follows.\n\n>>> f(1)\n1\n\nExample::\n\n    code()\n\nLast words."
    assert prose(doc, 100) == "First sentence here. Second one follows.\n\nLast words."
    assert prose(doc, 4) == "First sentence here."

