"""The documentation stays true: the MkDocs site builds strict, names real modules and every public name,
and the README stays a short front door whose links resolve."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import DOCS, PACKAGE, README, ROOT

MKDOCS_YML = ROOT / "mkdocs.yml"

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed (pip install -e '.[docs]')",
)


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=120, env=env, cwd=config.parent,
    )


@needs_mkdocs
def test_site_builds_strict(tmp_path: Path) -> None:
    result = _mkdocs_build(MKDOCS_YML, tmp_path / "site")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "index.html").exists()
    # the route diagram reaches the page as a mermaid block (rendered in the browser), not as a code listing
    page = (tmp_path / "site" / "architecture" / "index.html").read_text()
    diagram = re.search(r'<pre class="mermaid"><code>(.*?)</code></pre>', page, re.S)
    assert diagram, "docs/architecture.md's route diagram is not a mermaid block"
    for part in ("EngineClient", "Inbox", "Scheduler", "StepRoles", "StepExecutor", "PagedCache", "KVPool"):
        assert part in diagram.group(1), part


def test_strict_fails_on_unlisted_pages_and_broken_links() -> None:
    """`strict` only fails on warnings: the validation settings must make these warnings."""
    config = MKDOCS_YML.read_text()
    assert re.search(r"^strict:\s*true\s*$", config, re.M)
    validation = config.split("\nvalidation:\n", 1)[1]
    for setting in ("omitted_files", "unrecognized_links", "anchors", "absolute_links"):
        assert re.search(rf"^\s+{setting}:\s*warn\s*$", validation, re.M), setting


@needs_mkdocs
def test_strict_build_rejects_a_broken_page(tmp_path: Path) -> None:
    """The same settings on a copy of the site with an unlisted page holding a broken link and anchor."""
    (tmp_path / "docs").mkdir()
    for page in DOCS.iterdir():
        if page.is_file():
            (tmp_path / "docs" / page.name).write_bytes(page.read_bytes())
    (tmp_path / "docs" / "stray.md").write_text("# Stray\n\n[a](missing.md) and [b](index.md#no-such-anchor)\n")
    (tmp_path / "mkdocs.yml").write_text(MKDOCS_YML.read_text())
    result = _mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "stray.md" in output and "missing.md" in output and "no-such-anchor" in output, output


def test_nav_lists_every_page_that_exists() -> None:
    nav = re.findall(r"^\s+- [^:\n]+:\s*(\S+\.md)\s*$", MKDOCS_YML.read_text(), re.M)
    assert nav, "mkdocs.yml has no nav"
    for page in nav:
        assert (DOCS / page).is_file(), page


def _module_paths(text: str) -> list[str]:
    """Backticked `.py` files and folders (`pool/kv_pool.py`, `bench/`) named on a page."""
    files = re.findall(r"`([A-Za-z0-9_./-]+\.py)`", text)
    folders = re.findall(r"`([A-Za-z0-9_]+(?:/[A-Za-z0-9_]+)*/)`", text)
    return files + folders


def test_architecture_names_only_modules_that_exist() -> None:
    """docs/architecture.md names modules relative to `hf_paged_cache/` (`pool/kv_pool.py`); paths under
    `tests/`, `scripts/` and `hf_paged_cache/` itself are relative to the repository root."""
    paths = _module_paths((DOCS / "architecture.md").read_text())
    assert len(paths) > 40, paths
    missing = []
    for path in paths:
        base = ROOT if path.split("/")[0] in {"tests", "scripts", "hf_paged_cache", "metrics"} else PACKAGE
        if not (base / path).exists():
            missing.append(path)
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"


def test_architecture_covers_every_package_folder() -> None:
    text = (DOCS / "architecture.md").read_text()
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    absent = [f for f in folders if f"`{f}/" not in text]
    assert not absent, f"docs/architecture.md does not describe these package folders: {absent}"


def test_every_public_name_is_documented() -> None:
    import hf_paged_cache

    text = "\n".join(page.read_text() for page in DOCS.glob("*.md"))
    absent = [name for name in hf_paged_cache.__all__ if not re.search(rf"\b{re.escape(name)}\b", text)]
    assert not absent, f"public names no docs page mentions: {absent}"


def test_readme_is_a_front_door() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 350, f"README.md has {len(lines)} lines"


def test_readme_relative_links_resolve() -> None:
    text = README.read_text()
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    assert targets
    broken = []
    for target in targets:
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # absolute URLs and in-page anchors
        if not (ROOT / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"README.md links to missing files: {broken}"
