"""A model's weight bytes for the planner, in the planned dtype: from the safetensors index's ``total_size`` or a
single file's header (no tensor is read), else counted from the config on the meta device.

The config is checked against `config_limits.CONFIG_LIMITS` before a model is built from it.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedConfig

from .config_limits import check_config_dict, one_line

_SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class WeightEstimate:
    num_bytes: int
    source: str  # how the number was obtained, for the report


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``; `ValueError` for anything but a floating dtype."""
    value = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype such as 'bfloat16', got {dtype!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def weights_of_model(model: nn.Module, dtype: str | torch.dtype, source: str) -> WeightEstimate:
    """Parameters of `model` x dtype bytes (`parameters()` yields a tied weight once)."""
    params, itemsize = sum(p.numel() for p in model.parameters()), torch_dtype(dtype).itemsize
    return WeightEstimate(params * itemsize, f"{params:,} parameters x {itemsize} B, {source}")


def weights_from_config(config: PreTrainedConfig, dtype: str | torch.dtype) -> WeightEstimate:
    """Count the parameters of the model built from `config` on the meta device (no memory, no download).

    The config is first checked against `config_limits.CONFIG_LIMITS` (building takes time in proportion to
    its layers). Raises `ValueError` for a config beyond them or one transformers cannot build a model from.
    """
    check_config_dict(config.to_dict())
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError, AttributeError, RuntimeError, ArithmeticError) as error:
        raise ValueError(f"cannot build a {config.model_type} model from this config to count its parameters: "
                         f"{one_line(error)}") from None
    return weights_of_model(model, dtype, "counted on the meta device")


def weights_from_folder(folder: Path, dtype: torch.dtype, stored: torch.dtype | None) -> WeightEstimate | None:
    """Weight bytes in `dtype` from a folder's safetensors index or single file; None if it has neither.

    The index's ``metadata.total_size`` is rescaled from `stored` (the config's dtype) when known; a single
    file's header gives each tensor's size and dtype, and its floating tensors are rescaled to `dtype`.
    Raises `ValueError` for a file that cannot be read as either (cut short, not JSON, fields missing).
    """
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    try:
        return _weights_from_files(index, single, dtype, stored)
    except (OSError, ValueError, KeyError, TypeError, struct.error) as error:  # a cut or malformed file
        name = index.name if index.is_file() else single.name
        raise ValueError(f"cannot read the weight sizes from {folder / name}: {one_line(error)}") from None


def _weights_from_files(index: Path, single: Path, dtype: torch.dtype, stored: torch.dtype | None) -> WeightEstimate | None:
    """`weights_from_folder`'s reading of the index (`index`) or the single file's header (`single`)."""
    if index.is_file():
        total = int(json.loads(index.read_text())["metadata"]["total_size"])
        if stored is None or not stored.is_floating_point or stored == dtype:
            return WeightEstimate(total, f"{index.name} total_size")
        return WeightEstimate(total // stored.itemsize * dtype.itemsize,
                              f"{index.name} total_size in {dtype_name(stored)}, rescaled to {dtype_name(dtype)}")
    if not single.is_file():
        return None
    with single.open("rb") as file:  # 8-byte little-endian header length, then the JSON header
        (length,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    total, rescaled = 0, set()
    for tensor in header.values():
        size = tensor["data_offsets"][1] - tensor["data_offsets"][0]
        float_dtype = _SAFETENSORS_FLOATS.get(tensor["dtype"])  # None: not floating, kept as stored
        if float_dtype is not None and float_dtype != dtype:
            size = size // float_dtype.itemsize * dtype.itemsize
            rescaled.add(tensor["dtype"])
        total += size
    note = f", stored as {'/'.join(sorted(rescaled))}, rescaled to {dtype_name(dtype)}" if rescaled else ""
    return WeightEstimate(total, f"{single.name} header{note}")
