"""What this CPU can run is asked, not assumed: the capability level, its cap by ``HF_PAGED_CACHE_CPU_CAPABILITY``,
the packing probe and the fallbacks built on them, and ``hf-paged-cache env``.

The fallbacks are reached on any machine by capping the level (``HF_PAGED_CACHE_CPU_CAPABILITY=avx2``), as an
AVX2-only CPU reaches them by its own probes.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tiny_models import tiny_model
from torch import nn
from transformers import DynamicCache

from hf_paged_cache import PagedCache
from hf_paged_cache.kernels import PackedLinear, cpu_capability, pack_linears, packed_linears_supported, packing_probe
from hf_paged_cache.kernels.cpu_capability import CAPABILITY_ENV, LEVELS
from hf_paged_cache.models import fast_dtype


@pytest.fixture
def capped(monkeypatch):
    """Cap this process's capability level (the probes' caches cleared before and after)."""

    def cap(level: str) -> None:
        monkeypatch.setenv(CAPABILITY_ENV, level)
        _clear_probes()

    yield cap
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)
    _clear_probes()


def _clear_probes() -> None:
    cpu_capability.cache_clear()
    packing_probe.cache_clear()


def test_the_level_is_what_torch_reports():
    capability = cpu_capability()
    assert capability.detected in LEVELS and capability.torch_isa == torch.backends.cpu.get_cpu_capability()
    has_avx2 = torch.cpu._is_avx2_supported()
    assert capability.at_least("avx2") == has_avx2 or capability.capped_by is not None
    assert capability.at_least("default")


def test_a_cap_lowers_the_level_and_never_raises_it(capped):
    detected = cpu_capability().detected
    capped("default")
    capability = cpu_capability()
    assert capability.level == "default" and capability.detected == detected
    assert (capability.capped_by is None) == (detected == "default")
    capped("amx")  # above or at the CPU's level: the CPU's level, not capped
    assert cpu_capability().level == detected and cpu_capability().capped_by is None


def test_an_unknown_cap_is_a_clear_error(capped):
    capped("avx9000")
    with pytest.raises(ValueError, match=f"{CAPABILITY_ENV} must be one of default, avx2, .*'avx9000'"):
        cpu_capability()


needs_onednn = pytest.mark.skipif(not packed_linears_supported(), reason="this PyTorch build has no oneDNN")


@needs_onednn
def test_the_probe_runs_the_operator_and_names_what_it_refuses():
    assert packing_probe(torch.float32).supported  # oneDNN's float32 path needs no more than SSE4
    refused = packing_probe(torch.float16)
    assert not refused.supported and "not torch.float16" in refused.reason
    assert packing_probe(torch.float32) is packing_probe(torch.float32)  # asked once


@needs_onednn
def test_bfloat16_packing_falls_back_under_an_avx2_cap(capped, caplog):
    capped("avx2")
    probe = packing_probe(torch.bfloat16)
    assert not probe.supported and "AVX-512" in probe.reason and f"{CAPABILITY_ENV}=avx2" in probe.reason
    model = tiny_model("llama").to(torch.bfloat16)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    with caplog.at_level(logging.WARNING, logger="hf_paged_cache.kernels.packed_linear"):
        assert pack_linears(model) == 0
    assert sum(type(m) is nn.Linear for m in model.modules()) == linears  # every layer stock
    assert [r.getMessage() for r in caplog.records] == [
        f"left {linears} torch.bfloat16 linear layers on PyTorch's stock kernels: {probe.reason}"]
    # the model answers, as the stock model does
    inputs = torch.tensor([[5, 9, 3, 7]])
    dense = model.generate(input_ids=inputs, max_new_tokens=6, do_sample=False, cache=DynamicCache(config=model.config))
    paged = model.generate(input_ids=inputs, max_new_tokens=6, do_sample=False, cache=PagedCache(model))
    assert torch.equal(dense, paged)


@needs_onednn
def test_strict_packing_refuses_before_changing_anything(capped):
    capped("avx2")
    model = tiny_model("llama").to(torch.bfloat16)
    before = [type(m) for m in model.modules()]
    with pytest.raises(NotImplementedError, match="cannot pack .* torch.bfloat16 linear layers: oneDNN's bfloat16"):
        pack_linears(model, strict=True)
    assert [type(m) for m in model.modules()] == before


@needs_onednn
def test_a_packed_layer_cast_to_a_refused_dtype_takes_the_stock_path(capped):
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    packed = PackedLinear(linear)
    capped("avx2")
    packed.to(torch.bfloat16)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), F.linear(x, linear.weight, linear.bias))  # F.linear itself: bit-identical
    assert packed._packed is None  # nothing was packed for bfloat16


def test_auto_dtype_is_float32_below_native_bfloat16(capped):
    capped("avx512")
    assert fast_dtype("cpu") == torch.float32
    capped("amx")
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert fast_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


def _env(*arguments: str, cap: str | None = None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(CAPABILITY_ENV, None)
    if cap is not None:
        env[CAPABILITY_ENV] = cap
    done = subprocess.run([sys.executable, "-m", "hf_paged_cache.cli", "env", *arguments], capture_output=True,
                          text=True, env=env, timeout=120, check=True)
    return done.stdout


def test_env_reports_each_path_and_the_cap():
    report = dict(_split(line) for line in _env(cap="avx2").splitlines())
    assert report["capability level"].startswith("avx2")
    assert report["--dtype auto"] == "float32"
    if packed_linears_supported():
        assert report["linear layers, float32 (pack_linears)"] == "oneDNN, weights packed once"
        assert report["linear layers, bfloat16 (pack_linears)"].startswith("stock kernels: oneDNN's bfloat16")
    for path in ("CPU", "PyTorch's own kernels", "paged_flex decode kernel", "MKL's fast kernels",
                 "padded heap (serve --pad-heap)"):
        assert report[path]


def _split(line: str) -> tuple[str, str]:
    what, answer = line.split("  ", 1)
    return what.strip(), answer.strip()
