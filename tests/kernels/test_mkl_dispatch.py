"""`hf_paged_cache.kernels.mkl_takes_fast_path`: which way MKL's vendor check goes in this process, and the
server's warning when it fails."""

from __future__ import annotations

import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from mkl_override import build_override, reports_in_fresh_processes

from hf_paged_cache.kernels import mkl_takes_fast_path

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkl.is_available() and sys.platform == "linux"), reason="needs PyTorch with MKL on Linux"
)


def cpu_vendor() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return None


@pytest.fixture(scope="module")
def override(tmp_path_factory) -> str | None:
    """The library of docs/serving.md whose MKL vendor check always passes; None without a C compiler."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        return None
    return str(build_override(tmp_path_factory.mktemp("mkl-override")))


@pytest.fixture(scope="module")
def reports(override) -> dict[str | None, str]:
    """What MKL's check says in fresh processes, without and with `override` preloaded (run side by side)."""
    return reports_in_fresh_processes([None, *([override] if override else [])])


def test_the_check_follows_the_cpu_vendor(reports):
    vendor = cpu_vendor()
    if vendor not in ("GenuineIntel", "AuthenticAMD"):
        pytest.skip(f"CPU vendor {vendor!r}")
    # a fresh process without a preloaded library: MKL's own check, on the CPU this runs on
    assert reports[None] == str(vendor == "GenuineIntel")


def test_a_preloaded_override_is_what_mkl_sees(override, reports):
    if override is None:
        pytest.skip("no C compiler to build the override with")
    assert reports[override] == "True"


def test_no_mkl_reports_none(monkeypatch):
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert mkl_takes_fast_path() is None


@pytest.mark.parametrize(("fast", "warned"), [(False, True), (True, False), (None, False)])
def test_the_server_warns_when_mkl_skips_its_fast_kernels(monkeypatch, caplog, fast, warned):
    from tiny_models import tiny_model

    from hf_paged_cache import kernels
    from hf_paged_cache.server import launch

    model = tiny_model("llama")
    monkeypatch.setattr(kernels, "mkl_takes_fast_path", lambda: fast)
    monkeypatch.setattr(launch, "_load_model", lambda options, dtype: (model, None))
    options = launch.build_parser().parse_args(["tiny", "--num-blocks", "8", "--no-packed-linears"])
    with caplog.at_level(logging.WARNING, logger="hf_paged_cache.serve"):
        batcher, _ = launch.load_batcher(options)
        batcher.close()
    assert any("MKL on AMD CPUs" in record.getMessage() for record in caplog.records) == warned
