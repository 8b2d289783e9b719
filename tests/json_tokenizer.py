"""A character tokenizer that can write JSON: `tests/data/char_tokenizer` (79 tokens) with the 17 ASCII signs
it lacks that JSON, regular expressions and tool calls need, so that its vocabulary is the tiny models' 96."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

CHAR_TOKENIZER = Path(__file__).resolve().parent / "data" / "char_tokenizer"
EXTRA_CHARACTERS = "{}[]_/\\*+=<>@#$%&"  # 79 + 17 = 96 tokens


def save_json_tokenizer(path: Path) -> Path:
    """Write the tokenizer (and the chat template of the character tokenizer) to `path`; returns `path`."""
    path.mkdir(parents=True, exist_ok=True)
    spec = json.loads((CHAR_TOKENIZER / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    for character in EXTRA_CHARACTERS:
        vocab[character] = len(vocab)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        (path / name).write_text((CHAR_TOKENIZER / name).read_text())
    (path / "tokenizer.json").write_text(json.dumps(spec))
    return path


def json_tokenizer(path: Path):
    return AutoTokenizer.from_pretrained(save_json_tokenizer(path))
