"""Every script's ``--help`` (scripts/bench/, scripts/eval/, scripts/examples/) names each option's default exactly
once (and flags none)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from repo_paths import SCRIPTS
from script_loading import option_blocks

# Every runnable script in scripts/'s groups; the Space is a Gradio app (tests/scripts/test_space.py), not a command.
SCRIPT_FILES = sorted(path for path in SCRIPTS.rglob("*.py") if "space" not in path.relative_to(SCRIPTS).parts)


def help_text(path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("path", SCRIPT_FILES, ids=[p.stem for p in SCRIPT_FILES])
def test_help_shows_every_default_once(
    path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks = option_blocks(help_text(path, capsys, monkeypatch))
    assert blocks, "no options found"
    for option, text in blocks.items():
        if option.startswith("-h") or " " not in option:  # --help and flags have no default to show
            assert "default" not in text.lower(), option
            continue
        assert text.lower().count("(default:") == 1, f"{path.name} {option}: {text!r}"
