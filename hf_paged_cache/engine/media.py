"""Image inputs of a request in a continuous batcher: the processor's tensors, where the images sit in the prompt,
and the keys the prompt's blocks are found by.

An image-text model (LLaVA, Gemma 3, SmolVLM, ...) reads an image through placeholder tokens in its prompt, one
run of the model's image token per image, which its processor expands and fills with the image's patches in
the forward. So a request that carries images:

- is prefilled in one chunk from its first image on (the forward that reads the pixels needs every placeholder
  of them), which runs apart from other requests' chunks (one packed sequence takes no pixels);
- keys its blocks by its prompt with each image's placeholders replaced by ids drawn from a digest of that image
  (`MediaInput.key_ids`): the placeholders are the same for every image, the digests are not, so the same image
  in a follow-up turn finds the blocks that hold it and another image does not;
- starts from a cached prefix only where it covers all of its images or none of them: a prefix that ends inside
  the images would leave pixels for placeholders that are not computed (`MediaInput.reusable`).

Images for models that place image tokens by 3-D positions (Qwen2-VL's M-RoPE) are refused: the batcher gives
each token one position.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel


@dataclass(frozen=True)
class MediaInput:
    """A request's images: the processor's tensors and where they sit in its prompt."""

    inputs: Mapping[str, torch.Tensor]  # what the processor gave besides ids and mask: pixel_values [n, 3, H, W], ...
    spans: tuple[tuple[int, int], ...]  # per image, its placeholders' [start, end) in the prompt
    key_ids: tuple[int, ...]  # the prompt's ids, each image's placeholders replaced by ids from its digest

    @property
    def start(self) -> int:
        return self.spans[0][0]

    @property
    def end(self) -> int:
        return self.spans[-1][1]

    def reusable(self, cached: int) -> int:
        """How many of `cached` prompt tokens found in the pool a request may start from: all of them when they
        hold every image or none, else those before the first image."""
        return cached if cached >= self.end or cached <= self.start else self.start

    def chunk_inputs(self, start: int, length: int) -> dict[str, torch.Tensor]:
        """The forward arguments of a chunk of `length` tokens from `start`: every tensor when the chunk reads
        the images (it starts before the first one's end), a per-token one (Gemma 3's ``token_type_ids``,
        ``[1, prompt]``) cut to the chunk; none after the images."""
        if start >= self.end:
            return {}
        prompt = len(self.key_ids)
        return {name: value[:, start : start + length] if value.ndim == 2 and value.shape == (1, prompt) else value
                for name, value in self.inputs.items()}


def media_input(
    model: PreTrainedModel, prompt: Sequence[int], inputs: Mapping[str, torch.Tensor],
    digests: Sequence[str] | None = None,
) -> MediaInput:
    """A checked `MediaInput` for `prompt` (ids in which the processor expanded each image's placeholders) and the
    processor's other outputs `inputs`; `digests` names each image (default: one digest of all of `inputs`).
    When the prompt's runs of placeholders are not one an image (images side by side, or no digests given),
    each run is keyed by all the digests and its place. `ValueError` names what does not fit."""
    if _has_3d_positions(model):
        raise ValueError(f"{type(model).__name__} places image tokens by 3-D positions (M-RoPE), which the "
                         "continuous batcher does not compute: it takes no images")
    token = _image_token(model)
    spans = _runs(prompt, token)
    if not spans:
        raise ValueError(f"the prompt has no image placeholder (token {token}) for its images")
    if digests is None:
        digest = hashlib.sha256()
        for name in sorted(inputs):
            digest.update(name.encode() + inputs[name].detach().cpu().contiguous().numpy().tobytes())
        digests = [digest.hexdigest()]
    if len(digests) != len(spans):  # images side by side make one run (LLaVA's): each run keyed by them all
        together = hashlib.sha256("/".join(digests).encode()).hexdigest()
        digests = [f"{together}{index}" for index in range(len(spans))]
    vocab = model.get_input_embeddings().num_embeddings
    key = list(prompt)
    for (start, end), digest in zip(spans, digests):
        base = vocab + int(hashlib.sha256(digest.encode()).hexdigest()[:14], 16)  # past every token id
        key[start:end] = range(base, base + end - start)
    tensors = {name: value.to(model.device, model.dtype if value.is_floating_point() else value.dtype)
               for name, value in inputs.items() if name not in ("input_ids", "attention_mask")}
    return MediaInput(tensors, tuple(spans), tuple(key))


def _image_token(model: PreTrainedModel) -> int:
    config = model.config
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise ValueError(f"{type(model).__name__} names no image token: it takes no images")
    return int(token)


def _runs(prompt: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` of each run of `token` in `prompt`."""
    runs, start = [], None
    for position, value in enumerate([*prompt, None]):
        if value == token and start is None:
            start = position
        elif value != token and start is not None:
            runs.append((start, position))
            start = None
    return runs


def _has_3d_positions(model: PreTrainedModel) -> bool:
    text = model.config.get_text_config(decoder=True)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    return isinstance(rope, Mapping) and "mrope_section" in rope
