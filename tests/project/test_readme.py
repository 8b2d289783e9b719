"""The README's quickstart runs as written."""

import re

from repo_paths import README


def test_quickstart_runs(capsys):
    code = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    exec(compile(code, "README.md quickstart", "exec"), {})
    printed = capsys.readouterr().out
    assert "CacheStats(blocks_in_use=" in printed
    assert "blocks_in_use=0" not in printed  # it printed the stats while the cache still held the batch
