"""A tiny random image-text model (LLaVA: a CLIP vision tower of 32x32 images in 16 patches, a Llama), built from
a config, for the tests of images in `generate`, the batcher and the server."""

from __future__ import annotations

import torch
from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration


def tiny_llava(image_token: int, max_positions: int = 256) -> LlavaForConditionalGeneration:
    """A float32 LLaVA (vocabulary 128) whose 16 placeholders of `image_token` stand for an image, in eval mode."""
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, projection_dim=32)
    text = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=image_token,
                         vision_feature_select_strategy="default", vision_feature_layer=-1, image_seq_length=16)
    torch.manual_seed(0)
    return LlavaForConditionalGeneration(config).eval()
