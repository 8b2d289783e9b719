"""Differential fuzz test of the ContinuousBatcher: random traffic, faults and readers; every request exact or
failing for its own reason.

Each case is drawn from a seed: 14 to 22 requests arriving from 3 client threads at random moments, their
prompts built from a few shared prefixes plus random tails (lengths crossing block and chunk boundaries),
greedy or seeded sampling, on a pool too small for all of them (preemption when reservation is off), with
a random chunk budget. Some requests carry their own fault (a prompt token the model refuses, a token they
are made to pick that breaks their next decode step, a token choice that always raises), some a transient
one (a token choice that raises once), some are cancelled by their client mid-stream, some ask for several
choices of their prompt (``submit_group``: one prefill, shared blocks; a cancelled group cancels its first
choice only) or for log-probabilities of their new and prompt tokens, some are held to a grammar (a regex, a
choice of strings or a JSON schema, through `grammar_constraint`: its state must follow the request through
faults, retried choices, cancellation and preemption as if it ran alone), and a chaos thread
arms transient faults one at a time (before or after a random decoder layer, in the final norm, in the LM
head) while a reader thread reads the batcher's and its caches' stats. Every newly taken block is filled
with NaN first, so a slot read or registered before it is written shows.

Reference: each request alone through generate() with a DynamicCache (sampled ones under the same seed).
After every step (on the loop thread): no cache holds a pending step, every block's reference count equals
the block tables' references to it (every state slot's, the rows' references to it), and every block the prefix
index holds is written. At the end: every finished request (each choice of a group) is exact and its
log-probabilities name its tokens; a failed one failed with its own fault; a cancelled one streamed a prefix of
its reference; the pool holds no block and no state slot.

Each case runs twice: as drawn, and with speculative decoding on at every decode step
(`Speculator(adaptive=False)`: drafts from the requests' own tokens for even seeds, from a draft model, a
twin of the model, for odd ones), against the same references: a sampled request draws its tokens as it
would without drafts.

Architectures: Llama, Gemma 3 (sliding-window and full layers), GPT-2 (learned positions, 64 of them:
a request that would run past them is refused at submit) and Qwen3-Next (gated-DeltaNet layers whose conv and
recurrent states live in the pool's state slots; not speculative: the batcher refuses drafts on such a model;
``HF_PAGED_CACHE_FUZZ_STATE_MODELS=lfm2,mamba2,...`` runs others). ``HF_PAGED_CACHE_FUZZ_CASES=N`` runs N seeds per
architecture instead of 3 (docs/batching.md gives a longer run); with ``-s`` each case prints its steps, requests
and faults.
"""

from __future__ import annotations

import collections
import functools
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from batcher_helpers import alone
from faults import Force, Injected, RaiseInChoice, fail_next, poison
from json_tokenizer import json_tokenizer
from tiny_models import VOCAB, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, LogitsProcessorList

from hf_paged_cache import ContinuousBatcher, RequestCancelled
from hf_paged_cache.pool.block_pool import NULL_BLOCK
from hf_paged_cache.speculative.draft_model import DraftModel
from hf_paged_cache.speculative.speculator import Speculator
from hf_paged_cache.structured import Grammars, GrammarSpec, grammar_constraint

CASES = int(os.environ.get("HF_PAGED_CACHE_FUZZ_CASES", "3"))
STATE_MODELS = tuple(os.environ.get("HF_PAGED_CACHE_FUZZ_STATE_MODELS", "qwen3_next").split(","))  # linear-attention (gated DeltaNet) and full-attention layers: states in slots
BLOCK = 4
GPT2_POSITIONS = 64
GRAMMARS = [  # what constrained requests are held to (short enough to end within a request's 1-12 tokens)
    GrammarSpec.regex(r"[a-z]{2,5}[0-9]"),
    GrammarSpec.choice(["yes", "no", "maybe"]),
    GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                             "additionalProperties": False}),
]


@functools.cache
def compiled_grammars() -> list:
    """`GRAMMARS` compiled for the character tokenizer of the tiny models' vocabulary."""
    with tempfile.TemporaryDirectory() as path:
        grammars = Grammars(json_tokenizer(Path(path)), VOCAB, [2])
    return [grammars.compile(spec) for spec in GRAMMARS]


def constraint(spec: Spec) -> dict:
    """The processor and stopping criterion that hold `spec`'s answer to its grammar (fresh ones: a
    reference's own, or a submission's), as keyword arguments; none for an unconstrained spec."""
    if spec.grammar is None:
        return {}
    processor, stop = grammar_constraint(compiled_grammars()[spec.grammar], prompt_length=len(spec.prompt))
    return dict(logits_processor=LogitsProcessorList([processor]), stopping_criteria=[stop])


def fuzz_model(model_type: str):
    if model_type != "gpt2":
        return tiny_model(model_type)
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_positions=GPT2_POSITIONS, n_embd=64, n_layer=2,
                                  n_head=4, bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@dataclass
class Spec:
    """One request of a case, and what it is expected to do."""

    prompt: list[int]
    new_tokens: int
    settings: dict
    kind: str = "plain"  # plain, poison_prompt, poison_decode, choice_once, choice_always, cancel, too_long
    at: int = 0  # poison_decode: the new token it is made to pick; cancel: tokens before cancelling
    client: int = 0
    delay: float = 0.0  # seconds its client waits before submitting it
    n: int = 1  # choices of its prompt (submit_group); choice i samples with seed + i
    grammar: int | None = None  # index in GRAMMARS of what its answer is held to
    references: list[list[int]] = field(default_factory=list)  # one per choice

    @property
    def reference(self) -> list[int]:
        return self.references[0]


def draw_case(rng: random.Random, model_type: str) -> tuple[list[Spec], dict]:
    """A case's requests and batcher arguments, from `rng`."""
    prefixes = [[rng.randrange(3, 64) for _ in range(rng.randrange(4, 35))] for _ in range(3)]  # ids 64+: room for a poison
    specs = []
    for _ in range(rng.randrange(14, 23)):
        prompt = rng.choice([[], *prefixes]) + [rng.randrange(3, 64) for _ in range(rng.randrange(1, 13))]
        settings = {}
        if rng.random() < 0.3:
            settings = dict(do_sample=True, seed=rng.randrange(1000), temperature=rng.choice([0.7, 1.0, 1.3]),
                            top_k=rng.choice([0, 20]))
        elif rng.random() < 0.2:
            settings = dict(repetition_penalty=1.3)
        spec = Spec(prompt, rng.randrange(1, 13), settings, client=rng.randrange(3), delay=rng.random() * 0.03)
        spec.kind = rng.choices(
            ["plain", "poison_prompt", "poison_decode", "choice_once", "choice_always", "cancel"],
            weights=[10, 1, 1, 1, 1, 2],
        )[0]
        if spec.kind == "poison_decode":
            spec.at = rng.randrange(spec.new_tokens)
        elif spec.kind == "cancel":
            spec.at = rng.randrange(spec.new_tokens + 1)
        if spec.kind != "poison_decode" and rng.random() < 0.25:
            spec.n = rng.choice([2, 3])
        if spec.kind != "poison_decode" and rng.random() < 0.2:  # a forced poison is no grammar's token
            spec.grammar = rng.randrange(len(GRAMMARS))
            spec.settings.pop("top_k", None)  # generate filters before the mask, the batcher after: no top-k
        if rng.random() < 0.3:
            spec.settings = {**spec.settings, "logprobs": rng.choice([0, 2]), "prompt_logprobs": rng.choice([None, 1])}
        specs.append(spec)
    if model_type == "gpt2":
        specs.append(Spec(list(range(3, 60)), 10, {}, kind="too_long", client=1))
    longest = max(len(s.prompt) + s.new_tokens for s in specs if s.kind != "too_long")
    batcher = dict(
        block_size=BLOCK,
        num_blocks=-(-longest // BLOCK) + rng.randrange(1, 12),  # room for the longest, not for all at once
        max_step_tokens=rng.choice([7, 13, 18, 21, 30, 64]),  # most end chunks inside a block
        max_running=rng.choice([4, 8, 64]),
        reserve_new_tokens=rng.random() < 0.5,
    )
    return specs, batcher


def references(model, specs: list[Spec]) -> int | None:
    """Each spec's tokens alone through generate(); returns a token id none of them uses (the poison).

    A poison_decode request is made to pick the poison as its `at`-th new token: its reference is its tokens
    alone up to there, then the poison.
    """
    for spec in specs:
        if spec.kind == "too_long":
            continue
        settings = {k: v for k, v in spec.settings.items() if k not in ("seed", "logprobs", "prompt_logprobs")}
        spec.references = []
        for choice in range(spec.n):
            if "seed" in spec.settings:  # generate samples from torch's generator: the same draws
                torch.manual_seed(spec.settings["seed"] + choice)
            elif choice:
                spec.references.append(spec.references[0])  # greedy: every choice the same
                continue
            spec.references.append(
                alone(model, spec.prompt, max_new_tokens=spec.new_tokens, **settings, **constraint(spec))
            )
    unused = set(range(3, VOCAB)) - {t for s in specs for ref in s.references for t in (*s.prompt, *ref)}
    bad = min(unused, default=None)
    for spec in specs:
        if spec.kind.startswith("poison") and bad is None:
            spec.kind = "plain"  # every token is someone's: no poison this time
        elif spec.kind == "poison_decode":
            spec.references = [[*spec.reference[: spec.at], bad]]
    return bad


class NaNBlocks:
    """Fills every block the pool hands out with NaN before it is used, so an unwritten slot shows."""

    def __init__(self, pool):
        self.pool = pool
        for group, blocks in enumerate(pool.groups):
            allocate = blocks.allocate

            def poisoned(n, prefer=(), *, allocate=allocate, group=group):
                taken = allocate(n, prefer)
                if taken:
                    self.fill(group, taken)
                return taken

            blocks.allocate = poisoned

    def storages(self, group):
        for layer in self.pool.layer_groups[group].layers:
            yield from (t for t in (self.pool.keys[layer], self.pool.values[layer]) if t is not None)

    def fill(self, group, blocks):
        slots = torch.tensor([b * BLOCK + i for b in blocks for i in range(BLOCK)])
        for storage in self.storages(group):
            storage.index_fill_(1, slots, float("nan"))  # [H, slots, D]

    def written(self, group, block) -> bool:
        return all(not storage[:, block * BLOCK : (block + 1) * BLOCK].isnan().any() for storage in self.storages(group))


def check_step(batcher, nan_blocks: NaNBlocks) -> None:
    """The invariants at a step boundary (run on the loop thread, after each step is applied)."""
    scheduler = batcher._scheduler
    caches = [scheduler.running_cache, *(p.cache for p in scheduler.prefilling)]
    assert all(cache.lifecycle.forward is None for cache in caches), "a cache holds a pending forward between steps"
    assert scheduler.running_cache.batch.batch_size == len(scheduler.running), "running rows out of step"
    for group, blocks in enumerate(batcher.pool.groups):
        held = collections.Counter(
            b for cache in caches for table in cache.batch.groups[group].tables for b in table if b != NULL_BLOCK
        )
        counts = {b: blocks.refcount(b) for b in range(1, len(blocks._refcounts)) if blocks.refcount(b)}
        assert counts == dict(held), f"group {group}: reference counts {counts} but tables hold {dict(held)}"
    if scheduler.running_cache.keeps_states:  # the state slots alike: each held once per row that holds it
        slots = batcher.pool.states.ids
        held = collections.Counter(s for cache in caches for s in cache.batch.states.slots if s != NULL_BLOCK)
        counts = {s: slots.refcount(s) for s in range(1, len(slots._refcounts)) if slots.refcount(s)}
        assert counts == dict(held), f"state slots: reference counts {counts} but rows hold {dict(held)}"
    check_prefix_index(batcher, nan_blocks)


def check_prefix_index(batcher, nan_blocks: NaNBlocks) -> None:
    for group, blocks in enumerate(batcher.pool.groups):
        for block in list(blocks._index.cached):
            assert nan_blocks.written(group, block), f"group {group}: block {block} is findable by prefix unwritten"


def run_case(model_type: str, seed: int, speculative: bool = False) -> dict:
    rng = random.Random(seed)
    model = fuzz_model(model_type)
    specs, batcher_kwargs = draw_case(rng, model_type)
    if speculative:
        # odd seeds draft with a twin of the model (no faults injected into it), even ones by n-gram lookup
        source = DraftModel(fuzz_model(model_type), block_size=4) if seed % 2 else None
        batcher_kwargs["speculative"] = Speculator(3, adaptive=False, source=source)
    bad = references(model, specs)
    for spec in specs:
        if spec.kind == "poison_prompt":
            spec.prompt.insert(rng.randrange(len(spec.prompt) + 1), bad)
    outcomes: dict[int, tuple] = {}
    steps = [0]
    last_plans: collections.deque[str] = collections.deque(maxlen=3)  # the latest steps, shown when an outcome is wrong
    with ContinuousBatcher(model, **batcher_kwargs) as batcher:
        with torch.no_grad():  # create every layer's storage, then fill it with NaN
            model(input_ids=torch.tensor([[5]]), cache=batcher.running_cache)
        batcher.running_cache.settle()
        nan_blocks = NaNBlocks(batcher.pool)
        for group in range(len(batcher.pool.groups)):
            nan_blocks.fill(group, range(1, batcher.pool.groups[group].num_blocks))
        hooks = [poison(model, bad)] if bad is not None else []  # after that forward: 5 may be the poison
        base = model.base_model  # its decoder layers and final norm, whatever the architecture names them
        layers = next(getattr(base, name) for name in ("layers", "h") if hasattr(base, name))
        norm = next(getattr(base, name) for name in ("norm", "ln_f", "norm_f", "final_layernorm", "embedding_norm")
                    if hasattr(base, name))
        transient = [fail_next(module, times=0, after=after) for module, after in (
            (layers[0], False), (layers[-1], True), (norm, True), (model.get_output_embeddings(), True),
        )]
        apply = batcher._scheduler.apply

        def checked_apply(plan, result):
            apply(plan, result)
            steps[0] += 1
            last_plans.append(repr(plan))
            try:
                check_step(batcher, nan_blocks)
            except AssertionError as error:  # the step that broke an invariant, printed as planned
                raise AssertionError(f"{error}\nafter step {steps[0]}:\n{plan!r}") from error

        batcher._scheduler.apply = checked_apply
        done = threading.Event()

        def client(number):
            for index, spec in enumerate(specs):
                if spec.client != number:
                    continue
                time.sleep(spec.delay)
                outcomes[index] = serve_one(batcher, spec, bad)

        def chaos():
            """Arms one transient fault at a time; the next only once the step it struck has ended, so that no
            step meets two (two in one step would be a fault that recurs)."""
            chaos_rng = random.Random(seed + 1)
            while not done.is_set():
                time.sleep(chaos_rng.random() * 0.05)
                fault = chaos_rng.choice(transient)
                fault.times = fault.fired + 1
                while fault.armed() and not done.is_set():
                    time.sleep(0.002)
                struck = steps[0]
                while steps[0] <= struck and not done.is_set():
                    time.sleep(0.002)

        def reader():
            while not done.is_set():
                batcher.stats()
                batcher.running_cache.stats()
                repr(batcher.running_cache)
                time.sleep(0.001)

        clients = [threading.Thread(target=client, args=(n,)) for n in range(3)]
        helpers = [threading.Thread(target=chaos), threading.Thread(target=reader)]
        for thread in clients + helpers:
            thread.start()
        for thread in clients:
            thread.join(timeout=300)
        done.set()
        for thread in helpers:
            thread.join()
        for fault in transient:
            fault.times = fault.fired  # disarmed
        assert not any(thread.is_alive() for thread in clients), "a client hung"
    for hook in [*hooks, *transient]:
        hook.remove()
    assert all(blocks.num_used == 0 for blocks in batcher.pool.groups), "blocks leaked"
    assert batcher.pool.states.ids.num_used == 0, "state slots leaked"
    check_prefix_index(batcher, nan_blocks)
    for index, spec in enumerate(specs):
        try:
            check_outcomes(spec, outcomes[index])
        except AssertionError as error:
            raise AssertionError(f"{error}\nthe case's last steps:\n" + "\n".join(last_plans)) from error
    speculation = batcher.stats().speculation
    # a case whose decode steps never find a draft speculates nowhere (seen once in 36 speculative cases): its
    # output is still checked; tests/speculative/test_speculation.py asserts that drafts are proposed and kept
    assert speculation.accepted_tokens <= speculation.draft_tokens
    return dict(steps=steps[0], requests=len(specs), faults=sum(f.fired for f in transient), speculation=speculation)


def serve_one(batcher, spec: Spec, bad: int) -> list[tuple]:
    """Submit `spec` and follow each choice to its end: ("done", tokens) or ("error", error, tokens streamed);
    a group whose spec is "cancel" cancels its first choice only."""
    settings = {**spec.settings, **constraint(spec)}
    processors = list(settings.pop("logits_processor", []))
    if spec.kind == "poison_decode":
        processors.append(Force(bad, spec.at, len(spec.prompt)))
    if spec.kind in ("choice_once", "choice_always"):
        processors.append(RaiseInChoice(1 if spec.kind == "choice_once" else None))
    if processors:
        settings["logits_processor"] = LogitsProcessorList(processors)
    try:
        if spec.n == 1:
            handles = [batcher.submit(spec.prompt, max_new_tokens=spec.new_tokens, **settings)]
        else:
            handles = batcher.submit_group(spec.prompt, spec.n, max_new_tokens=spec.new_tokens, **settings)
    except ValueError as error:
        return [("refused", error, [])]
    return [follow(handle, spec, cancel=spec.kind == "cancel" and choice == 0) for choice, handle in enumerate(handles)]


def follow(handle, spec: Spec, cancel: bool) -> tuple:
    streamed = []
    if cancel and spec.at == 0:
        handle.cancel()
    try:
        for token in handle:
            streamed.append(token)
            if cancel and len(streamed) == spec.at:
                handle.cancel()
    except Exception as error:  # noqa: BLE001 (checked against the spec)
        return ("error", error, streamed)
    if spec.settings.get("logprobs") is not None:
        assert [lp.token for lp in handle.logprobs] == streamed, "log-probabilities of other tokens"
        assert all(len(lp.top) == spec.settings["logprobs"] for lp in handle.logprobs)
    if spec.settings.get("prompt_logprobs") is not None:
        assert [lp.token for lp in handle.prompt_logprobs] == spec.prompt[1:], "prompt log-probabilities"
    return ("done", streamed)


def check_outcomes(spec: Spec, outcomes: list[tuple]) -> None:
    if spec.kind == "too_long":
        assert outcomes[0][0] == "refused" and "past the model's 64" in str(outcomes[0][1]), spec
        return
    assert len(outcomes) == spec.n
    for choice, outcome in enumerate(outcomes):
        kind = "plain" if spec.kind == "cancel" and choice else spec.kind  # a group cancels its first choice
        check_outcome(spec, kind, spec.references[choice], outcome)


def check_outcome(spec: Spec, kind: str, reference: list[int], outcome: tuple) -> None:
    what = f"{kind} request ({len(spec.prompt)} prompt tokens, {spec.new_tokens} new, {spec.settings}, n={spec.n})"
    if outcome[0] == "done":
        assert kind not in ("poison_prompt", "choice_always"), f"{what} should have failed"
        if kind == "poison_decode":
            assert spec.at == spec.new_tokens - 1, f"{what} should have failed at its poisoned decode step"
        assert outcome[1] == reference, f"{what}: {outcome[1]} instead of {reference}"
        return
    _, error, streamed = outcome
    assert streamed == reference[: len(streamed)], f"{what} streamed {streamed}, not a prefix of {reference}"
    if kind == "cancel" and isinstance(error, RequestCancelled):
        return
    expected = {"poison_prompt": "by token", "poison_decode": "by token", "choice_always": "token choice"}
    assert kind in expected and isinstance(error, Injected) and expected[kind] in str(error), (
        f"{what} failed with {error!r}"
    )
    if kind == "poison_decode":
        assert streamed == reference[: spec.at + 1], f"{what} streamed {streamed}"


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("seed", range(CASES))
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "gpt2", *STATE_MODELS])
def test_random_traffic_with_faults_gives_every_request_its_own_answer(model_type, seed, speculative):
    if speculative and model_type in STATE_MODELS:
        pytest.skip("a model with conv / recurrent states does not speculate (the batcher refuses it)")
    report = run_case(model_type, seed, speculative)
    print(f"{model_type} seed {seed}{' speculative' if speculative else ''}: {report['steps']} steps, "
          f"{report['requests']} requests, {report['faults']} transient faults, {report['speculation']}")
    assert report["steps"] > 0
