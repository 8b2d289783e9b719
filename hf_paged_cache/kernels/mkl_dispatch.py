"""`mkl_takes_fast_path`: whether MKL, which PyTorch's x86 CPU wheels link, runs its fast kernels on this CPU.

MKL chooses its kernels by the CPU's vendor: on x86 CPUs of other vendors (AMD) it passes over the kernels it
would run on an Intel CPU with the same instruction sets, for slower ones. PyTorch sends some of its CPU matrix
products to MKL: ``F.linear`` and ``bmm`` in float32, and the blocks of SDPA's CPU kernels in float32 and
bfloat16. Measured on a 2-core AMD EPYC with AVX-512 and AVX512-BF16 (``scripts/bench/cpu/bench_mkl_dispatch.py``, two
threads), without and with the check passed: a float32 ``F.linear`` of 484 tokens by a ``[1536, 576]`` weight
in 4.4 against 2.0 ms, SDPA's causal attention of a 484-token prompt (SmolLM2-135M's heads) in 3.4 against
2.1 ms in float32 and 3.4 against 1.2 ms in bfloat16. (`PackedLinear` multiplies through oneDNN, which is fast
on either vendor.)

PyTorch's maintainers give the workaround for AMD CPUs: preload a library whose ``mkl_serv_intel_cpu_true``
returns 1 (docs/serving.md, "MKL on AMD CPUs", builds one and serves with it). This module only reports which way
MKL will go; it changes nothing.
"""

from __future__ import annotations

import ctypes
import os

import torch

VENDOR_CHECK = "mkl_serv_intel_cpu_true"
"""MKL's test for an Intel CPU: nonzero when it may run its Intel kernels."""


def mkl_takes_fast_path() -> bool | None:
    """True when MKL's vendor check passes in this process (an Intel CPU, or the check overridden by a
    preloaded library), False when it fails (MKL runs slower kernels), None when this PyTorch has no MKL or
    the check cannot be found (a build that names it differently)."""
    if not torch.backends.mkl.is_available():
        return None
    # MKL's own calls resolve the check through the global scope first (where a preloaded library sits),
    # then in PyTorch's library, which carries MKL statically linked
    for library in (None, _libtorch_cpu()):
        try:
            check = getattr(ctypes.CDLL(library), VENDOR_CHECK)
        except (AttributeError, OSError, TypeError):  # not there; no such library; no global scope (Windows)
            continue
        check.restype = ctypes.c_int
        return check() != 0
    return None


def _libtorch_cpu() -> str:
    return os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
