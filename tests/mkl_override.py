"""MKL's vendor check seen from a fresh process, and the preloadable library that makes it pass
(docs/serving.md, "MKL on AMD CPUs")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged_cache.kernels import mkl_dispatch

REPORT = "from hf_paged_cache.kernels import mkl_takes_fast_path; print(mkl_takes_fast_path())"


def report_in_a_fresh_process(preload: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | ({"LD_PRELOAD": preload} if preload else {})
    done = subprocess.run([sys.executable, "-c", REPORT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def build_override(folder: Path) -> Path:
    """The library of docs/serving.md ("MKL on AMD CPUs") whose MKL vendor check always passes, built in `folder` (skips without a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the override with")
    source = folder / "mkl_any_cpu.c"
    source.write_text(f"int {mkl_dispatch.VENDOR_CHECK}(void) {{ return 1; }}\n")
    library = folder / "libmkl_any_cpu.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=120)
    return library
