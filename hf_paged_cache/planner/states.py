"""One sequence's conv / recurrent state bytes from a model's config alone.

A state's shape is the model code's, not the config's, so the planner measures it as `PagedCache(model,
max_memory=...)` does (`cache.state_probe`): one forward of one token through a `DynamicCache`. Here the model is
built on the meta device, which allocates nothing and needs no weights, so a model of any size plans in a second.
Its experts (MoE layers) run as ``batched_mm``, which routes without the data-dependent ``nonzero`` of the eager
loop, which the meta device cannot run; a state's shape does not depend on the experts.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig

from ..cache.state_probe import state_bytes_per_sequence


def state_bytes_from_config(config: PreTrainedConfig, dtype: torch.dtype) -> int:
    """Bytes of one sequence's conv and recurrent states over every layer of the model `config` describes, its
    weights in `dtype`. Raises `NotImplementedError`, naming the model type, if its forward cannot run on the
    meta device (then pass ``state_bytes=``, e.g. ``PagedCache(model).pool.states.bytes_per_slot()`` after a
    forward)."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, experts_implementation="batched_mm").eval()
        return state_bytes_per_sequence(model)
    except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
        raise NotImplementedError(
            f"could not measure the conv / recurrent states of {config.model_type!r} from its config (a forward on "
            f"the meta device failed: {type(error).__name__}: {error}); pass state_bytes= (--state-bytes), one "
            "sequence's state bytes"
        ) from error
