"""What this CPU, and this PyTorch build, can run: asked once, never assumed.

The package's CPU fast paths each depend on something a CPU may lack: `PackedLinear`'s oneDNN products in
bfloat16 need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, `--dtype auto` picks bfloat16 only where the CPU
multiplies it natively (AVX512-BF16 or AMX), `paged_flex`'s kernel needs a C++ compiler. Each path asks here (or
tries its operator once on a tiny tensor) and falls back to PyTorch's stock path where the answer is no, with
one log line that names the reason.

`cpu_capability` reads the CPU's level from PyTorch's own probes (``torch.cpu._is_*_supported``, which read
cpuinfo) as one of `LEVELS`. The environment variable ``HF_PAGED_CACHE_CPU_CAPABILITY`` (one of `LEVELS`) caps
it: ``HF_PAGED_CACHE_CPU_CAPABILITY=avx2`` makes every probe of this package answer as on an AVX2-only CPU, so
that the fallbacks can be run and tested on any machine. It lowers only this package's choices; PyTorch's own
kernels follow ``ATEN_CPU_CAPABILITY`` and oneDNN's ``ONEDNN_MAX_CPU_ISA`` (``docs/cpu-support.md``).

Answers are cached for the life of the process (the CPU does not change); tests that change the environment
variable clear the caches (``cpu_capability.cache_clear()``, and the probes' own).
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

CAPABILITY_ENV = "HF_PAGED_CACHE_CPU_CAPABILITY"
LEVELS = ("default", "avx2", "avx512", "avx512_bf16", "amx")
"""x86 capability levels, each including the ones before it: ``default`` (none of the others, or not x86),
``avx2``, ``avx512`` (F, BW, VL, DQ), ``avx512_bf16`` (adds native bfloat16 products), ``amx`` (tile matrix
units, with AMX-BF16)."""
BFLOAT16_PACKING_LEVEL = "avx512"
"""oneDNN's bfloat16 linear path in PyTorch needs AVX-512 BW/VL/DQ (or AVX-NE-CONVERT, which PyTorch's probes
do not report; such a CPU is rated ``avx2`` here and keeps the stock kernels)."""
NATIVE_BFLOAT16_LEVEL = "avx512_bf16"
"""From here on the CPU multiplies bfloat16 in hardware; below, bfloat16 products are emulated in float32."""


@dataclass(frozen=True)
class CpuCapability:
    """The capability level this process uses, what the CPU reports, and why they differ."""

    level: str  # the level the package's probes answer for: `detected`, or lower where capped
    detected: str  # the level the CPU reports through PyTorch's probes
    capped_by: str | None  # "HF_PAGED_CACHE_CPU_CAPABILITY=avx2" when that lowered `level`, else None
    torch_isa: str  # the vector ISA PyTorch's own kernels dispatch to (torch.backends.cpu.get_cpu_capability())
    machine: str  # platform.machine(): x86_64, aarch64, ...

    def at_least(self, level: str) -> bool:
        """Whether `level` (one of `LEVELS`) is within this process's capability."""
        return LEVELS.index(self.level) >= LEVELS.index(_known_level(level))

    def describe(self) -> str:
        """One line: ``"avx2 (the CPU reports amx; capped by HF_PAGED_CACHE_CPU_CAPABILITY=avx2)"``."""
        if self.capped_by is None:
            return self.level
        return f"{self.level} (the CPU reports {self.detected}; capped by {self.capped_by})"


@functools.cache
def cpu_capability() -> CpuCapability:
    """This process's CPU capability (cached): the CPU's level, capped by ``HF_PAGED_CACHE_CPU_CAPABILITY``.

    Raises:
        ValueError: when the environment variable names no level of `LEVELS`.
    """
    detected = _detected_level()
    level, capped_by = detected, None
    cap = os.environ.get(CAPABILITY_ENV, "").strip().lower()
    if cap:
        cap = _known_level(cap, source=CAPABILITY_ENV)
        if LEVELS.index(cap) < LEVELS.index(detected):
            level, capped_by = cap, f"{CAPABILITY_ENV}={cap}"
    return CpuCapability(level, detected, capped_by, torch.backends.cpu.get_cpu_capability(), platform.machine())


def cpu_model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _detected_level() -> str:
    cpu = torch.cpu
    probes = (
        ("amx", "_is_amx_tile_supported"),
        ("avx512_bf16", "_is_avx512_bf16_supported"),
        ("avx512", "_is_avx512_supported"),
        ("avx2", "_is_avx2_supported"),
    )
    for level, probe in probes:  # from the highest: the first the CPU has is its level
        check = getattr(cpu, probe, None)
        if check is not None and check():
            return level
    return "default"


def _known_level(level: str, source: str = "level") -> str:
    if level not in LEVELS:
        raise ValueError(f"{source} must be one of {', '.join(LEVELS)}; got {level!r}")
    return level
