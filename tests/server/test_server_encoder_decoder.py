"""The server on an encoder-decoder model: refused at start-up with the reason (serving one is not built yet)."""

from __future__ import annotations

import os
import subprocess
import sys

from encoder_decoder_models import tiny_seq2seq
from server_process import free_port


def test_an_encoder_decoder_model_is_refused_at_start_up_by_name(tmp_path):
    tiny_seq2seq("bart").save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "hf_paged_cache.serve", str(tmp_path), "--port", str(free_port())],
                          capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode != 0
    assert "(bart) is an encoder-decoder model: serving it is not built yet" in done.stderr
