"""The multi-turn chat example runs on the real default model and reuses earlier turns' blocks."""

import importlib.util

from repo_paths import SCRIPTS

SCRIPT = SCRIPTS / "examples" / "chat_prefix_cache.py"


def test_chat_turns_reuse_previous_blocks(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("chat_prefix_cache", SCRIPT)
    chat = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chat)
    results = chat.main(["--turns", "2", "--max-new-tokens", "8", "--json", str(tmp_path / "chat.json")])
    first, second = results["turns"]
    assert first["reused_tokens"] == 0
    # turn 2's prompt starts with turn 1's; all its full blocks up to the end of turn 1 are reused
    assert second["reused_tokens"] >= (first["prompt_tokens"] // 16) * 16
    assert second["computed_tokens"] == second["prompt_tokens"] - second["reused_tokens"]
    assert results["prefix_cache"]["hits"] >= second["reused_tokens"] // 16
    assert (tmp_path / "chat.json").exists()
    assert results["answers_identical"]
    assert "answers identical" in capsys.readouterr().out
