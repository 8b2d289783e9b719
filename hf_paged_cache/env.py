"""``python -m hf_paged_cache.env`` (``hf-paged-cache env``): which of the package's CPU paths this machine gets.

Like ``python -m torch.utils.collect_env`` for PyTorch: one line per path with what runs here and, where a path
falls back to PyTorch's stock kernels, why. Paste its output into a bug report. ``docs/cpu-support.md`` has the
matrix of paths by capability level.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import sys
from collections.abc import Sequence

import torch

from .heap import glibc_malloc
from .kernels import cpu_capability, mkl_takes_fast_path, packed_linears_supported, packing_probe
from .kernels.cpu_capability import CAPABILITY_ENV, cpu_model_name
from .models import fast_dtype

CXX_COMPILERS = ("g++", "c++", "clang++")
"""What inductor looks for to compile `paged_flex`'s kernel on a CPU (any one will do)."""


def cpu_report() -> list[tuple[str, str]]:
    """``(what, answer)`` pairs: the machine, its capability level, and each CPU path with what runs here."""
    capability = cpu_capability()
    compiler = next((found for name in CXX_COMPILERS if (found := shutil.which(name))), None)
    mkl = mkl_takes_fast_path()
    rows = [
        ("CPU", f"{cpu_model_name()} ({platform.machine()}, {torch.get_num_threads()} torch threads)"),
        ("capability level", capability.describe()),
        ("PyTorch's own kernels", f"{capability.torch_isa} (ATEN_CPU_CAPABILITY caps them)"),
        ("versions", f"torch {torch.__version__}, python {platform.python_version()}"),
    ]
    for dtype in (torch.float32, torch.bfloat16):
        probe = packing_probe(dtype)
        answer = "oneDNN, weights packed once" if probe.supported else f"stock kernels: {probe.reason}"
        rows.append((f"linear layers, {_name(dtype)} (pack_linears)", answer))
    rows += [
        ("--dtype auto", _name(fast_dtype("cpu"))),
        ("paged_flex decode kernel", f"compiled at first use with {compiler} (float32 only)" if compiler
         else "not available: no C++ compiler (g++, c++ or clang++); decode steps gather as paged_sdpa's"),
        ("MKL's fast kernels", {True: "yes", False: "no: MKL's vendor check fails (not an Intel CPU); see the docs",
                                None: "unknown (no MKL, or its check not found)"}[mkl]),
        ("padded heap (serve --pad-heap)", "glibc: available" if glibc_malloc() else "not glibc: malloc left as is"),
    ]
    if not packed_linears_supported():
        rows.append(("oneDNN", "this PyTorch build has none"))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-paged-cache env", description=__doc__.split("\n\n")[0],
        epilog=f"{CAPABILITY_ENV}=avx2 (or another level) reports, and runs, as on a CPU of that level.",
    )
    parser.parse_args(argv)
    rows = cpu_report()
    width = max(len(what) for what, _ in rows)
    for what, answer in rows:
        print(f"{what:<{width}}  {answer}")
    return 0


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


if __name__ == "__main__":
    sys.exit(main())
