"""Chat messages with images, for an image-text model (LLaVA, Gemma 3, SmolVLM, ...): what the model's processor
makes of the rendered chat and the messages' pictures, knowing nothing of HTTP.

The chat template renders each ``image_url`` part as the model's image placeholder (the parts reach it as
``{"type": "image"}``, as transformers' processors take them); the processor then expands each placeholder
into the image's tokens and computes the pixels the model reads (`images.load_images` decoded and checked the
pictures first). The request goes to the batcher with those tensors and a digest of each picture, which keys
the blocks that hold it (`engine.media`): the same image in a follow-up turn is a prefix hit, another is not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .images import ImageLimits, load_images


class ImagePrompts:
    """Turns rendered chats and their image URLs into a request's token ids and image inputs, with the model's
    `processor` (an ``AutoProcessor``), under `limits`."""

    def __init__(self, processor: Any, limits: ImageLimits):
        self.processor = processor
        self.limits = limits

    def inputs(self, text: str, urls: Sequence[str]) -> tuple[list[int], dict[str, Any]]:
        """The token ids of the rendered chat `text` (its placeholders expanded) and the `submit` arguments of its
        images (``multimodal_inputs``, ``image_digests``). `ImageError` (a `ValueError`) names a refused image."""
        images = load_images(urls, self.limits)
        out = self.processor(text=[text], images=[image.image for image in images], return_tensors="pt",
                             add_special_tokens=False)  # the template writes the special tokens it wants
        # the batcher takes the processor's outputs besides the ids and mask (`engine.media.media_input`)
        arguments = {"multimodal_inputs": dict(out), "image_digests": [image.digest for image in images]}
        return out["input_ids"][0].tolist(), arguments
