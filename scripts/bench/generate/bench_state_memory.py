"""Per-sequence memory of a model with conv / recurrent states: PagedCache, DynamicCache and vLLM's page-size rule.

Shapes are measured, not assumed: one forward of one token through a ``DynamicCache`` gives every state layer's
conv and recurrent states (``[1, ...]``: one sequence's), and `KVLayout` every attention layer's bytes per token.

- ``--preset qwen3-next-80b``: Qwen3-Next-80B-A3B's dims (hidden 2048; gated DeltaNet with 16 key and 32 value
  heads of 128, conv kernel 4; attention with 2 KV heads of 256), random weights, bfloat16, but 4 layers (3 linear,
  1 full) and 8 experts instead of 48 layers and 512 experts: a state's shape depends on neither, so the per-layer
  bytes are counted for the real model's 36 linear-attention and 12 full-attention layers.
- ``--model PATH``: a saved model itself (e.g. a random LFM2-350M-shaped one), every layer measured. Then the
  per-sequence bytes of PagedCache are also proven by running: ``generate`` on ``--prove-rows`` rows of
  ``--prove-tokens`` tokens, whose ``stats().bytes_reserved`` must equal the formula below.

Per sequence of ``L`` tokens, with ``S`` its states' bytes (every state layer) and ``K`` the keys' and values'
bytes of one token (every attention layer):

- PagedCache: ``S + ceil(L / 16) x 16 x K`` (one state slot; blocks of 16 tokens, padding takes none);
- DynamicCache: ``S + L x K`` for a sequence alone; in a left-padded batch every row holds the longest row's
  length, so ``S + L_max x K``;
- vLLM (v1's hybrid KV cache manager; the rule of ``HybridAttentionMambaModelConfig.verify_and_update_config`` in
  ``vllm/model_executor/models/config.py``, vLLM issue 40696): every layer's page has one size, so the attention
  block size is raised to ``B = 16 x ceil(P_state / (16 x k))``, ``P_state`` one layer's state bytes and ``k``
  one attention layer's bytes per token, and each state page is padded to ``B x k``; a sequence holds one page
  per state layer and ``ceil(L / B)`` pages per attention layer (prefix caching off).

The sequences a budget holds: ``budget // per-sequence bytes``, for sequences of equal length.

Commands (the runs reported in docs/benchmarks.md)::

    python scripts/bench/generate/bench_state_memory.py --preset qwen3-next-80b --out results/bench_state_memory_qwen3_next.json
    python scripts/bench/generate/bench_state_memory.py --model /tmp/lfm2-350m-random --dtype bfloat16 \
        --out results/bench_state_memory_lfm2.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PreTrainedModel
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from hf_paged_cache import KVLayout, PagedCache, parse_memory
from hf_paged_cache.pool import format_memory
from hf_paged_cache.bench import machine_info

BLOCK = 16  # PagedCache's block size, and vLLM's kernel block alignment
QWEN3_NEXT_80B = dict(  # Qwen/Qwen3-Next-80B-A3B-Instruct's config.json, but 4 layers and 8 experts (see above)
    hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
    intermediate_size=5120, moe_intermediate_size=512, shared_expert_intermediate_size=512, num_experts=8,
    num_experts_per_tok=2, vocab_size=151936, max_position_embeddings=262144, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)
REAL_LAYERS = {"qwen3-next-80b": {"linear_attention": 36, "full_attention": 12}}


def layer_bytes(model: PreTrainedModel) -> tuple[list[int], list[int]]:
    """Per state layer, one sequence's state bytes; per attention layer, one token's key and value bytes."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 1, dtype=torch.long), cache=cache, use_cache=True)
    states = []
    for layer in cache.layers:
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            tensors = [t for t in (*layer.conv_states.values(), *layer.recurrent_states.values()) if t is not None]
            states.append(sum(t[0].numel() * t.element_size() for t in tensors))
    layout = KVLayout.from_config(model.config)
    element = torch.finfo(model.dtype).bits // 8
    tokens = [s.num_heads * (s.key_dim + s.value_dim) * element for i, s in enumerate(layout.layers)
              if i in layout.token_layers]
    return states, tokens


def per_sequence(states: list[int], tokens: list[int], length: int) -> dict[str, int]:
    """Bytes one sequence of `length` tokens holds in each cache (see the module docstring)."""
    state, token = sum(states), sum(tokens)
    paged = state + math.ceil(length / BLOCK) * BLOCK * token
    dynamic = state + length * token
    vllm_block = max(BLOCK * math.ceil(max(states, default=0) / (BLOCK * min(tokens))), BLOCK) if tokens else BLOCK
    page = vllm_block * min(tokens) if tokens else max(states)
    vllm = len(states) * max(page, max(states, default=0)) + math.ceil(length / vllm_block) * vllm_block * token
    return {"paged": paged, "dynamic_alone": dynamic, "vllm": vllm, "vllm_block_tokens": vllm_block}


def prove(model: PreTrainedModel, states: list[int], tokens: list[int], rows: int, length: int) -> dict[str, Any]:
    """`rows` sequences of `length` prompt tokens through ``generate`` on a PagedCache: its bytes against the
    formula (the last of the new tokens is never fed back, so each row holds ``length + new - 1`` tokens)."""
    new = 4
    ids = torch.randint(2, 90, (rows, length))
    with PagedCache(model) as cache:
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache, max_new_tokens=new,
                       min_new_tokens=new, do_sample=False)
        stats = cache.stats()
    expected = rows * per_sequence(states, tokens, length + new - 1)["paged"]
    return {"rows": rows, "tokens_per_row": length + new - 1, "bytes_reserved": stats.bytes_reserved,
            "formula": expected, "equal": stats.bytes_reserved == expected}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", choices=sorted(REAL_LAYERS),
                        help="a real model's dims, random weights (default: none; this or --model)")
    source.add_argument("--model", help="a saved model's path, its every layer measured (default: none)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="(default: bfloat16)")
    parser.add_argument("--lengths", default="128,1024,8192,32768", help="sequence lengths (default: %(default)s)")
    parser.add_argument("--budget", default="8GiB", help="memory for the caches (default: %(default)s)")
    parser.add_argument("--prove-rows", type=int, default=4, help="rows of the --model proof run (default: 4)")
    parser.add_argument("--prove-tokens", type=int, default=100, help="prompt tokens of each (default: 100)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_state_memory.json"),
                        help="JSON output path (default: %(default)s)")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    if args.preset:
        config = AutoConfig.for_model("qwen3_next", **QWEN3_NEXT_80B)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
        states, tokens = layer_bytes(model)
        real = REAL_LAYERS[args.preset]
        states = states[:1] * real["linear_attention"]
        tokens = tokens[:1] * real["full_attention"]
        name = args.preset
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).eval()
        states, tokens = layer_bytes(model)
        name = args.model
    budget = parse_memory(args.budget)
    rows = []
    for length in (int(x) for x in args.lengths.split(",")):
        sizes = per_sequence(states, tokens, length)
        rows.append({"length": length, **sizes,
                     **{f"{key}_fit": budget // sizes[key] for key in ("paged", "dynamic_alone", "vllm")}})
    payload = {"benchmark": "state_memory", "model": name, "dtype": args.dtype, "state_layers": len(states),
               "attention_layers": len(tokens), "state_bytes_per_sequence": sum(states),
               "kv_bytes_per_token": sum(tokens), "budget": budget, "rows": rows, "machine": machine_info("cpu")}
    if args.model:
        payload["proof"] = prove(model, states, tokens, args.prove_rows, args.prove_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=2))
    print(f"{name} ({args.dtype}): {len(states)} state layers, {format_memory(sum(states))} of states a sequence; "
          f"{len(tokens)} attention layers, {format_memory(sum(tokens), '.4g')} a token; budget {args.budget}")
    print("| tokens | PagedCache | DynamicCache (alone) | vLLM (block of B tokens) | sequences in budget: ours / Dynamic / vLLM |")
    print("| --- | --- | --- | --- | --- |")
    for row in rows:
        print(f"| {row['length']:,} | {format_memory(row['paged'])} | {format_memory(row['dynamic_alone'])} | "
              f"{format_memory(row['vllm'])} (B = {row['vllm_block_tokens']}) | "
              f"{row['paged_fit']:,} / {row['dynamic_alone_fit']:,} / {row['vllm_fit']:,} |")
    if "proof" in payload:
        print("proof:", payload["proof"])


if __name__ == "__main__":
    main()
