"""Batch-invariant mode: a row's logits are the same bits whatever else shares its forwards.

The models are wider than the other tests' tiny ones (hidden size 256, 4 query heads of 64 over 2 key/value
heads): at a hidden size of 64 the CPU kernels give every row the same bits anyway, and the tests would prove
nothing. `test_the_default_mode_moves_with_the_batch` shows the same checks failing without the mode.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from hf_paged_cache import ContinuousBatcher, PagedCache
from hf_paged_cache.kernels.row_tiles import ROW_TILES, RowTile, is_tiled, row_tile, tile_rows, tiles_probe, untile_rows

VOCAB = 512
NEW_TOKENS = 6
WIDE = {
    "llama": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    # query and key norms, head_dim given apart from the hidden size (128: on an Intel Xeon with AMX, float32 products
    # over 128 dimensions sum 4 query rows in another order than 8, so the heads are padded to 8 there)
    "qwen3": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=128),
    # multi-head attention (one query head per key/value head), learned positions, transformers' Conv1D layers
    "gpt2": dict(n_embd=256, n_layer=2, n_head=4, n_positions=512),
    # sliding windows shorter than the prompts (a long forward attends new keys that the window does not store)
    "mistral": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, sliding_window=12),
    # sliding and full layers, soft-capped attention logits
    "gemma3_text": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=64, sliding_window=12, query_pre_attn_scalar=64,
                        layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0),
}
# (rows in the batch, the row the prompt takes)
BATCHES = [(2, 1), (7, 0), (7, 3), (64, 17), (64, 63)]


def wide_model(model_type: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    config = AutoConfig.for_model(model_type, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=None, **WIDE[model_type])
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def prompt(length: int = 21, seed: int = 5) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def batch_around(target: torch.Tensor, rows: int, at: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of `rows` random prompts of 3 to 40 tokens with `target` as row `at`."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 41, (rows,), generator=generator).tolist()
    lengths[at] = target.shape[0]
    width = max(lengths)
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention_mask = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        tokens = target if row == at else torch.randint(3, VOCAB, (length,), generator=generator)
        input_ids[row, width - length :] = tokens
        attention_mask[row, width - length :] = 1
    return input_ids, attention_mask


def greedy_logits(model, target: torch.Tensor, rows: int, at: int, invariant: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Row `at`'s logits ``[NEW_TOKENS, V]`` and new tokens when `target` is generated among `rows` rows."""
    input_ids, attention_mask = batch_around(target, rows, at, seed=rows * 100 + at)
    cache = PagedCache(model, batch_invariant=invariant)
    out = model.generate(input_ids=input_ids, attention_mask=attention_mask, cache=cache,
                         max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True)
    return torch.stack([step[at] for step in out.logits]), out.sequences[at, -NEW_TOKENS:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", list(WIDE))
def test_a_row_has_the_same_logits_in_any_batch(model_type, dtype):
    model = wide_model(model_type, dtype)
    target = prompt()
    alone, tokens = greedy_logits(model, target, 1, 0, invariant=True)
    for rows, at in BATCHES:
        logits, new = greedy_logits(model, target, rows, at, invariant=True)
        assert torch.equal(logits, alone), f"row {at} of {rows}"
        assert torch.equal(new, tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_default_mode_moves_with_the_batch(dtype):
    """The same checks without the mode: the logits move (so the test above can fail), by float rounding only."""
    model = wide_model("llama", dtype)
    target = prompt()
    alone, _ = greedy_logits(model, target, 1, 0, invariant=False)
    moved = [not torch.equal(greedy_logits(model, target, rows, at, invariant=False)[0], alone) for rows, at in BATCHES]
    if not any(moved):
        pytest.skip("this machine's kernels give these rows the same bits in any batch even without the mode")
    invariant, _ = greedy_logits(wide_model("llama", dtype), target, 1, 0, invariant=True)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(invariant.float(), alone.float(), rtol=0, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mistral"])
def test_scoring_a_text_gives_the_logits_it_was_generated_with(model_type, dtype):
    """Prefill equals decode: the generated text scored in one forward, or in two chunks, gives each token's
    logits as they were when it was picked."""
    model = wide_model(model_type, dtype)
    target = prompt()
    generated, tokens = greedy_logits(model, target, 1, 0, invariant=True)
    text = torch.cat([target, tokens]).unsqueeze(0)  # [1, P + N]
    picked = slice(target.shape[0] - 1, target.shape[0] - 1 + NEW_TOKENS)  # the positions that picked them
    with torch.no_grad():
        whole = model(input_ids=text, cache=PagedCache(model, batch_invariant=True)).logits[0]
        cache = PagedCache(model, batch_invariant=True)
        chunks = torch.cat([model(input_ids=part, cache=cache).logits[0] for part in text.split([13, 14], 1)])
    assert torch.equal(whole[picked], generated)
    assert torch.equal(chunks[picked], generated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("window", [80, 200])
def test_a_window_wider_than_a_tile_scores_a_text_as_it_generated_it(window, dtype):
    """A sliding window of more keys than a tile of values (64), on a prompt longer than the window: the decode steps
    read the keys from the window's first block, the prefill from position 0. With one product over a window's
    keys (before `_by_real_index`) the float32 scores here differed from the generated ones, and bfloat16 windows
    were refused (their products rounded otherwise after masked keys in front)."""
    config = AutoConfig.for_model("mistral", vocab_size=VOCAB, max_position_embeddings=1024, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=None, **{**WIDE["mistral"], "sliding_window": window})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    target = prompt(length=window + 90)
    generated, tokens = greedy_logits(model, target, 1, 0, invariant=True)
    amid, _ = greedy_logits(model, target, 7, 3, invariant=True)
    text = torch.cat([target, tokens]).unsqueeze(0)  # [1, P + N]
    picked = slice(target.shape[0] - 1, target.shape[0] - 1 + NEW_TOKENS)
    with torch.no_grad():
        whole = model(input_ids=text, cache=PagedCache(model, batch_invariant=True)).logits[0]
        cache = PagedCache(model, batch_invariant=True)
        parts = text.split([37, text.shape[1] - 37], 1)  # the first chunk shorter than the window
        chunks = torch.cat([model(input_ids=part, cache=cache).logits[0] for part in parts])
    assert torch.equal(amid, generated)
    assert torch.equal(whole[picked], generated)
    assert torch.equal(chunks[picked], generated)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_the_batcher_gives_a_request_the_same_logprobs_alone_and_amid_others(dtype):
    """Through the continuous batcher: alone, amid 11 other requests (packed steps, chunks, other rows), as a
    prefix hit, and with n-gram speculation, a request's log-probabilities are the same bits; scored afterwards
    (``prompt_logprobs``), its text gives the numbers it was generated with."""
    model = wide_model("llama", dtype)
    target = prompt(length=40).tolist()
    others = [prompt(length=10 + 3 * i, seed=i).tolist() for i in range(11)]

    def run(batcher, **kwargs):
        handle = batcher.submit(target, max_new_tokens=NEW_TOKENS, logprobs=2, **kwargs)
        return handle.result(timeout=120), handle.logprobs

    with ContinuousBatcher(model, block_size=16, max_step_tokens=48, batch_invariant=True) as batcher:
        tokens, alone = run(batcher)
        assert batcher.stats().prefix_hit_tokens == 0
        hit = run(batcher)  # its blocks are cached now
        assert batcher.stats().prefix_hit_tokens > 0
        crowd = [batcher.submit(p, max_new_tokens=8) for p in others]
        amid = run(batcher)
        for handle in crowd:
            handle.result(timeout=120)
        scored = batcher.submit(target + tokens, max_new_tokens=1, prompt_logprobs=0)
        scored.result(timeout=120)
    with ContinuousBatcher(model, block_size=16, batch_invariant=True, speculative="ngram") as batcher:
        speculated = run(batcher)
    for result in (hit, amid, speculated):
        assert result == (tokens, alone)
    picked = scored.prompt_logprobs[len(target) - 1 :]  # the generated tokens, scored
    assert [lp.logprob for lp in picked] == [lp.logprob for lp in alone]


def test_models_the_mode_cannot_run_fail_clearly():
    with pytest.raises(ValueError, match="needs the model"):
        PagedCache(wide_model("llama").config, batch_invariant=True)
    mistral = wide_model("mistral")
    with pytest.raises(NotImplementedError, match="sliding-window model's keys and values as computed"):
        PagedCache(mistral, batch_invariant=True, kv_dtype="int8")
    assert not any(is_tiled(m) for m in mistral.modules())  # refused before anything changed
    config = AutoConfig.for_model("gpt_oss", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  num_local_experts=2, num_experts_per_tok=1, sliding_window=12,
                                  layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(NotImplementedError, match="sinks"):
        PagedCache(AutoModelForCausalLM.from_config(config).eval(), batch_invariant=True)


def test_tiles_change_neither_the_layers_nor_their_weights():
    model = wide_model("llama")
    keys = list(model.state_dict())
    rows = torch.randn(3, 5, 256)
    layer = model.model.layers[0].mlp.up_proj
    before = layer(rows)
    assert tile_rows(model) == 2 * 7 + 1  # 7 linear layers per decoder layer and the output head
    assert tile_rows(model) == 0  # idempotent
    assert is_tiled(layer) and type(layer) is nn.Linear and list(model.state_dict()) == keys
    torch.testing.assert_close(layer(rows), before)
    assert layer(rows).shape == (3, 5, 768)
    assert untile_rows(model) == 15 and not is_tiled(layer)


class RowPlaceLinear(nn.Linear):
    """A linear layer whose products depend on where a row sits in the call (as a kernel that rounds its tail rows
    otherwise would): every row but the call's first is off by 1e-3. No tile helps."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = super().forward(x).flatten(0, -2)  # [R, N]
        return (flat + 1e-3 * (torch.arange(flat.shape[0]) > 0).unsqueeze(1)).view(*x.shape[:-1], -1)


def test_a_kernel_that_depends_on_the_batch_is_refused():
    threads = torch.get_num_threads()
    assert tiles_probe(nn.Linear, 256, 768, True, torch.float32, threads, ROW_TILES[-1]) == ""
    problems = [tiles_probe(RowPlaceLinear, 256, 768, True, torch.float32, threads, tile) for tile in ROW_TILES]
    assert all("changed among" in problem for problem in problems)
    with pytest.raises(RuntimeError, match="not available for RowPlaceLinear.*in calls of exactly 64 rows"):
        row_tile(RowPlaceLinear, 256, 768, True, torch.float32)
    model = nn.Sequential(nn.Linear(256, 768), RowPlaceLinear(256, 768))
    with pytest.raises(RuntimeError, match="not available"):
        tile_rows(model)
    assert not any(is_tiled(layer) for layer in model)  # nothing changed


def test_attention_whose_sum_depends_on_the_padding_is_refused(monkeypatch):
    """The probe puts a row of 1,000 keys beside longer rows: a value product that sums by the padded length (as
    one product over all keys did on an Intel Xeon, float32, past 1,024 keys) is caught."""
    from hf_paged_cache.attention import invariant

    def by_length(weights, values):  # [N, H, M, n'] x [N, H, n', Dv], off by 1e-3 past 1,024 keys
        return torch.matmul(weights, values.float()) + 1e-3 * (weights.shape[-1] > 1024)

    threads = torch.get_num_threads()
    invariant.attention_probe.cache_clear()
    monkeypatch.setattr(invariant, "weighted_values", by_length)
    try:
        assert "over 1000 keys changed beside a row of" in invariant.attention_probe(64, 3, torch.float32, threads)
    finally:
        invariant.attention_probe.cache_clear()


def test_attention_whose_sum_depends_on_the_query_rows_gets_more_head_rows(monkeypatch):
    """A value product that rounds calls of fewer than 8 query rows otherwise (as float32 products over 128
    dimensions did on an Intel Xeon with AMX, 4 rows against 8) pads each query's heads to 8 rows."""
    from hf_paged_cache.attention import invariant

    weighted_values = invariant.weighted_values

    def by_rows(weights, values):  # [N, H, M, n'] x [N, H, n', Dv], off by 1e-3 below 8 rows
        return weighted_values(weights, values) + 1e-3 * (weights.shape[2] < 8)

    threads = torch.get_num_threads()
    invariant.head_rows.cache_clear()
    invariant.attention_probe.cache_clear()
    monkeypatch.setattr(invariant, "weighted_values", by_rows)
    try:
        assert "a tile of 2" in invariant._probe(64, 3, torch.float32, threads, 4)
        assert invariant.head_rows(64, 3, torch.float32, threads) == 8
        assert invariant.attention_probe(64, 3, torch.float32, threads) == ""
    finally:
        invariant.head_rows.cache_clear()
        invariant.attention_probe.cache_clear()


class RowCountLinear(nn.Linear):
    """A linear layer whose products depend on how many rows share the call, as some kernels' rounding does (an
    Intel Xeon's bfloat16 products with AMX: 16 rows against 64)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1e-3 * (x.numel() // x.shape[-1] > 16)


def test_a_kernel_that_depends_on_the_row_count_gets_calls_of_one_count():
    threads = torch.get_num_threads()
    assert "changed among 17 rows" in tiles_probe(RowCountLinear, 256, 768, True, torch.float32, threads, RowTile(16))
    assert row_tile(RowCountLinear, 256, 768, True, torch.float32) == RowTile(16, exact=True)
    layer = RowCountLinear(256, 768)
    rows = torch.randn(300, 256)
    tile_rows(layer)
    torch.testing.assert_close(layer(rows), F.linear(rows, layer.weight, layer.bias))  # never a call of 17+ rows


def test_the_mode_can_be_asked_for_under_inference_mode():
    """The probes build their layers outside inference mode (a packed layer tracks its weight's version)."""
    from hf_paged_cache.kernels import pack_linears

    model = wide_model("llama")
    pack_linears(model)
    tiles_probe.cache_clear()
    with torch.inference_mode():
        PagedCache(model, batch_invariant=True).release()
    assert all(is_tiled(m) for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_prompt_from_cached_blocks_gets_the_logits_computed_whole(dtype):
    """At SmolLM2's width (576). Before the probe's inputs cancelled (`row_tiles._cancelling`), the default model in
    bfloat16 on an Intel Xeon with AMX failed this (up to 0.375 apart, from 160 cached positions of 171), and a
    bfloat16 batch-invariant cache refused `reuse_prefix`: its ``nn.Linear(576, 576)`` rounds a call's rows from
    the 33rd on in another order than a row alone, which a probe of random rows let take any row count. (This
    2-layer model's rows happened to round alike either way.)"""
    config = AutoConfig.for_model("llama", vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
                                  hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
                                  num_attention_heads=9, num_key_value_heads=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    text = prompt(length=171).unsqueeze(0)
    with torch.no_grad(), PagedCache(model, batch_invariant=True) as cold:
        whole = model(input_ids=text, cache=cold).logits[0, -11:]
        with PagedCache(model, batch_invariant=True, pool=cold.pool) as warm:
            assert warm.reuse_prefix(text) == 160
            hit = model(input_ids=text[:, 160:], cache=warm).logits[0]
    assert torch.equal(hit, whole)


class TailOrderLinear(nn.Linear):
    """A bfloat16 kernel that sums one output of a call's rows from the 33rd on in another order (the two halves of
    the inputs apart, then added), as a kernel's tail blocks might: on random inputs so few outputs round otherwise
    that a probe of 64 random rows gave it multiples of 4 rows."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.flatten(0, -2).float()  # [R, K]
        weight, half = self.weight.float(), x.shape[-1] // 2
        out = F.linear(flat, weight)  # [R, N], float32
        tail, last = flat[32:], weight[-1]
        out[32:, -1] = tail[:, :half] @ last[:half] + tail[:, half:] @ last[half:]
        return out.to(x.dtype).view(*x.shape[:-1], -1)


def test_a_kernel_whose_rare_roundings_depend_on_the_row_is_caught():
    threads = torch.get_num_threads()
    assert "changed among 64 rows" in tiles_probe(TailOrderLinear, 576, 576, False, torch.bfloat16, threads,
                                                  RowTile(16))
    assert row_tile(TailOrderLinear, 576, 576, False, torch.bfloat16) == RowTile(16, exact=True)
