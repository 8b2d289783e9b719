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


_REPORTS: dict[str | None, str] = {}


def report_in_a_fresh_process(preload: str | None) -> str:
    """What `mkl_takes_fast_path` says in a new Python process, with `preload` in ``LD_PRELOAD`` (None: nothing)."""
    return reports_in_fresh_processes([preload])[preload]


def reports_in_fresh_processes(preloads: list[str | None]) -> dict[str | None, str]:
    """`report_in_a_fresh_process` of each of `preloads`, the processes run side by side.

    Each answer is asked once per session: it is the CPU's and the library's, fixed for the run."""
    runs = {}
    for preload in dict.fromkeys(preloads):
        if preload not in _REPORTS:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | (
                {"LD_PRELOAD": preload} if preload else {})
            runs[preload] = subprocess.Popen([sys.executable, "-c", REPORT], env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for preload, run in runs.items():
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, err
        _REPORTS[preload] = out.strip()
    return {preload: _REPORTS[preload] for preload in preloads}


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
