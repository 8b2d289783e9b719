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
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from server_process import KEY, NAME, Server, ServerDidNotStart, free_port, healthy, run_servers, wait_for_start

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


def _site(folder: Path, source: str) -> dict[str, str]:
    """A ``sitecustomize`` of `source` in `folder`: the ``PYTHONPATH`` that puts it in the processes given it."""
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(textwrap.dedent(source))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def servers(model_dir, tmp_path_factory) -> Iterator[dict[str, Server]]:
    """The module's server processes, started side by side (each loads torch and the model; on two cores two
    load at once): ``onednn``, bfloat16 where oneDNN refuses it (the operator's own refusal, no cap); one per
    dtype under an AVX2 cap; and ``refused``, a bfloat16 server that no request can run on, which must exit
    (its process and its stderr only)."""
    folder = tmp_path_factory.mktemp("servers")
    refused_log, refused_port = folder / "refused.log", free_port()
    with open(refused_log, "wb") as out:
        refused = subprocess.Popen(
            [sys.executable, "-m", "hf_paged_cache.serve", str(model_dir), "--port", str(refused_port), "--dtype",
             "bfloat16", "--log-level", "info"], stdout=subprocess.DEVNULL, stderr=out,
            env={**os.environ, "OMP_NUM_THREADS": "1", **_site(folder / "no-bf16-attention", NO_BFLOAT16_ATTENTION)})
    commands, envs = {}, {}
    if packed_linears_supported():
        commands["onednn"] = (model_dir, folder / "onednn.log", "--dtype", "bfloat16", "--log-level", "info")
        envs["onednn"] = {CAPABILITY_ENV: None, **_site(folder / "avx2-onednn", AVX2_ONEDNN)}
    for dtype in ("bfloat16", "float32"):
        commands[dtype] = (model_dir, folder / f"{dtype}.log", "--dtype", dtype)
        envs[dtype] = {CAPABILITY_ENV: "avx2"}
    try:
        with run_servers(list(commands.values()), list(envs.values())) as running:
            refused_server = Server(f"http://127.0.0.1:{refused_port}", refused, refused_log)
            yield {**dict(zip(commands, running)), "refused": refused_server}
    finally:
        if refused.poll() is None:
            refused.kill()
        refused.wait()


def _answers(server) -> str:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    completion = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.usage.completion_tokens >= 1
    return completion.choices[0].text


@pytest.mark.skipif(not packed_linears_supported(), reason="this PyTorch build has no oneDNN to refuse bfloat16")
def test_bfloat16_where_onednn_refuses_it_answers_on_the_stock_kernels(servers):
    server = servers["onednn"]
    _answers(server)
    text = server.log.read_text()
    assert "linear layers on PyTorch's stock kernels: oneDNN refused a torch.bfloat16 product here" in text
    assert AVX2_ERROR in text  # the reason, named: the server met the AVX2 error of its sitecustomize


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_every_dtype_answers_under_an_avx2_cap(servers, dtype):
    _answers(servers[dtype])


def test_auto_under_an_avx2_cap_loads_float32_and_answers(model_dir, monkeypatch):
    """``--dtype auto`` is resolved once, at load (`load_batcher`): under the cap it is float32, and from there
    the server runs as ``--dtype float32`` does above. Loaded here, in this process (the probes' caches cleared
    before and after, as the cap changes what they answer)."""
    from hf_paged_cache.kernels import packing_probe
    from hf_paged_cache.kernels.cpu_capability import cpu_capability
    from hf_paged_cache.server.launch import build_parser, load_batcher

    def clear_probes() -> None:
        cpu_capability.cache_clear()
        packing_probe.cache_clear()

    monkeypatch.setenv(CAPABILITY_ENV, "avx2")
    clear_probes()
    try:
        batcher, _ = load_batcher(build_parser().parse_args([str(model_dir), "--dtype", "auto", "--num-blocks", "64"]))
        with batcher:
            assert batcher.model.dtype == torch.float32
            assert len(batcher.generate([[5, 6, 7]], max_new_tokens=4, min_new_tokens=4)[0]) == 4
    finally:
        monkeypatch.delenv(CAPABILITY_ENV)
        clear_probes()


def test_a_configuration_that_fails_every_request_stops_the_server_at_start(servers):
    refused = servers["refused"]  # only its process and its stderr: it must exit, never healthy
    with pytest.raises(ServerDidNotStart) as failure:
        wait_for_start(refused.process, refused.log, lambda: healthy(refused.url))
    assert failure.value.reason == "exited" and refused.process.returncode != 0, failure.value
    stderr = refused.log.read_text()
    assert "cannot answer a request as configured (--dtype bfloat16, --device cpu)" in stderr
    assert "no bfloat16 attention kernel on this CPU" in stderr
    assert "ready to serve" not in stderr
