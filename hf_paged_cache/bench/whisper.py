"""A Whisper model of a real model's dimensions with random weights, for the transcription benchmarks (speed and
memory depend on the shapes, not the weights; no download)."""

from __future__ import annotations

import torch
from transformers import AutoConfig, WhisperForConditionalGeneration

PRESETS = {  # from openai/whisper-tiny's and openai/whisper-base's config.json
    "tiny": dict(d_model=384, encoder_layers=4, decoder_layers=4, encoder_attention_heads=6, decoder_attention_heads=6,
                 encoder_ffn_dim=1536, decoder_ffn_dim=1536),
    "base": dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8, decoder_attention_heads=8,
                 encoder_ffn_dim=2048, decoder_ffn_dim=2048),
}
EOS, START = 50257, 50258  # <|endoftext|>, <|startoftranscript|>


def random_whisper(preset: str) -> WhisperForConditionalGeneration:
    """Whisper of `preset`'s dimensions (80 mel bins, 1,500 encoder positions, 448 decoder ones), seeded random
    weights, float32, in eval mode."""
    config = AutoConfig.for_model(
        "whisper", vocab_size=51865, num_mel_bins=80, max_source_positions=1500, max_target_positions=448,
        pad_token_id=EOS, bos_token_id=EOS, eos_token_id=EOS, decoder_start_token_id=START,
        begin_suppress_tokens=None, suppress_tokens=None, **PRESETS[preset],
    )
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(config).eval()
