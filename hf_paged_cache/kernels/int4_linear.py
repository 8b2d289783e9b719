"""`Int4Linear`: weight-only 4-bit linear layers on a CPU, llama.cpp's Q4_1 trade in PyTorch's own kernel.

The weight is cut, along each output channel, into groups of `group_size` inputs (32 by default, as llama.cpp's
Q4 formats); each group keeps 4-bit codes ``q`` in 0..15 and two bfloat16 numbers, a step and a midpoint:
``weight ~= (q - 8) * step + midpoint`` (asymmetric: the group's minimum and maximum are both codes). That is
an eighth of float32's bytes for the codes, plus 4 bytes a group (0.625 bytes a weight at groups of 32).

The product is ATen's ``_weight_int4pack_mm_for_cpu`` on the codes packed once
(``_convert_weight_to_int4pack_for_cpu``). Its fast path multiplies bfloat16 activations (rounded on the way
in; the output goes back to their dtype); on float32 activations the same kernel ran 10x to 70x slower on a
2-core AMD EPYC, so they are never sent as float32. The kernel takes output widths that are multiples of 16
(narrower remainders are padded with zero codes and cut off the output) and input widths that are multiples of
the group size (`fits` says which).

Measured on a 2-core AMD EPYC with AVX-512 BF16 against float32 packed for oneDNN, one row: the
``[1536, 576]`` product in 29 us against 75 (int8: 52), SmolLM2-135M's ``[49152, 576]`` output head in 0.82 ms
against 5.7 (int8: 2.3); at 16 rows about float32's time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

GROUP_SIZE = 32
"""Inputs that share a step and a midpoint, by default."""
N_MULTIPLE = 16
"""The kernel's output widths are multiples of this."""


def fits(linear: nn.Linear, group_size: int = GROUP_SIZE) -> bool:
    """Whether `linear`'s input width is a whole number of groups (what the kernel needs)."""
    return linear.in_features % group_size == 0


class Int4Linear(nn.Module):
    """A linear layer whose weight is 4-bit codes with a bfloat16 step and midpoint per group of `group_size`
    inputs (see the module docstring); built from an `nn.Linear` whose input width `fits`, keeping its bias."""

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE):
        super().__init__()
        if not fits(linear, group_size):
            raise ValueError(f"Int4Linear needs an input width that is a multiple of the group size {group_size}, "
                             f"got {linear.in_features}")
        self.in_features, self.out_features, self.group_size = linear.in_features, linear.out_features, group_size
        padded = -(-self.out_features // N_MULTIPLE) * N_MULTIPLE
        weight = F.pad(linear.weight.detach().float(), (0, 0, 0, padded - self.out_features))  # [N', K]
        groups = weight.view(padded, -1, group_size)  # [N', K/g, g]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)  # [N', K/g]
        step = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny).to(torch.bfloat16)
        midpoint = (low + 8 * step.float()).to(torch.bfloat16)  # code 8 stands for it
        # the codes are made against the rounded step and midpoint: (q - 8) * step + midpoint is what they read
        codes = (groups - midpoint.float().unsqueeze(-1)) / step.float().unsqueeze(-1) + 8  # [N', K/g, g]
        codes = codes.round().clamp(0, 15).to(torch.int32).view(padded, -1)  # [N', K]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1))  # [N', K/2]
        pairs = torch.stack([step, midpoint], dim=-1)  # [N', K/g, 2]
        self.register_buffer("steps_and_midpoints", pairs.transpose(0, 1).contiguous())  # [K/g, N', 2], the kernel's
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        out = self._product(rows)[:, : self.out_features].to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight as the kernel reads it (its product with the identity: bfloat16-rounded)."""
        identity = torch.eye(self.in_features, dtype=torch.bfloat16, device=self.packed.device)  # [K, K]
        columns = self._product(identity)  # [K, N'] bfloat16: row k is the weight's column k
        return columns[:, : self.out_features].T.float().contiguous()

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        """``[M, N']`` bfloat16: bfloat16 `rows` ``[M, K]`` times the weight the codes stand for (padding included)."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.steps_and_midpoints)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, "
                f"bias={self.bias is not None}")
