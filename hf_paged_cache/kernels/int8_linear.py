"""`Int8Linear`: weight-only int8 linear layers on a CPU, llama.cpp's Q8_0 trade in PyTorch's own kernel.

`Int8Linear` keeps a linear layer's weight as int8 codes with one scale per output channel (symmetric:
``weight ~= codes * scale``, ``|codes| <= 127``): a quarter of float32's bytes. Its product is ATen's
``_weight_int8pack_mm``, which reads the int8 codes and multiplies in bfloat16: the activations are rounded
to bfloat16 on the way in (the output goes back to their dtype). The keys and values the model computes go to
the cache as they come: the cache stays exact for this model, which is not the float32 one.

Where it pays, measured on a 2-core AMD EPYC with AVX-512 BF16 against the float32 layers packed for oneDNN
(`pack_linears`): products of 1 to 4 rows (one client's decode steps: reading the weights is the cost) take
0.3x to 0.9x the time (SmolLM2-135M's ``[49152, 576]`` output head at one row 1.4 ms against 5.3 ms), and
products of 16 rows or more 1.1x to 2.9x (prompts and batches: the kernel does not block for many rows).
CPUs without bfloat16 instructions compute it slower still. So it is a laptop's option, for memory and one
client's speed: ``quantize_weights(model)`` (`hf_paged_cache.kernels.quantize`) in Python, ``serve --quantize
int8`` on the server (the output head kept in float; ``int8-all`` quantizes it too).
"""

from __future__ import annotations

import torch
from torch import nn


class Int8Linear(nn.Module):
    """A linear layer whose weight is int8 codes and a bfloat16 scale per output channel (see the module
    docstring); built from an `nn.Linear`, whose bias it keeps."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [N, K]
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.bfloat16).tiny)  # [N]
        scale = scale.to(torch.bfloat16)  # the codes are made against the rounded scale: codes * scale is exact
        codes = torch.round(weight / scale.float().unsqueeze(1)).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("codes", codes)
        self.register_buffer("scale", scale)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)  # [M, K]
        out = torch.ops.aten._weight_int8pack_mm(rows, self.codes, self.scale)  # [M, N] bfloat16
        out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        """``[N, K]`` float32: the weight the codes stand for."""
        return self.codes.float() * self.scale.float().unsqueeze(1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
