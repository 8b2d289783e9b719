"""A model in bfloat16: the paged cache stays as close to the float32 model as `DynamicCache` does; and
``--dtype auto``, which picks bfloat16 where the device multiplies it natively.

In reduced precision "exact" cannot mean token-identical to a padded `DynamicCache` batch: reading each row's
keys and values from blocks rounds differently from reading a padded tensor, and greedy search follows the
rounding at near-ties. So fidelity is measured against the same weights in float32, for both caches in the
same dtype, on the same tokens (teacher-forced on the float32 model's greedy continuation, so that every
step of every row compares like for like):

- the max and the mean |logit difference| from float32, on the prefill step and over all decode steps;
- top-1 agreement: the share of (row, step) whose argmax is float32's.

Measured on these tiny models (prefill max / decode max / decode mean; top-1), bfloat16 with `DynamicCache`:
llama 0.0029 / 0.0037 / 0.00065 (0.986), gemma3_text 0.0072 / 0.0122 / 0.00146 (0.986), gpt_oss 0.0033 /
0.0039 / 0.00076 (0.972), deepseek_v3 0.0030 / 0.0030 / 0.00064 (1.0). `PagedCache` under the model's own
attention gives the same numbers (it hands SDPA the same values); under `paged_sdpa` it differs by rounding
(llama's prefill max 0.0023, gemma3_text's decode max 0.0133), mean and top-1 unchanged. The bounds leave
room for two roundings to land differently, not for a systematic error: float8 keys and values on the same
bfloat16 model, a path measurably less precise (decode mean 1.7x to 4.5x), fail them on every architecture.
"""

from __future__ import annotations

import argparse
import copy
import functools
from dataclasses import dataclass

import pytest
import torch
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache, LogitsProcessor, LogitsProcessorList

from hf_paged_cache import PagedCache, set_paged_attention
from hf_paged_cache.kernels import cpu_capability
from hf_paged_cache.kernels.cpu_capability import CAPABILITY_ENV
from hf_paged_cache.models import add_model_arguments, fast_dtype, resolve_dtype
from hf_paged_cache.server.launch import build_parser

ARCHITECTURES = ["llama", "gemma3_text", "gpt_oss", "deepseek_v3"]  # plain, sliding, sinks, latent (Dk != Dv)
ATTENTIONS = ["default", "paged_sdpa"]
PADS = [0, 4, 9]
PROMPT = 20
NEW_TOKENS = 24  # rows cross a 16-token block boundary

MAX_RATIO = 1.5  # paged's max error at most this many times dynamic's (plus ABSOLUTE)
MEAN_RATIO = 1.1  # paged's mean error over the decode steps at most this many times dynamic's (plus ABSOLUTE)
ABSOLUTE = 1e-4  # slack for errors that are both tiny
TOP1_SLACK = 0.03  # paged's top-1 agreement at most this far below dynamic's (2 of 72 row-steps)


class ForceTokens(LogitsProcessor):
    """Make greedy search pick `sequences`' next token at every step (teacher forcing inside `generate`).

    `generate`'s raw logits (``output_logits``) are the model's own; only the choice is forced.
    """

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences  # [B, prompt + new]

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        target = self.sequences[:, input_ids.shape[1]]  # [B]
        forced = torch.full_like(scores, float("-inf"))
        return forced.scatter_(1, target[:, None], 0.0)


@dataclass(frozen=True)
class Fidelity:
    prefill_max: float  # max |logit - float32 logit| on the prefill step
    decode_max: float  # the same over every decode step
    decode_mean: float  # mean |logit - float32 logit| over every decode step
    top1: float  # share of (row, step) whose argmax is float32's


@functools.cache
def models(model_type: str, attention: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model in float32 and the same weights in bfloat16 (built once)."""
    full = tiny_model(model_type)
    half = copy.deepcopy(full).to(torch.bfloat16)
    if attention == "paged_sdpa":
        set_paged_attention(full)
        set_paged_attention(half)
    return full, half


def run(model, cache, **kwargs):
    with torch.no_grad():
        return model.generate(**ragged_batch(PADS, PROMPT), cache=cache, max_new_tokens=NEW_TOKENS, do_sample=False,
                              return_dict_in_generate=True, output_logits=True, **kwargs)


@functools.cache
def float32_reference(model_type: str, attention: str):
    """The float32 model's greedy generation with `DynamicCache`, raw logits included (computed once)."""
    full, _ = models(model_type, attention)
    return run(full, DynamicCache(config=full.config))


@functools.cache
def fidelity(model_type: str, attention: str, cache_kind: str) -> Fidelity:
    """How close the bfloat16 model stays to float32 (with `DynamicCache`) with a `cache_kind` cache:
    ``"dynamic"``, ``"paged"`` or ``"paged-float8"`` (float8 keys and values)."""
    _, half = models(model_type, attention)
    reference = float32_reference(model_type, attention)
    caches = {"dynamic": lambda: DynamicCache(config=half.config), "paged": lambda: PagedCache(half),
              "paged-float8": lambda: PagedCache(half, kv_dtype="float8_e4m3fn")}
    cache = caches[cache_kind]()
    ours = run(half, cache, logits_processor=LogitsProcessorList([ForceTokens(reference.sequences)]))
    assert torch.equal(ours.sequences, reference.sequences)  # teacher-forced: the same tokens were fed
    theirs = torch.stack(reference.logits)  # [steps, B, vocab]
    mine = torch.stack(ours.logits).float()
    errors = (mine - theirs).abs()
    return Fidelity(
        prefill_max=errors[0].max().item(),
        decode_max=errors[1:].max().item(),
        decode_mean=errors[1:].mean().item(),
        top1=(mine.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
    )


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_bfloat16_paged_is_as_close_to_float32_as_dynamic(model_type, attention):
    paged, dynamic = fidelity(model_type, attention, "paged"), fidelity(model_type, attention, "dynamic")
    assert dynamic.prefill_max > 0  # the model really ran in bfloat16
    assert within_bounds(paged, dynamic), (paged, dynamic)


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_the_bounds_catch_a_less_precise_path(model_type):
    worse, dynamic = fidelity(model_type, "paged_sdpa", "paged-float8"), fidelity(model_type, "paged_sdpa", "dynamic")
    assert not within_bounds(worse, dynamic), (worse, dynamic)


def within_bounds(ours: Fidelity, dynamic: Fidelity) -> bool:
    """Whether `ours` is as close to float32 as `DynamicCache` in the same dtype, up to rounding (the bounds above)."""
    return (ours.prefill_max <= MAX_RATIO * dynamic.prefill_max + ABSOLUTE
            and ours.decode_max <= MAX_RATIO * dynamic.decode_max + ABSOLUTE
            and ours.decode_mean <= MEAN_RATIO * dynamic.decode_mean + ABSOLUTE
            and ours.top1 >= dynamic.top1 - TOP1_SLACK)


# ------------------------------------------------------------------------------ --dtype auto


@pytest.mark.parametrize(("amx", "avx512_bf16", "expected"), [
    (True, False, torch.bfloat16), (False, True, torch.bfloat16), (False, False, torch.float32),
])
def test_auto_is_bfloat16_on_a_cpu_that_multiplies_it_natively(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    cpu_capability.cache_clear()  # asked again, of the CPU patched above
    try:
        assert fast_dtype("cpu") is expected
        assert resolve_dtype("auto", "cpu") is expected
    finally:
        cpu_capability.cache_clear()


def test_named_dtypes_resolve_as_named_and_others_are_refused():
    assert resolve_dtype("float16", "cpu") is torch.float16 and resolve_dtype(torch.bfloat16) is torch.bfloat16
    with pytest.raises(ValueError, match="'float32', 'bfloat16', 'float16', 'auto'"):
        resolve_dtype("int8")
    with pytest.raises(ValueError, match="floating-point"):
        resolve_dtype(torch.int8)


def test_the_server_and_the_scripts_take_auto():
    assert build_parser().parse_args(["default", "--dtype", "auto"]).dtype == "auto"
    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    assert parser.parse_args(["--dtype", "auto"]).dtype == "auto"
