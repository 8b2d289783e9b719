"""Tiny random-weight encoder-decoder models (T5, BART, Marian, Whisper) and their inputs, built from configs."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoModelForSpeechSeq2Seq, PreTrainedModel

VOCAB = 96
_LAYERS = dict(d_model=32, encoder_layers=2, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=2,
               encoder_ffn_dim=64, decoder_ffn_dim=64)
ENCODER_DECODER_CONFIGS = {
    # T5: relative position buckets, no positional embeddings; 4 heads of 8 in both stacks (as many decoder layers
    # as encoder layers: transformers' default cache for T5 is sized by num_layers, and fails otherwise)
    "t5": dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
    # BART: learned positions; the decoder has more layers and fewer heads than the encoder
    "bart": dict(vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                 decoder_start_token_id=2, forced_eos_token_id=None, **_LAYERS),
    # Marian: sinusoidal positions, its pad token starts the decoder
    "marian": dict(vocab_size=VOCAB, max_position_embeddings=128, pad_token_id=VOCAB - 1, eos_token_id=0,
                   decoder_start_token_id=VOCAB - 1, forced_eos_token_id=None, **_LAYERS),
    # Whisper: log-mel features in (16 bins, 32 frames: 16 encoder positions after its stride-2 convolution)
    "whisper": dict(vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16, max_target_positions=64,
                    pad_token_id=VOCAB - 1, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 2,
                    decoder_start_token_id=VOCAB - 3, begin_suppress_tokens=None, suppress_tokens=None, **_LAYERS),
}


def tiny_seq2seq(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A float32 encoder-decoder model of `model_type` with random weights, in eval mode."""
    config = AutoConfig.for_model(model_type, **ENCODER_DECODER_CONFIGS[model_type])
    torch.manual_seed(seed)
    loader = AutoModelForSpeechSeq2Seq if model_type == "whisper" else AutoModelForSeq2SeqLM
    return loader.from_config(config, dtype=torch.float32).eval()


def encoder_inputs(model_type: str, pads: list[int], length: int = 10, seed: int = 0) -> dict[str, torch.Tensor]:
    """The encoder's inputs for ``len(pads)`` requests: token ids of `length` positions, row ``b`` left-padded by
    ``pads[b]``, or, for Whisper, random log-mel features of 32 frames (a fixed length: no padding)."""
    generator = torch.Generator().manual_seed(seed)
    if model_type == "whisper":
        return {"input_features": torch.randn(len(pads), 16, 32, generator=generator)}
    ids = torch.randint(3, VOCAB - 3, (len(pads), length), generator=generator)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        mask[row, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}
