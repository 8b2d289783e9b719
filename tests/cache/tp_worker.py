"""One rank of the tensor-parallel test: loads a saved tiny Llama with ``tp_plan="auto"`` and generates.

Run by `test_tensor_parallel.py` through ``torchrun --nproc-per-node 2 tests/cache/tp_worker.py MODEL_DIR OUT_DIR``;
each rank writes its greedy tokens (a ragged batch, with DynamicCache, PagedCache, and PagedCache under
paged_sdpa storing the model's dtype and int8) and its pool's KV heads to ``OUT_DIR/rank{R}.json``.
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DynamicCache

from hf_paged_cache import PagedCache, set_paged_attention


def main(model_dir: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", dtype=torch.float32).eval()
    with open(os.path.join(model_dir, "batch.json")) as f:
        batch = json.load(f)
    inputs = {name: torch.tensor(value) for name, value in batch.items()}
    kwargs = dict(**inputs, max_new_tokens=12, do_sample=False)
    result = {"dynamic": model.generate(**kwargs, cache=DynamicCache(config=model.config)).tolist()}
    with PagedCache(model) as cache:
        result["paged"] = model.generate(**kwargs, cache=cache).tolist()
        result["kv_heads"] = [shape.num_heads for shape in cache.pool.layout.layers]
    set_paged_attention(model)
    with PagedCache(model) as cache:
        result["paged_sdpa"] = model.generate(**kwargs, cache=cache).tolist()
    with PagedCache(model, kv_dtype="int8") as cache:
        result["paged_sdpa_int8"] = model.generate(**kwargs, cache=cache).tolist()
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
