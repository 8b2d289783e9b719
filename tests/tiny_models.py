"""Tiny random-weight models of each supported architecture, built from configs (no download)."""

from __future__ import annotations

import torch
from layer_kind_models import LAYER_KIND_CONFIGS
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

VOCAB = 96
PAD = 0

# model_type -> config overrides giving 2 layers, hidden size 64 and grouped-query attention where the
# architecture has it; sliding windows are shorter than the test sequences so they really slide.
TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "mistral": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=12),
    "qwen2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2),
    "qwen3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16),
    "phi3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "gemma2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_window=12, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                        attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "opt": dict(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=64),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    # attention sinks (s_aux), mixture of experts, sliding and full layers; YaRN scaled to the tiny context
    "gpt_oss": dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, sliding_window=12, num_local_experts=4,
                    num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                     "truncate": False, "original_max_position_embeddings": 8,
                                     "rope_theta": 150000.0}),
    # multi-head latent attention: the cache holds a compressed latent that attention expands after update
    "deepseek_v3": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1),
    "cohere2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, sliding_window=12, layer_types=["sliding_attention", "full_attention"]),
    # chunked attention (3 layers in chunks of 8, stored as windows of 8), then a full-attention layer without
    # RoPE whose temperature tuning asks the cache for its length in the middle of the forward; experts
    "llama4_text": dict(hidden_size=64, intermediate_size=64, intermediate_size_mlp=128, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_chunk_size=8,
                        num_local_experts=2, num_experts_per_tok=1),
}


def tiny_config(model_type: str) -> PretrainedConfig:
    """The tiny config of `model_type` (`TINY_CONFIGS`, or `LAYER_KIND_CONFIGS` for the other layer kinds)."""
    overrides = TINY_CONFIGS[model_type] if model_type in TINY_CONFIGS else LAYER_KIND_CONFIGS[model_type]
    return AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        pad_token_id=PAD,
        bos_token_id=1,
        eos_token_id=None,
        **overrides,
    )


def tiny_model(model_type: str, attn_implementation: str | None = None, seed: int = 0) -> PreTrainedModel:
    """A float32 model of `model_type` with random weights, in eval mode."""
    config = tiny_config(model_type)
    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs).eval()


def ragged_batch(pads: list[int], length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A left-padded batch: row i has `pads[i]` padding tokens then `length - pads[i]` random tokens."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (len(pads), length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, pad in enumerate(pads):
        input_ids[row, :pad] = PAD
        attention_mask[row, :pad] = 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def tiny_tokenizer():
    """A character-level tokenizer over the tiny vocabulary: token i is the character ``chr(32 + i)``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(32 + i): i for i in range(VOCAB)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="?"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=" ", bos_token="!", unk_token="?")
