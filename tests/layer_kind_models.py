"""Tiny random-weight configs of the transformers model types whose layers are not only full, sliding or chunked
attention: linear attention / SSM, short convolutions, hybrid layers, layers that keep nothing (MLP-only, KV
sharing), DSA's indexed attention and DeepSeek-V4's compressed attention. Each keeps at least one layer of each
of its kinds; `tiny_model` builds them as it builds `TINY_CONFIGS`. Composite (multimodal) types take their
text part under ``text_config``, which repeats the vocabulary and token ids (the top-level ones do not reach it).

Verified with the model's own default cache (a left-padded batch of 3 rows, 16 greedy tokens); left out:
gemma3n (its vision tower needs timm), gemma4_assistant (its layers all read another model's keys and values).
"""

LAYER_KIND_CONFIGS: dict[str, dict] = {
    # --- linear_attention (SSM / gated delta net / KDA / lightning) ---
    # mamba: 2 x linear_attention (conv + ssm state)
    "mamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, state_size=8, time_step_rank=8),
    # falcon_mamba: 2 x linear_attention
    "falcon_mamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, state_size=8, time_step_rank=8),
    # mamba2: 2 x linear_attention
    "mamba2": dict(hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16, state_size=16, n_groups=1,
                   chunk_size=16, time_step_rank=8),
    # bamba: linear_attention (mamba2) + full_attention
    "bamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32,
                  mamba_d_state=16, mamba_chunk_size=16),
    # granitemoehybrid: linear_attention (mamba2) + full_attention, MoE
    "granitemoehybrid": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             shared_intermediate_size=64, layer_types=["linear_attention", "full_attention"],
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_chunk_size=16),
    # jamba: linear_attention (mamba) + full_attention, MoE on layer 1
    "jamba": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                  attn_layer_offset=1, mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False),
    # nemotron_h: linear_attention (mamba2) + dummy (moe) + full_attention + dummy (mlp)
    "nemotron_h": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=1,
                       chunk_size=16, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       moe_shared_expert_intermediate_size=32,
                       layers_block_type=["linear_attention", "moe", "full_attention", "mlp"]),
    # qwen3_next: linear_attention (gated delta net) + full_attention, MoE
    "qwen3_next": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                       linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                       layer_types=["linear_attention", "full_attention"]),
    # qwen3_5_text: linear_attention + full_attention
    "qwen3_5_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
                         linear_num_key_heads=2, linear_num_value_heads=4,
                         layer_types=["linear_attention", "full_attention"]),
    # qwen3_5 (composite, Qwen3_5ForCausalLM): linear_attention + full_attention
    "qwen3_5": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                                     linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"],
                                     vocab_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                     eos_token_id=None)),
    # qwen3_5_moe_text: linear_attention + full_attention, MoE
    "qwen3_5_moe_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             num_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"]),
    # olmo_hybrid: linear_attention (gated delta net) + full_attention
    "olmo_hybrid": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, linear_num_key_heads=4, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"]),
    # lara_mini: linear_attention + sliding_attention + full_attention, MoE
    "lara_mini": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                      linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                      num_experts=4, num_experts_per_tok=2, sliding_window=8,
                      layer_types=["linear_attention", "sliding_attention", "full_attention"]),
    # kimi_linear: linear_attention (KDA) + full_attention (MLA), dense then MoE
    "kimi_linear": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, head_dim=16, q_lora_rank=None,
                        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4,
                        num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
                        linear_head_dim=16, linear_num_heads=4, layer_types=["linear_attention", "full_attention"],
                        mlp_layer_types=["dense", "sparse"]),
    # bailing_hybrid: linear_attention + full_attention (MLA), dense then MoE (layer_group_size=2)
    "bailing_hybrid": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                           qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, num_experts=4,
                           num_experts_per_token=2, num_shared_experts=1, num_expert_group=1, topk_group=1,
                           first_k_dense_replace=1, layer_group_size=2, num_nextn_predict_layers=0),
    # minimax: linear_attention (lightning) + full_attention, MoE -- uses its own MiniMaxCache
    "minimax": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, block_size=8,
                    layer_types=["linear_attention", "full_attention"]),
    # recurrent_gemma: linear_attention (RG-LRU) + sliding_attention -- recurrent state lives on the modules
    "recurrent_gemma": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, lru_width=64, attention_window_size=8,
                            block_types=["recurrent", "attention"]),
    # --- conv ---
    # lfm2: conv + full_attention
    "lfm2": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, full_attn_idxs=[1], block_auto_adjust_ff_dim=False),
    # lfm2_moe: conv + full_attention + conv, dense then MoE
    "lfm2_moe": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4,
                     num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv"]),
    # lfm3: conv + sliding_attention + full_attention
    "lfm3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, sliding_window=8,
                 layer_types=["conv", "sliding_attention", "full_attention"]),
    # --- hybrid / hybrid_sliding (one layer holds linear state AND attention KV) ---
    # falcon_h1: 2 x hybrid (parallel mamba2 + attention)
    "falcon_h1": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                      mamba_d_state=16, mamba_chunk_size=16),
    # zamba: linear_attention + hybrid + linear_attention + hybrid (two hybrids needed: shared-block weight tying)
    "zamba": dict(hidden_size=64, attention_hidden_size=128, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, attention_head_dim=32, num_key_value_heads=4, n_mamba_heads=2,
                  mamba_d_state=8, mamba_dt_rank=8, use_mamba_kernels=False,
                  layers_block_type=["linear_attention", "hybrid", "linear_attention", "hybrid"]),
    # zamba2: linear_attention + hybrid + linear_attention
    "zamba2": dict(hidden_size=64, num_hidden_layers=3, intermediate_size=128, num_attention_heads=4,
                   num_key_value_heads=4, mamba_d_state=16, n_mamba_heads=4, chunk_size=16, use_mamba_kernels=False,
                   layers_block_type=["linear_attention", "hybrid", "linear_attention"]),
    # zaya: hybrid_sliding + hybrid (CCA: conv + recurrent state + KV), MoE
    "zaya": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=32, num_experts=4, num_experts_per_tok=1, router_hidden_size=16,
                 sliding_window=8, layer_types=["hybrid_sliding", "hybrid"]),
    # inkling_text: hybrid_sliding + hybrid (4 conv states per layer, no recurrent state), dense then MoE
    "inkling_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                         swa_head_dim=16, sliding_window_size=8, rel_extent=64, moe_intermediate_size=32,
                         n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                         layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "sparse"]),
    # inkling2_text: hybrid_sliding + hybrid, MoE
    "inkling2_text": dict(hidden_size=64, unpadded_vocab_size=96, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2,
                          swa_head_dim=16, sliding_window_size=8, rel_extent=64, moe_intermediate_size=32,
                          n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
                          layer_types=["hybrid_sliding", "hybrid"]),
    # inkling2_loop_text: hybrid_sliding/hybrid x2, layers 1-2 looped twice
    "inkling2_loop_text": dict(hidden_size=64, unpadded_vocab_size=96, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, swa_num_attention_heads=4,
                               swa_num_key_value_heads=2, swa_head_dim=16, sliding_window_size=8, rel_extent=64,
                               moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
                               n_layers_per_attn_res_block=1, loop_layer_index_start=1, loop_layer_index_end=3,
                               loop_num_passes=2, loop_gate_rank=8,
                               layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"]),
    # --- dummy (KV-shared consumer layers) ---
    # gemma3n_text: sliding + full + dummy + dummy (last 2 layers reuse KV)
    "gemma3n_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, sliding_window=8, vocab_size_per_layer_input=96,
                         hidden_size_per_layer_input=8, num_kv_shared_layers=2, laurel_rank=8, altup_num_inputs=2,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                         activation_sparsity_pattern=[0.95, 0.0, 0.0, 0.0]),
    # gemma4_text: sliding + full + dummy + dummy
    "gemma4_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, num_kv_shared_layers=2,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]),
    # gemma4 (composite, Gemma4ForConditionalGeneration, tiny vision tower): sliding + full + dummy + dummy
    "gemma4": dict(text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
                                    sliding_window=8, hidden_size_per_layer_input=8, vocab_size_per_layer_input=96,
                                    num_kv_shared_layers=2,
                                    layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                                 "full_attention"],
                                    vocab_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
                                    eos_token_id=None),
                   vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, head_dim=16),
                   audio_config=None),
    # gemma4_unified_text: sliding + full + dummy + dummy
    "gemma4_unified_text": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=8,
                                num_kv_shared_layers=2,
                                layer_types=["sliding_attention", "full_attention", "sliding_attention",
                                             "full_attention"]),
    # --- indexed_attention (MLA + sparse top-k indexer with its own key cache) ---
    # deepseek_v32: 2 x indexed_attention (index_topk=8 < 28 tokens, so the selection really is sparse)
    "deepseek_v32": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                         qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                         num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                         first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=2),
    # glm_moe_dsa: 2 x indexed_attention (layer 1 reuses layer 0's top-k: indexer_types full/shared)
    "glm_moe_dsa": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
                        first_k_dense_replace=1, index_topk=8, index_head_dim=16, index_n_heads=2,
                        indexer_types=["full", "shared"]),
    # axk2: 2 x indexed_attention
    "axk2": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
                 qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 n_group=1, topk_group=1, index_topk=8, index_head_dim=16, index_n_heads=2, gated_norm_rank=4),
    # hy_v4: 2 x indexed_attention (indexer_types full/shared), hyper-connections
    "hy_v4": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=4, head_dim=16, q_lora_rank=32, kv_lora_rank=16,
                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                  n_shared_experts=1, index_topk=8, index_head_dim=16, index_n_heads=2, hc_mult=2,
                  indexer_types=["full", "shared"]),
    # dots3_note_text: indexed_attention + sliding_attention
    "dots3_note_text": dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=4, head_dim=8, q_lora_rank=32,
                            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                            shared_experts_intermediate_size=32, index_topk=8, index_head_dim=16, index_n_heads=2,
                            sliding_window=8, layer_types=["indexed_attention", "sliding_attention"]),
    # qwen4_exp_text: linear_attention + indexed_attention (QSA indexer), hyper-connections, MoE
    "qwen4_exp_text": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                           num_experts=4, num_experts_per_tok=2, hc_count=2, hc_lowrank=8, indexer_n_heads=2,
                           indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8, indexer_compress_ratio=2,
                           layer_types=["linear_attention", "indexed_attention"]),
    # --- DeepSeek-V4 compressed attention (model-defined cache layer classes) ---
    # deepseek_v4: heavily_compressed + compressed_sparse + heavily_compressed (rates 8 / 4, window 8)
    "deepseek_v4": dict(hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=32, q_lora_rank=32, qk_rope_head_dim=8,
                        num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, sliding_window=8, o_groups=2,
                        o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=4, num_nextn_predict_layers=0,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                        hc_mult=2, hc_sinkhorn_iters=3,
                        layer_types=["heavily_compressed_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"]),
}
