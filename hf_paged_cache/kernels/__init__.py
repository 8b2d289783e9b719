"""Faster kernels for the model around the cache: opt-in transformations of a loaded model, and the probes that
say which of them this CPU runs."""

from .cpu_capability import CpuCapability, cpu_capability
from .int4_linear import Int4Linear
from .int8_linear import Int8Linear
from .linear_timing import PackedShape, pack_timed, time_linear_shapes
from .mkl_dispatch import mkl_takes_fast_path
from .packed_linear import PackedLinear, Probe, pack_linears, packed_linears_supported, packing_probe
from .quantize import QUANTIZE_CHOICES, quantize_by_name, quantize_weights

__all__ = [
    "QUANTIZE_CHOICES",
    "CpuCapability",
    "Int4Linear",
    "Int8Linear",
    "PackedLinear",
    "PackedShape",
    "Probe",
    "cpu_capability",
    "mkl_takes_fast_path",
    "pack_linears",
    "pack_timed",
    "packed_linears_supported",
    "packing_probe",
    "quantize_by_name",
    "quantize_weights",
    "time_linear_shapes",
]
