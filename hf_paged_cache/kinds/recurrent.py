"""Linear-attention, SSM and short-convolution layers: conv and recurrent states per sequence, in state slots.

Such a layer (Mamba's mixer, Qwen3-Next's gated DeltaNet, LFM2's short convolution) keeps, per sequence, the
last inputs of its causal convolution (``[channels, kernel]``) and, for linear attention and SSMs, a
recurrent state (e.g. ``[heads, key_dim, value_dim]``), whatever the sequence's length. transformers 5 maps
``linear_attention`` and ``conv`` to the same cache layer (`LinearAttentionLayer`); so does this package.
"""

from .base import LayerKind

LINEAR_ATTENTION = LayerKind("linear_attention", tokens=False, state=True)
CONV = LayerKind("conv", tokens=False, state=True)

KINDS = (LINEAR_ATTENTION, CONV)
