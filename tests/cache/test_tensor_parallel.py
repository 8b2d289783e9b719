"""PagedCache under transformers' tensor parallelism: each rank caches its share of the KV heads.

Two processes (``torchrun``, gloo on CPU) load the same tiny Llama with ``tp_plan="auto"``; each rank's
tokens must match one process with DynamicCache, and its pool must hold 1 of the model's 2 KV heads.
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from tiny_models import ragged_batch, tiny_model
from transformers import DynamicCache

from hf_paged_cache import PagedCache, set_paged_attention

WORKER = Path(__file__).with_name("tp_worker.py")


def test_two_ranks_match_one_process(tmp_path):
    model = tiny_model("llama")  # 4 query heads, 2 KV heads: one per rank
    model.save_pretrained(tmp_path / "model")
    batch = ragged_batch([0, 3], 10)
    (tmp_path / "model" / "batch.json").write_text(json.dumps({k: v.tolist() for k, v in batch.items()}))
    expected = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=DynamicCache(config=model.config))
    set_paged_attention(model)
    with PagedCache(model, kv_dtype="int8") as cache:  # each rank quantizes its own heads: the same values
        expected_int8 = model.generate(**batch, max_new_tokens=12, do_sample=False, cache=cache)

    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parent)}
    # its own session, so a timeout can stop torchrun and both ranks together
    run = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER), str(tmp_path / "model"), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _, stderr = run.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise
    assert run.returncode == 0, stderr[-4000:]
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["kv_heads"] == [1, 1]  # each rank holds half of the 2 KV heads of each layer
        for name in ("dynamic", "paged", "paged_sdpa"):
            assert torch.equal(torch.tensor(result[name]), expected), name
        assert torch.equal(torch.tensor(result["paged_sdpa_int8"]), expected_int8)
