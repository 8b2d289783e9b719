"""The server on a CPU without a fast path: it answers in every dtype it accepts, or refuses to start.

An AVX2-only CPU raises ``mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...`` at oneDNN's first
bfloat16 product. These tests make that operator raise exactly so (a ``sitecustomize`` module in the server's
path, which Python imports at start-up), or cap the capability level (``HF_PAGED_CACHE_CPU_CAPABILITY=avx2``),
and drive the real server with the official client.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from server_process import KEY, NAME, free_port, run_server

openai = pytest.importorskip("openai")

from hf_paged_cache.kernels import packed_linears_supported  # noqa: E402
from hf_paged_cache.kernels.cpu_capability import CAPABILITY_ENV  # noqa: E402

AVX2_ERROR = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl "
              "and avx512dq")

AVX2_ONEDNN = f'''
import torch

_reorder = torch.ops.mkldnn._reorder_linear_weight


def _as_on_avx2(weight, *arguments):
    if weight.dtype == torch.bfloat16:
        raise RuntimeError({AVX2_ERROR!r})
    return _reorder(weight, *arguments)


torch.ops.mkldnn._reorder_linear_weight = _as_on_avx2
'''
"""oneDNN's bfloat16 linear path as an AVX2-only CPU has it: the operator raises PyTorch's own error."""

NO_BFLOAT16_ATTENTION = '''
import torch
import torch.nn.functional as F

_sdpa = F.scaled_dot_product_attention


def _refuses_bfloat16(query, *arguments, **options):
    if query.dtype == torch.bfloat16:
        raise RuntimeError("no bfloat16 attention kernel on this CPU")
    return _sdpa(query, *arguments, **options)


F.scaled_dot_product_attention = _refuses_bfloat16
'''
"""A kernel that fails every bfloat16 forward and that no probe asks about: the first request finds it."""


def _site(tmp_path: Path, source: str, monkeypatch) -> None:
    """Put a ``sitecustomize`` of `source` on the path of the processes started from now on."""
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(source))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")])))


def _answers(server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    completion = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.usage.completion_tokens >= 1
    return completion.choices[0].text


@pytest.mark.skipif(not packed_linears_supported(), reason="this PyTorch build has no oneDNN to refuse bfloat16")
def test_bfloat16_where_onednn_refuses_it_answers_on_the_stock_kernels(model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv(CAPABILITY_ENV, raising=False)  # the operator's own refusal, not the cap's
    _site(tmp_path, AVX2_ONEDNN, monkeypatch)
    check = subprocess.run([sys.executable, "-c", "import torch; torch.ops.mkldnn._reorder_linear_weight("
                            "torch.ones(4, 4, dtype=torch.bfloat16), 1)"], capture_output=True, text=True)
    assert AVX2_ERROR in check.stderr  # the servers below meet the AVX2 error
    log = tmp_path / "server.log"
    with run_server(model_dir, log, "--dtype", "bfloat16", "--log-level", "info") as server:
        _answers(server)
    text = log.read_text()
    assert "linear layers on PyTorch's stock kernels: oneDNN refused a torch.bfloat16 product here" in text
    assert AVX2_ERROR in text  # the reason, named


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "auto"])
def test_every_dtype_answers_under_an_avx2_cap(model_dir, tmp_path, monkeypatch, dtype):
    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    with run_server(model_dir, tmp_path / "server.log", "--dtype", dtype) as server:
        _answers(server)


def test_a_configuration_that_fails_every_request_stops_the_server_at_start(model_dir, tmp_path, monkeypatch):
    _site(tmp_path, NO_BFLOAT16_ATTENTION, monkeypatch)
    command = [sys.executable, "-m", "hf_paged_cache.serve", str(model_dir), "--port", str(free_port()), "--dtype", "bfloat16",
               "--log-level", "info"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "cannot answer a request as configured (--dtype bfloat16, --device cpu)" in done.stderr
    assert "no bfloat16 attention kernel on this CPU" in done.stderr
    assert "ready to serve" not in done.stderr
