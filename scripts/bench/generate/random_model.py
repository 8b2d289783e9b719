"""Save a model with a real model's dimensions and random weights, for benchmarks of architectures whose
weights this machine does not have (no download): speed and memory depend on the shapes, not the weights.

The tokenizer saved beside it is the tests' character tokenizer (its ids are a few of the model's vocabulary):
benchmarks feed random token ids anyway. Presets (each from the real model's ``config.json``):

- ``lfm2-350m``: LiquidAI/LFM2-350M (354M parameters): 16 layers, 10 short-convolution and 6 attention layers
  (8 KV heads of 64), hidden 1024, vocabulary 65,536.

Command (the model of docs/benchmarks.md's hybrid rows)::

    python scripts/bench/generate/random_model.py lfm2-350m /tmp/lfm2-350m-random
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

CHAR_TOKENIZER = Path(__file__).resolve().parents[3] / "tests" / "data" / "char_tokenizer"
PRESETS = {
    "lfm2-350m": ("lfm2", dict(
        hidden_size=1024, intermediate_size=6656, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
        block_multiple_of=256, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=8, conv_L_cache=3,
        full_attn_idxs=[2, 5, 8, 10, 12, 14], vocab_size=65536, max_position_embeddings=128000,
    )),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset", choices=sorted(PRESETS))
    parser.add_argument("path", type=Path, help="where to save it")
    parser.add_argument("--seed", type=int, default=0, help="of the random weights (default: 0)")
    args = parser.parse_args(argv)
    model_type, dims = PRESETS[args.preset]
    config = AutoConfig.for_model(model_type, pad_token_id=0, bos_token_id=1, eos_token_id=7, **dims)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(args.path)
    AutoTokenizer.from_pretrained(CHAR_TOKENIZER).save_pretrained(args.path)
    print(f"{args.preset}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, layers "
          f"{config.layer_types}, saved to {args.path}")


if __name__ == "__main__":
    main()
