"""Keys and values stored in fewer bits (`kv_dtype`): close to full precision, exact to themselves, counted
to the byte.

A quantized cache cannot be token-identical to a full-precision one in general, so its logits are compared
within tolerances measured on these tiny models (max |logit difference| from a full-precision `PagedCache`,
over the prefill step and every later step while a row's tokens still agree):

    int8            ~7e-4 .. 5.2e-3     bfloat16   ~3e-4 .. 2.5e-3
    float8_e4m3fn   1.7e-2 on the prefill step, up to 0.2 on later steps (gpt_oss)

Everything a quantized cache does *besides* rounding (sharing, forks, the batcher, growth) must be exact
relative to another quantized run, and is checked so.
"""

from __future__ import annotations

import functools

import pytest
import torch
from batcher_helpers import assert_pool_empty, requests
from generate_modes import MODES
from tiny_models import VOCAB, ragged_batch, tiny_model
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged_cache import ContinuousBatcher, KVPool, PagedCache, PoolExhaustedError, set_paged_attention
from hf_paged_cache.pool.kv_format import KV_DTYPES, StoredStates, kv_format

ARCHITECTURES = ["llama", "gemma3_text", "gpt_oss", "deepseek_v3"]  # plain, sliding, sinks, latent (Dk != Dv)
ATTENTIONS = ["default", "paged_sdpa"]
REDUCED = ["int8", "float8_e4m3fn", "bfloat16"]
PADS = [0, 4, 9]
PROMPT = 20
NEW_TOKENS = 24  # rows cross a 16-token block boundary

PREFILL_TOLERANCE = {"int8": 2e-2, "bfloat16": 2e-2, "float8_e4m3fn": 0.1}  # measured: 5e-3, 2.5e-3, 1.7e-2
AGREED_TOLERANCE = {"int8": 2e-2, "bfloat16": 2e-2, "float8_e4m3fn": 0.5}  # measured: 5.2e-3, 2.5e-3, 0.2
NEAR_TIE = 1e-2  # a reference margin (top logit - second) this small may flip under int8 rounding


# ---------------------------------------------------------------------------------------------- helpers


@functools.cache
def model_for(model_type: str, attention: str = "default"):
    """The tiny model of `model_type`, with its default attention or switched to paged_sdpa (built once)."""
    model = tiny_model(model_type)
    if attention == "paged_sdpa":
        set_paged_attention(model)
    return model


def generate(model, kv_dtype=None, batch=None, seed=0, **kwargs):
    """`generate` on the ragged test batch through a fresh PagedCache storing `kv_dtype`, with logits and scores."""
    batch = batch if batch is not None else ragged_batch(PADS, PROMPT)
    kwargs = {"max_new_tokens": NEW_TOKENS, "do_sample": False, **kwargs}
    with PagedCache(model, kv_dtype=kv_dtype) as cache:
        torch.manual_seed(seed)
        return model.generate(
            **batch, **kwargs, cache=cache, return_dict_in_generate=True, output_logits=True, output_scores=True
        )


@functools.cache
def greedy(model_type: str, attention: str, kv_dtype: str | None):
    """The greedy generation of the test batch (computed once per combination)."""
    return generate(model_for(model_type, attention), kv_dtype)


def agreeing(ours, reference) -> torch.Tensor:
    """``[steps, B]``: True where row b had picked the reference's tokens at every step before this one, so
    that its logits at this step compare like for like."""
    steps = len(reference.logits)
    differ = (ours.sequences[:, -steps:] != reference.sequences[:, -steps:]).int()  # [B, steps]
    return (differ.cumsum(dim=1) - differ == 0).T


def logit_errors(ours, reference) -> list[float]:
    """Max |logit difference| at each step, over the rows still agreeing with the reference."""
    rows = agreeing(ours, reference)
    return [
        (mine[keep] - theirs[keep]).abs().max().item() if keep.any() else 0.0
        for mine, theirs, keep in zip(ours.logits, reference.logits, rows, strict=True)
    ]


def assert_identical(a, b):
    """Same tokens, and bit-identical scores (processed logits: -inf where masked)."""
    torch.testing.assert_close(a.sequences, b.sequences, rtol=0, atol=0)
    for mine, theirs in zip(a.scores, b.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def forward(model, cache, input_ids, attention_mask=None):
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask, cache=cache, use_cache=True)


def pool_tensors(pool: KVPool) -> list[torch.Tensor]:
    """Every tensor the pool has allocated: keys, values and their scales, per layer."""
    tensors = [*pool.keys, *pool.values, *pool.key_scales, *pool.value_scales]
    return [t for t in tensors if t is not None]


def smol_config(**overrides):
    """A config of SmolLM2-135M's shapes (30 layers, 3 KV heads of 64 dims), or smaller with `overrides`."""
    shapes = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, head_dim=64, max_position_embeddings=256)
    return AutoConfig.for_model("llama", vocab_size=VOCAB, pad_token_id=0, **{**shapes, **overrides})


@functools.cache
def head_dim_64_model():
    """A tiny llama whose heads are SmolLM2's width (64), so int8 costs its real 72/256 of float32."""
    config = smol_config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


# ------------------------------------------------------------------- 1. close to full precision


@pytest.mark.parametrize("kv_dtype", REDUCED)
@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_logits_stay_close_to_full_precision(model_type, attention, kv_dtype):
    reference, ours = greedy(model_type, attention, None), greedy(model_type, attention, kv_dtype)
    errors = logit_errors(ours, reference)
    assert 0 < errors[0] <= PREFILL_TOLERANCE[kv_dtype], "prefill step"  # > 0: the keys really were rounded
    assert max(errors) <= AGREED_TOLERANCE[kv_dtype], f"per step: {errors}"


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_int8_picks_the_full_precision_tokens_except_at_near_ties(model_type, attention):
    """Random tiny models have near-uniform logits: llama and gemma3_text each have a row where the top two
    logits of the full-precision run are 2e-4 and 2.4e-3 apart, and int8 (like bfloat16) picks the other one
    there. So: every row gives the same tokens, or parts from the reference only at a step where the
    reference's margin is below NEAR_TIE (a tighter bound than the logit tolerance alone implies)."""
    reference, ours = greedy(model_type, attention, None), greedy(model_type, attention, "int8")
    steps = len(reference.logits)
    same_rows = 0
    for row in range(len(PADS)):
        differ = (ours.sequences[row, -steps:] != reference.sequences[row, -steps:]).nonzero()
        if not len(differ):
            same_rows += 1
            continue
        top = reference.logits[int(differ[0])][row].topk(2).values
        assert top[0] - top[1] < NEAR_TIE, f"row {row} parted at step {int(differ[0])} on a clear choice"
    assert same_rows >= 2


def test_float32_storage_on_a_float32_model_is_the_default_bit_for_bit():
    model = model_for("llama")
    stored_as_float32 = generate(model, "float32")
    assert_identical(stored_as_float32, greedy("llama", "default", None))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_the_pool_stores_what_was_asked(kv_dtype):
    model = model_for("deepseek_v3")  # keys and values of different widths
    with PagedCache(model, kv_dtype=kv_dtype, num_blocks=4, block_size=4) as cache:
        forward(model, cache, torch.tensor([[5, 6, 7]]))
        pool, stored = cache.pool, kv_format(kv_dtype, model.dtype)
        assert pool.kv_format == stored and pool.kv_format.name == kv_dtype
        assert {t.dtype for t in pool.keys + pool.values} == {torch.uint8 if kv_dtype == "int8" else getattr(torch, kv_dtype)}
        scaled = kv_dtype in ("int8", "float8_e4m3fn")
        for layer, (keys, values) in enumerate(zip(pool.keys, pool.values)):
            for states, scales in ((keys, pool.key_scales[layer]), (values, pool.value_scales[layer])):
                if scaled:
                    assert scales.dtype == stored.scale_dtype
                    assert scales.shape == (*states.shape[:2], *stored.scale_shape(states.shape[-1]))
                else:
                    assert scales is None
        # reads come back in the model's dtype
        keys, values = cache.dense_view(0)
        assert keys.dtype == values.dtype == model.dtype and keys.shape[-1] != values.shape[-1]


# --------------------------------------------------------------------- 2. exact relative to int8


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_int8_is_deterministic(model_type, attention):
    assert_identical(generate(model_for(model_type, attention), "int8"), greedy(model_type, attention, "int8"))


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("mode", list(MODES))
def test_every_generate_mode_agrees_between_dense_reads_and_paged_sdpa(mode, kv_dtype):
    """Every mode of the parity tests (test_generate_modes) on an 8-bit cache: the dense read path and
    paged_sdpa read the same stored keys and values, so the same tokens and scores within float rounding (a
    1e-7 difference can still move one element across a rounding boundary, hence not atol=0); a second paged
    run is bit-identical to the first; and the first step's scores stay within the prefill tolerance of a
    full-precision cache (where both are finite: top-k and top-p mask the rest)."""
    kwargs = dict(MODES[mode], seed=3, max_new_tokens=16)
    dense = generate(model_for("llama"), kv_dtype, **kwargs)
    paged = generate(model_for("llama", "paged_sdpa"), kv_dtype, **kwargs)
    torch.testing.assert_close(paged.sequences, dense.sequences, rtol=0, atol=0)
    for mine, theirs in zip(paged.scores, dense.scores, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=PREFILL_TOLERANCE[kv_dtype])
    assert_identical(generate(model_for("llama", "paged_sdpa"), kv_dtype, **kwargs), paged)
    full = generate(model_for("llama", "paged_sdpa"), None, **kwargs).scores[0]
    finite = full.isfinite() & paged.scores[0].isfinite()
    temperature = MODES[mode].get("temperature", 1.0)
    assert (paged.scores[0][finite] - full[finite]).abs().max() <= PREFILL_TOLERANCE[kv_dtype] / temperature


def user_tokens(n, seed):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def ask(model, cache, input_ids, new_tokens=10):
    return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                          do_sample=False, cache=cache, return_dict_in_generate=True, output_scores=True)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("attention", ATTENTIONS)
def test_forks_copy_the_scales_of_the_block_they_write(attention, kv_dtype):
    """Each fork of a prefilled 8-bit cache copies the shared, partly filled last block (keys, values and
    their scales) before writing: it generates exactly what a cache that prefilled the same prompt alone
    does, and the base is left untouched."""
    model = model_for("llama", attention)
    system = ragged_batch([0], 40)["input_ids"]  # 2 full blocks + 8 tokens
    questions = [torch.cat([system, user_tokens(5 + i, i)], dim=1) for i in range(2)]
    expected = []
    for question in questions:
        with PagedCache(model, kv_dtype=kv_dtype) as alone:
            forward(model, alone, system)
            expected.append(ask(model, alone, question))
    with PagedCache(model, kv_dtype=kv_dtype, num_blocks=32) as base:
        forward(model, base, system)
        forks = [base.fork() for _ in questions]
        for fork, question, reference in zip(forks, questions, expected, strict=True):
            assert_identical(ask(model, fork, question), reference)
            fork.release()
        assert base.block_tables.num_tokens == [40]
        assert_identical(ask(model, base, questions[0]), expected[0])


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_a_reused_int8_prefix_continues_exactly(attention):
    """Turn 2 finds turn 1's int8 blocks in the pool (`reuse_prefix`): it gives bit for bit what turn 2 gives on
    turn 1's own cache, and the tokens of an int8 cache that computes the whole prompt anew."""
    model = model_for("llama", attention)
    pool = KVPool.for_config(model.config, num_blocks=32, kv_dtype="int8")
    turn1 = ragged_batch([0], 37)["input_ids"]
    with PagedCache(model, pool=pool) as cache:
        answer1 = ask(model, cache, turn1, new_tokens=12).sequences  # stores 37 + 11 = 48 tokens: 3 full blocks
        turn2 = torch.cat([answer1, user_tokens(6, 1)], dim=1)
        continued = ask(model, cache, turn2)
    with PagedCache(model, pool=pool) as cache:
        assert cache.reuse_prefix(turn2) == 48
        reused = ask(model, cache, turn2)
        assert cache.stats().prefix_hits == 3
    assert_identical(reused, continued)
    with PagedCache(model, kv_dtype="int8") as unshared:
        torch.testing.assert_close(ask(model, unshared, turn2).sequences, reused.sequences, rtol=0, atol=0)


def alone_int8(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with PagedCache(model, kv_dtype="int8") as cache:
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, cache=cache)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("small_pool", [False, True])
def test_batcher_with_int8_gives_each_request_what_generate_gives_it_alone(small_pool):
    """Requests packed together, prefilled in chunks, and (small pool, no reservation) preempted and computed
    again: each gets the tokens of `generate` on an int8 PagedCache of its own."""
    model = model_for("llama", "paged_sdpa")  # what the batcher switches the model to anyway
    work = requests(10, seed=1)
    expected = [alone_int8(model, prompt, new) for prompt, new in work]
    size = dict(num_blocks=30, reserve_new_tokens=False) if small_pool else {}
    with ContinuousBatcher(model, block_size=4, max_step_tokens=48, max_running=10, kv_dtype="int8", **size) as batcher:
        assert batcher.pool.kv_format.name == "int8"
        with batcher._inbox._changed:  # all arrive at once: the loop sees them together
            handles = [batcher.submit(prompt, max_new_tokens=new) for prompt, new in work]
        assert [h.result(timeout=120) for h in handles] == expected
        stats = batcher.stats()
        assert batcher.packed_steps > 0
        assert (stats.preemptions + stats.prefill_retries > 0) == small_pool
    assert_pool_empty(batcher)


def test_batcher_refuses_a_pool_and_a_kv_dtype():
    pool = KVPool.for_config(model_for("llama").config, num_blocks=8, kv_dtype="int8")
    with pytest.raises(ValueError, match="pool= or kv_dtype="):
        ContinuousBatcher(tiny_model("llama"), pool=pool, kv_dtype="int8")


def test_an_elastic_int8_pool_grows_its_scales_with_its_blocks():
    """An elastic pool that grows mid-generate resizes the scales in place with the keys and values: the
    result is bit for bit that of a pool big enough from the start."""
    model = model_for("llama")
    batch = ragged_batch([0] * 8, 30)  # 8 rows x 39 stored tokens: 24 blocks, past the 17 it starts with
    with PagedCache(model, kv_dtype="int8") as elastic:
        grown = model.generate(**batch, max_new_tokens=10, do_sample=False, cache=elastic,
                               return_dict_in_generate=True, output_scores=True)
        assert elastic.pool.grow_count > 0
        assert elastic.pool.storage_bytes() == sum(t.nbytes for t in pool_tensors(elastic.pool))
        assert elastic.pool.key_scales[0].shape[1] == elastic.pool.num_blocks * elastic.pool.block_size
    with PagedCache(model, kv_dtype="int8", num_blocks=64) as fixed:
        assert_identical(grown, model.generate(**batch, max_new_tokens=10, do_sample=False, cache=fixed,
                                               return_dict_in_generate=True, output_scores=True))


# ----------------------------------------------------------------------------- 3. pool accounting


def test_bytes_per_block_of_smollm2_shapes():
    config, block = smol_config(), 16
    per_block = {name: KVPool.for_config(config, num_blocks=2, kv_dtype=name).bytes_per_block
                 for name in ("int8", "float8_e4m3fn", "bfloat16", "float32")}
    assert per_block["int8"] == 2 * 30 * 3 * (64 + 2 * 2 * 2) * block  # a float16 pair per 32 elements
    assert per_block["float8_e4m3fn"] == 2 * 30 * 3 * (64 + 4) * block  # one float32 scale per vector
    assert per_block["float32"] == 2 * 30 * 3 * 64 * 4 * block
    assert per_block["bfloat16"] * 2 == per_block["float32"]


def test_a_budget_buys_about_3_6_times_the_blocks_in_int8():
    config = smol_config()
    int8 = KVPool.for_config(config, max_memory="64MiB", kv_dtype="int8")
    full = KVPool.for_config(config, max_memory="64MiB")
    assert int8.num_blocks == 64 * 2**20 // int8.bytes_per_block
    assert int8.num_blocks / full.num_blocks == pytest.approx(256 / 72, rel=0.01)
    assert int8.storage_bytes() == 0  # sized, not allocated


@pytest.mark.parametrize("kv_dtype", ["int8", "bfloat16"])
def test_storage_and_stats_count_every_byte(kv_dtype):
    model = head_dim_64_model()
    with PagedCache(model, kv_dtype=kv_dtype, num_blocks=10, block_size=4) as cache:
        forward(model, cache, **ragged_batch([0, 3], 10))  # 10 + 7 tokens in 3 + 2 blocks
        pool, stats = cache.pool, cache.stats()
        tensors = pool_tensors(pool)
        assert len(tensors) == (8 if kv_dtype == "int8" else 4)  # 2 layers x keys, values (+ their scales)
        assert pool.storage_bytes() == sum(t.numel() * t.element_size() for t in tensors)
        assert pool.storage_bytes() == pool.num_blocks * pool.bytes_per_block  # created whole, scales included
        vector = 64 + 8 if kv_dtype == "int8" else 64 * 2
        assert pool.bytes_per_block == 2 * 2 * 1 * vector * 4
        assert stats.pool_bytes == pool.storage_bytes()
        assert stats.bytes_reserved == 5 * pool.bytes_per_block
        assert stats.bytes_used == 17 * pool.bytes_per_block // 4
        assert stats.groups[0].bytes_per_block == pool.bytes_per_block


def test_exhausting_an_int8_pool_changes_nothing():
    model = model_for("llama")
    pool = KVPool.for_config(model.config, num_blocks=8, block_size=4, kv_dtype="int8")  # 7 usable blocks
    with PagedCache(model, pool=pool) as bystander, PagedCache(model, pool=pool) as victim:
        forward(model, bystander, **ragged_batch([0, 3], 10))  # 3 + 2 blocks
        forward(model, victim, **ragged_batch([0], 4))  # 1 block
        free, contents = pool.blocks.num_free, [t.clone() for t in pool_tensors(pool)]
        with pytest.raises(PoolExhaustedError, match=r"needs 3 blocks .* only 1 of 7 are free"):
            forward(model, victim, **ragged_batch([0], 9))  # 4 + 9 tokens -> 4 blocks, 3 more
        assert pool.blocks.num_free == free and victim.block_tables.num_tokens == [4]
        for before, after in zip(contents, pool_tensors(pool), strict=True):
            assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))


def test_a_key_past_float16_fails_the_forward_and_changes_nothing():
    """int8 refuses a group float16 cannot bound mid-forward (here layer 1's keys, after layer 0 has
    written): a clear ValueError, and both caches read what they held, with the pool's free blocks as before."""
    model = head_dim_64_model()
    pool = KVPool.for_config(model.config, num_blocks=8, block_size=4, kv_dtype="int8")
    with PagedCache(model, pool=pool) as bystander, PagedCache(model, pool=pool) as victim:
        forward(model, bystander, **ragged_batch([0, 3], 6))
        forward(model, victim, **ragged_batch([0], 4))
        free = pool.blocks.num_free
        contents = [cache.dense_view(layer) for cache in (bystander, victim) for layer in range(2)]
        projection = model.model.layers[1].self_attn.k_proj
        saved = projection.weight.detach().clone()
        try:
            with torch.no_grad():
                projection.weight.mul_(1e7)
            with pytest.raises(ValueError, match="kv_dtype='int8' keeps each group's minimum and range as float16"):
                forward(model, victim, **ragged_batch([0], 3))
        finally:
            with torch.no_grad():
                projection.weight.copy_(saved)
        assert pool.blocks.num_free == free and victim.block_tables.num_tokens == [4]
        assert bystander.block_tables.num_tokens == [6, 3]
        after = [cache.dense_view(layer) for cache in (bystander, victim) for layer in range(2)]
        for (keys, values), (keys_after, values_after) in zip(contents, after, strict=True):
            assert torch.equal(keys, keys_after) and torch.equal(values, values_after)
        forward(model, victim, **ragged_batch([0], 3))  # and the victim goes on


# ----------------------------------------------------------------------------------- 4. bad values


@pytest.mark.parametrize("bad", ["int4", torch.int16, "fp8", 8])
def test_unknown_kv_dtypes_are_refused_with_the_choices(bad):
    choices = "int8, float8_e4m3fn, bfloat16, float16, float32"
    with pytest.raises(ValueError, match=f"kv_dtype must be one of {choices}"):
        PagedCache(model_for("llama"), kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype must be one of"):
        KVPool.for_config(model_for("llama").config, num_blocks=4, kv_dtype=bad)


def test_a_pool_and_a_kv_dtype_together_are_refused():
    model = model_for("llama")
    pool = KVPool.for_config(model.config, num_blocks=8, kv_dtype="int8")
    with pytest.raises(ValueError, match="pool= or kv_dtype="):
        PagedCache(model, pool=pool, kv_dtype="int8")


def test_kv_dtype_may_be_a_torch_dtype():
    assert kv_format(torch.bfloat16, torch.float32) == kv_format("bfloat16", torch.float32)
    assert kv_format(torch.int8, torch.float32) == kv_format("int8", torch.float32)
    assert kv_format(torch.int8, torch.float32).affine and kv_format("float8_e4m3fn", torch.float32).qmax == 448
    assert kv_format(None, torch.bfloat16).storage == torch.bfloat16 and not kv_format(None, torch.float32).scaled


# ------------------------------------------------------------------------------ 5. KVFormat units


def sample_states(seed=0):
    """``[N, H, D]`` states with a wide range of magnitudes per vector, an outlier token among them."""
    generator = torch.Generator().manual_seed(seed)
    states = torch.randn(64, 2, 32, generator=generator) * torch.logspace(-3, 3, 64)[:, None, None]
    states[5, 1, 7] = 5e4  # one outlier element: only its own vector's scale coarsens
    return states


@pytest.mark.parametrize("dim, groups", [(32, 1), (64, 2), (128, 4), (80, 1)])
def test_int8_keeps_a_float16_minimum_and_step_per_group_of_32(dim, groups):
    int8 = kv_format("int8", torch.float32)
    states = torch.randn(16, 2, dim, generator=torch.Generator().manual_seed(1)) * 3 + 5  # off zero
    elements, scales = int8.encode(states)
    assert elements.dtype == torch.uint8 and scales.dtype == torch.float16 and scales.shape == (16, 2, groups, 2)
    assert int8.vector_bytes(dim) == dim + groups * 2 * 2
    grouped = states.view(16, 2, groups, -1)
    torch.testing.assert_close(scales[..., 0], grouped.amin(-1).half())
    torch.testing.assert_close(scales[..., 1], ((grouped.amax(-1) - grouped.amin(-1)) / 255).half())
    codes = elements.view(16, 2, groups, -1)
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 255).all()  # each group uses the full range


def test_int8_round_trip_is_within_about_half_a_step():
    """Within half a step of the group, plus what float16 rounding of its minimum and step costs."""
    int8 = kv_format("int8", torch.float32)
    states = sample_states()
    elements, scales = int8.encode(states)
    low, step = scales.float().unbind(-1)  # [N, H, 1] each: D = 32 is one group
    error = (int8.decode(elements, scales, torch.float32) - states).abs()
    assert (error <= step * (0.5 + 255 * 2**-11) + low.abs() * 2**-11 + 1e-6).all()


def test_int8_keeps_an_offset_group_fine():
    """A group far from zero (values in [1000, 1001]) keeps its detail, where one symmetric scale would not."""
    int8 = kv_format("int8", torch.float32)
    states = 1000 + torch.rand(4, 1, 64, generator=torch.Generator().manual_seed(2))
    error = (int8.decode(*int8.encode(states), torch.float32) - states).abs()
    assert error.max() < 0.3  # float16 holds 1000 to within 0.25; a symmetric int8 step would be 1001 / 127 ~ 7.9
    assert error.max() / states.abs().max() < 3e-4


def test_int8_refuses_states_float16_cannot_bound():
    int8 = kv_format("int8", torch.float32)
    with pytest.raises(ValueError, match="kv_dtype='int8' keeps each group's minimum and range as float16"):
        int8.encode(torch.full((1, 1, 64), 1e5))


@pytest.mark.parametrize("name", ["int8", "float8_e4m3fn"])
def test_a_zero_vector_round_trips_to_zeros(name):
    kv = kv_format(name, torch.float32)
    states = sample_states()
    states[3] = 0.0
    decoded = kv.decode(*kv.encode(states), torch.float32)
    assert torch.isfinite(decoded).all()
    assert torch.equal(decoded[3], torch.zeros_like(decoded[3]))


def test_float8_saturates_instead_of_overflowing_to_nan():
    """float8_e4m3fn has no infinity (past 448 a cast may give NaN; CPU torch 2.13 happens to saturate, so
    this cannot catch a missing clamp there). Encoding scales each vector's absmax to 448, so even float32's
    extremes come back finite, to within e4m3's 3 mantissa bits (a sixteenth of the value, or 2^-10 of the
    scale among the subnormals)."""
    fp8 = kv_format("float8_e4m3fn", torch.float32)
    states = sample_states()
    states[0, 0, :2] = torch.tensor([torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max])
    elements, scales = fp8.encode(states)
    assert scales.dtype == torch.float32 and scales.shape == (64, 2, 1, 1)  # one scale per vector
    decoded = fp8.decode(elements, scales, torch.float32)
    assert not elements.float().isnan().any() and torch.isfinite(decoded).all()
    assert elements.float().abs().max() == 448
    assert ((decoded - states).abs() <= states.abs() / 16 + scales.flatten(-2) * 2**-10).all()


def test_vector_bytes():
    assert kv_format("int8", torch.float32).vector_bytes(64) == 72
    assert kv_format("float8_e4m3fn", torch.float32).vector_bytes(64) == 68
    assert kv_format("bfloat16", torch.float32).vector_bytes(64) == 128
    assert kv_format(None, torch.float32).vector_bytes(64) == 256


def test_stored_states_write_and_gather_slots():
    """Every head at a slot of a layer's head-major storage reads back the decoded vector written there."""
    int8, heads = kv_format("int8", torch.float32), 2
    scales = torch.ones(heads, 8, 1, 2, dtype=torch.float16)
    stored = StoredStates(torch.zeros(heads, 8, 32, dtype=torch.uint8), scales, int8, torch.float32)
    states = sample_states()[:3].transpose(0, 1)  # [H, 3, D]
    stored.write(torch.tensor([6, 1, 4]), states)
    assert stored.plain is None
    expected = int8.decode(*int8.encode(states), torch.float32)[:, [1, 0, 2]]  # [H, 3, D] at slots 1, 6, 4
    assert torch.equal(stored.gather(torch.tensor([1, 6, 4])), expected)
    plain = StoredStates(torch.zeros(heads, 8, 32), None, kv_format(None, torch.float32), torch.float32)
    plain.write(torch.tensor([6, 1, 4]), states)
    assert torch.equal(plain.gather(torch.tensor([1, 6, 4])), states[:, [1, 0, 2]])
    assert torch.equal(plain.run(3, 4)[0], plain.data[:, 3:7]) and plain.run(3, 4).data_ptr() == plain.data[:, 3].data_ptr()
    assert plain.plain is plain.data
