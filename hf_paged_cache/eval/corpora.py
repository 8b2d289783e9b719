"""Text corpora for perplexity evaluation: local files and folders, Hub datasets, and an offline default.

Corpus specs
------------
:func:`load_corpus_text` accepts

* ``None``: the default corpus.  When the Hugging Face Hub is reachable this is the WikiText-2 raw test
  split (``wikitext`` / ``wikitext-2-raw-v1`` / ``test``), the corpus of the transformers guide
  "Perplexity of fixed-length models"; otherwise it is the offline English Wikipedia excerpt below.
* ``"offline"`` (:data:`OFFLINE_SPEC`): the offline excerpt, whether or not the Hub is reachable.
* a path to a text file, or to a folder (every ``*.txt`` file under it, recursively, in sorted order),
  read with ``datasets.load_dataset("text", data_files=..., sample_by="document")``;
* anything else: a Hub dataset name, optionally ``name:config`` (e.g. ``"wikitext:wikitext-2-raw-v1"``),
  read with ``datasets.load_dataset(name, config, split=split)``; its rows' ``text_column`` are joined
  with blank lines, as the transformers guide does for WikiText.

The offline corpus
------------------
The PyPI wheel ``gensim==4.4.0`` (LGPL-2.1 code) ships, as test data,
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``: a
shortened MediaWiki XML export of the first English Wikipedia articles (2016 revisions: about 106
articles plus redirects, e.g. "Anarchism", "Autism", "Albedo", "Academy Awards").  Wikipedia text is
licensed CC BY-SA (3.0 at the time of that dump); the derived plain text keeps that licence and its
authors are the Wikipedia contributors of those articles.

:func:`offline_corpus_path` downloads that wheel with ``pip download --no-deps --only-binary=:all:``
(nothing is installed), pulls the ``.bz2`` member out with :mod:`zipfile`, checks its SHA-256 against
:data:`ENWIKI_BZ2_SHA256` (the hash the wheel's ``RECORD`` lists), decompresses it, turns each main-namespace,
non-redirect page's wikitext into plain text (:func:`wikitext_to_text`: templates, tables, references,
files, categories, HTML tags and emphasis removed; links replaced by their text; headings kept as
lines) and saves the result once as ``<default_cache_dir()>/enwiki-excerpt.txt``, next to a provenance
note ``enwiki-excerpt.PROVENANCE.md``.  Later calls return the saved file at once.
"""

from __future__ import annotations

import bz2
import hashlib
import html
import os
import re
import sys
import tempfile
import uuid
import xml.etree.ElementTree as ET
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..models.default_model import default_cache_dir, download_wheel

__all__ = [
    "ENWIKI_BZ2_SHA256",
    "ENWIKI_MEMBER",
    "GENSIM_REQUIREMENT",
    "OFFLINE_CORPUS_FILENAME",
    "OFFLINE_SPEC",
    "WIKITEXT",
    "Corpus",
    "CorpusDownloadError",
    "load_corpus_text",
    "offline_corpus_path",
    "wiki_xml_to_text",
    "wikitext_to_text",
]

GENSIM_REQUIREMENT: str = "gensim==4.4.0"
"""PyPI requirement whose wheel carries the Wikipedia excerpt."""

ENWIKI_MEMBER: str = (
    "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
)
"""Archive member of the gensim wheel holding the bz2-compressed MediaWiki XML export."""

ENWIKI_BZ2_SHA256: str = "a53f4648dec40467ebdcbc7a1307eddb51fe6e28e9309f6ebde81ba0d04bea2d"
"""SHA-256 of that member (as listed in the wheel's RECORD)."""

OFFLINE_CORPUS_FILENAME: str = "enwiki-excerpt.txt"
"""Name of the plain-text excerpt inside :func:`~hf_paged_cache.models.default_model.default_cache_dir`."""

PROVENANCE_FILENAME: str = "enwiki-excerpt.PROVENANCE.md"
"""Name of the provenance note written beside the excerpt."""

OFFLINE_SPEC: str = "offline"
"""Corpus spec that always selects the offline excerpt."""

WIKITEXT: tuple[str, str, str] = ("wikitext", "wikitext-2-raw-v1", "test")
"""(dataset, config, split) of the default corpus when the Hub is reachable."""

# Fallback platform flags for `pip download` when no wheel matches this interpreter: every gensim 4.4.0
# wheel carries the same test data, and the SHA-256 check makes sure of it.
_FALLBACK_WHEEL_FLAGS: tuple[str, ...] = (
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "cp311",
    "--platform",
    "manylinux_2_28_x86_64",
)
_HUB_PROBE_TIMEOUT_S: float = 3.0
_TRUE_STRINGS: frozenset[str] = frozenset({"1", "on", "yes", "true"})
_DROPPED_SECTIONS: frozenset[str] = frozenset(
    {
        "references",
        "notes",
        "footnotes",
        "citations",
        "sources",
        "bibliography",
        "further reading",
        "external links",
        "see also",
        "notes and references",
    }
)
_DROPPED_LINK_NAMESPACES: frozenset[str] = frozenset({"file", "image", "category", "media"})


class CorpusDownloadError(RuntimeError):
    """``pip download`` of the wheel carrying the offline corpus failed (e.g. PyPI is unreachable)."""


@dataclass(frozen=True)
class Corpus:
    """A corpus as one string, with where it came from."""

    text: str
    name: str  # short name for tables and JSON, e.g. "enwiki-excerpt" or "wikitext/wikitext-2-raw-v1/test"
    source: str  # path or Hub dataset it was read from


# ---------------------------------------------------------------------------------------------- wikitext


def _remove_nested(text: str, pattern: re.Pattern[str]) -> str:
    """Delete the innermost matches of `pattern` until none is left (for nested templates and tables)."""
    while True:
        text, count = pattern.subn("", text)
        if count == 0:
            return text


_COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
_SELF_CLOSING_REF = re.compile(r"<ref\b[^>]*/\s*>", re.IGNORECASE)
_REF = re.compile(r"<ref\b[^>]*>.*?</ref\s*>", re.IGNORECASE | re.DOTALL)
_DROPPED_ELEMENTS = re.compile(
    r"<(math|gallery|source|syntaxhighlight|timeline|imagemap|score|chem|hiero)\b[^>]*>.*?</\1\s*>", re.IGNORECASE | re.DOTALL
)
_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")
_TABLE = re.compile(r"\{\|(?:(?!\{\|).)*?\|\}", re.DOTALL)
_LINK = re.compile(r"\[\[([^\[\]]*)\]\]")
_EXTERNAL_LINK = re.compile(r"\[(?:https?:|ftp:)?//[^\s\]]*\s*([^\]]*)\]")
_BARE_BRACKET_URL = re.compile(r"\[(?:https?|ftp)://[^\]]*\]")
_TAG = re.compile(r"</?[a-zA-Z][^>]*?/?>")
_EMPHASIS = re.compile(r"'{2,}")
_HEADING = re.compile(r"^(={1,6})\s*(.*?)\s*\1\s*$", re.MULTILINE)
_LIST_MARKER = re.compile(r"^[*#:;]+\s*", re.MULTILINE)
_BEHAVIOUR_SWITCH = re.compile(r"__[A-Z]+__")
_SPACES = re.compile(r"[ \t\u00a0]+")
_BLANK_LINES = re.compile(r"\n{3,}")
_EMPTY_BRACKETS = re.compile(r"\(\s*[,;]?\s*\)")


def _link_text(match: re.Match[str]) -> str:
    """Text shown for an internal link ``[[target|label]]``; files, categories and interwikis show nothing."""
    inner = match.group(1)
    target, _, label = inner.partition("|")
    target = target.strip()
    prefix, colon, rest = target.partition(":")
    prefix = prefix.strip().lower()
    if colon and not target.startswith(":"):
        if prefix in _DROPPED_LINK_NAMESPACES:
            return ""
        if not label and re.fullmatch(r"[a-z]{2,3}(-[a-z]+)?", prefix):
            return ""  # interlanguage link
    if label:
        # [[File:...|thumb|caption]] was dropped above; for others the display text is the last part.
        return label.rsplit("|", 1)[-1].strip()
    target = target.lstrip(":")
    prefix, colon, rest = target.partition(":")
    if colon and rest and " " not in prefix and not rest.startswith(" "):
        return rest  # [[wikt:word]] and similar project links show the word
    return target


_FILE_LINK_START = re.compile(r"\[\[\s*(?:file|image|media)\s*:", re.IGNORECASE)


def _remove_file_links(text: str) -> str:
    """Delete ``[[File:...]]`` / ``[[Image:...]]`` links with their captions, balancing brackets.

    Captions may hold links and single brackets, which a plain regex cannot balance.
    """
    out: list[str] = []
    pos = 0
    while (match := _FILE_LINK_START.search(text, pos)) is not None:
        out.append(text[pos : match.start()])
        depth, single, i = 1, 0, match.end()  # open [[ and open single [ (external links, "[in 1900]")
        while depth and i < len(text):
            if text.startswith("[[", i):
                depth, i = depth + 1, i + 2
            elif text[i] == "[":
                single, i = single + 1, i + 1
            elif text[i] == "]" and single:
                single, i = single - 1, i + 1
            elif text.startswith("]]", i):
                depth, i = depth - 1, i + 2
            else:
                i += 1
        pos = i
    out.append(text[pos:])
    return "".join(out)


def _drop_sections(text: str) -> str:
    """Remove reference-like sections (References, External links, See also, ...) up to the next heading."""
    out: list[str] = []
    skipping_level = 0
    for line in text.split("\n"):
        heading = _HEADING.match(line)
        if heading:
            level = len(heading.group(1))
            if skipping_level and level > skipping_level:
                continue
            skipping_level = level if heading.group(2).strip().lower() in _DROPPED_SECTIONS else 0
        if not skipping_level:
            out.append(line)
    return "\n".join(out)


def wikitext_to_text(wikitext: str, title: str | None = None) -> str:
    """Plain, readable text from one article's MediaWiki markup.

    Removes comments, ``<ref>`` citations, ``<math>``/``<gallery>``-like elements, templates ``{{...}}``
    (nested), tables ``{| ... |}`` (nested), file/image/category and interlanguage links, remaining HTML
    tags, bold/italic quotes and list markers; replaces internal links ``[[a|b]]`` by ``b`` (``[[a]]`` by
    ``a``) and external links ``[url label]`` by ``label``; keeps headings as ``== Heading ==`` lines
    (WikiText style) and drops reference-like sections (References, External links, See also, ...).
    HTML entities are decoded.  If `title` is given the text starts with a ``= title =`` line.
    """
    text = _COMMENT.sub("", wikitext)
    text = _SELF_CLOSING_REF.sub("", text)
    text = _REF.sub("", text)
    text = _DROPPED_ELEMENTS.sub("", text)
    text = _remove_nested(text, _TEMPLATE)
    text = _remove_nested(text, _TABLE)
    text = _drop_sections(text)
    text = _remove_file_links(text)
    while True:  # innermost links first, so captions holding links vanish with their file link
        text, count = _LINK.subn(_link_text, text)
        if count == 0:
            break
    text = _EXTERNAL_LINK.sub(lambda m: m.group(1), text)
    text = _BARE_BRACKET_URL.sub("", text)
    text = _TAG.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _BEHAVIOUR_SWITCH.sub("", text)
    text = html.unescape(text)
    text = _HEADING.sub(lambda m: f"{m.group(1)} {m.group(2)} {m.group(1)}", text)
    text = _LIST_MARKER.sub("", text)
    text = _EMPTY_BRACKETS.sub("", text)
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    lines = [line.replace(" ,", ",").replace(" .", ".") for line in lines]
    text = _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()
    if title:
        text = f"= {title} =\n\n{text}"
    return text


def _iter_pages(xml_bytes: bytes) -> Iterator[tuple[str, str]]:
    """(title, wikitext) of each main-namespace page that is not a redirect, in file order."""
    root = ET.fromstring(xml_bytes)
    namespace = root.tag[: root.tag.index("}") + 1] if root.tag.startswith("{") else ""
    for page in root.iter(f"{namespace}page"):
        if (page.findtext(f"{namespace}ns") or "").strip() != "0":
            continue
        if page.find(f"{namespace}redirect") is not None:
            continue
        title = page.findtext(f"{namespace}title") or ""
        wikitext = page.findtext(f"{namespace}revision/{namespace}text") or ""
        if wikitext.lstrip()[:9].upper() == "#REDIRECT":
            continue
        yield title, wikitext


def _articles(xml_bytes: bytes) -> list[str]:
    """Plain text of each non-empty article of a MediaWiki XML export."""
    articles = (wikitext_to_text(wikitext, title) for title, wikitext in _iter_pages(xml_bytes))
    return [article for article in articles if article.strip()]


def wiki_xml_to_text(xml_bytes: bytes) -> str:
    """Plain text of every article in a MediaWiki XML export, articles separated by blank lines."""
    return "\n\n\n".join(_articles(xml_bytes)) + "\n"


# ---------------------------------------------------------------------------------------------- offline corpus


def _download_gensim_wheel(dest: Path) -> Path:
    """``pip download`` a gensim 4.4.0 wheel into `dest` (this platform's, else a manylinux cp311 one)."""
    what = "the offline corpus"
    try:
        return download_wheel(GENSIM_REQUIREMENT, dest, what=what)
    except RuntimeError:
        try:
            return download_wheel(GENSIM_REQUIREMENT, dest, _FALLBACK_WHEEL_FLAGS, what=what)
        except RuntimeError as exc:
            raise CorpusDownloadError(str(exc)) from exc


def _read_enwiki_member(wheel: Path) -> bytes:
    """The decompressed XML export from `wheel`, after checking the compressed member's SHA-256."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            compressed = zf.read(ENWIKI_MEMBER)
    except (KeyError, zipfile.BadZipFile) as exc:
        raise RuntimeError(f"{wheel.name} does not contain {ENWIKI_MEMBER}: {exc}") from exc
    digest = hashlib.sha256(compressed).hexdigest()
    if digest != ENWIKI_BZ2_SHA256:
        raise RuntimeError(
            f"{ENWIKI_MEMBER} in {wheel.name} has SHA-256 {digest}, expected {ENWIKI_BZ2_SHA256}"
        )
    return bz2.decompress(compressed)


def _provenance(text: str, wheel_name: str, articles: int) -> str:
    return (
        "# enwiki-excerpt.txt\n\n"
        f"Plain text of {articles} English Wikipedia articles (2016 revisions), made by "
        "`hf_paged_cache.eval.corpora.offline_corpus_path()`.\n\n"
        f"* Source: `{ENWIKI_MEMBER}` in the PyPI wheel `{wheel_name}` ({GENSIM_REQUIREMENT}, "
        "gensim's test data), SHA-256 of the `.bz2` member "
        f"`{ENWIKI_BZ2_SHA256}`.\n"
        "* Conversion: main-namespace, non-redirect pages; MediaWiki markup stripped with "
        "`hf_paged_cache.eval.corpora.wikitext_to_text` (templates, tables, references, files, categories, "
        "HTML tags removed; links replaced by their text).\n"
        f"* SHA-256 of enwiki-excerpt.txt (UTF-8): `{hashlib.sha256(text.encode('utf-8')).hexdigest()}`.\n"
        "* Licence: Wikipedia text, CC BY-SA 3.0 (https://creativecommons.org/licenses/by-sa/3.0/); "
        "authors: the contributors to these Wikipedia articles (see each article's history on "
        "en.wikipedia.org).\n"
    )


def offline_corpus_path(cache_dir: Path | None = None) -> Path:
    """Path of the offline English Wikipedia excerpt, building it on first use (see the module docstring).

    Args:
        cache_dir: Directory holding the excerpt; defaults to
            :func:`~hf_paged_cache.models.default_model.default_cache_dir`.

    Raises:
        CorpusDownloadError: if ``pip download`` of the gensim wheel fails.
        RuntimeError: if the wheel lacks the file or its SHA-256 does not match.
    """
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / OFFLINE_CORPUS_FILENAME
    if target.is_file():
        return target
    print(
        f"hf_paged_cache: building the offline corpus {target} from the PyPI wheel {GENSIM_REQUIREMENT} "
        "(a ~28 MB download, once)...",
        file=sys.stderr,
        flush=True,
    )
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="hf_paged_cache-corpus-") as tmp:
        wheel = _download_gensim_wheel(Path(tmp))
        xml_bytes = _read_enwiki_member(wheel)
        wheel_name = wheel.name
    articles = _articles(xml_bytes)
    text = "\n\n\n".join(articles) + "\n"
    # Write beside the target and rename, so an interrupted run never leaves a partial corpus.
    suffix = f".tmp-{os.getpid()}-{uuid.uuid4().hex}"
    for name, content in (
        (PROVENANCE_FILENAME, _provenance(text, wheel_name, len(articles))),
        (OFFLINE_CORPUS_FILENAME, text),
    ):
        staging = cache_dir / (name + suffix)
        staging.write_text(content, encoding="utf-8")
        os.replace(staging, cache_dir / name)
    return target


# ---------------------------------------------------------------------------------------------- loading


def _hub_dataset_reachable(name: str) -> bool:
    """Whether the Hub answers for dataset `name` (False in offline mode or on any network error)."""
    import huggingface_hub
    import huggingface_hub.constants
    from huggingface_hub.errors import HfHubHTTPError

    if huggingface_hub.constants.HF_HUB_OFFLINE or any(
        os.environ.get(var, "").strip().lower() in _TRUE_STRINGS
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    ):
        return False
    network_errors: tuple[type[BaseException], ...] = (OSError, *HfHubHTTPError.__bases__)
    try:
        huggingface_hub.dataset_info(name, timeout=_HUB_PROBE_TIMEOUT_S)
    except network_errors:
        return False
    return True


def _local_text_files(path: Path) -> list[str]:
    if path.is_file():
        return [str(path)]
    files = sorted(str(p) for p in path.rglob("*.txt") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise ValueError(f"corpus folder {path} holds no *.txt files")
    return files


def _load_local(path: Path) -> Corpus:
    import datasets

    files = _local_text_files(path)
    dataset = datasets.load_dataset("text", data_files=files, split="train", sample_by="document")
    documents = [doc.strip("\n") for doc in dataset["text"]]
    return Corpus(text="\n\n".join(documents), name=path.name, source=str(path))


def _load_hub(name: str, config: str | None, split: str, text_column: str) -> Corpus:
    import datasets

    dataset = datasets.load_dataset(name, config, split=split)
    if text_column not in dataset.column_names:
        raise ValueError(
            f"dataset {name!r} ({config}, {split}) has no column {text_column!r}; columns: {dataset.column_names}"
        )
    # As the transformers guide does for WikiText: rows joined with blank lines.
    text = "\n\n".join(dataset[text_column])
    label = "/".join(part for part in (name, config, split) if part)
    return Corpus(text=text, name=label, source=f"hf://datasets/{label}")


def load_corpus_text(
    spec: str | os.PathLike[str] | None = None,
    *,
    split: str = "test",
    text_column: str = "text",
    cache_dir: Path | None = None,
) -> Corpus:
    """Load a corpus as one string (see the module docstring for the accepted `spec` values).

    Args:
        spec: ``None`` (WikiText-2 test when the Hub answers, else the offline excerpt), ``"offline"``,
            a local text file or folder, or a Hub dataset ``name`` / ``name:config``.
        split: Split of a Hub dataset.
        text_column: Column of a Hub dataset holding the text.
        cache_dir: Where the offline excerpt lives (default :func:`default_cache_dir`).

    Token capping (``--max-tokens``) happens after tokenization, in
    :func:`hf_paged_cache.eval.perplexity.encode_corpus`.
    """
    if spec is None:
        name, config, wikitext_split = WIKITEXT
        if _hub_dataset_reachable(name):
            return _load_hub(name, config, wikitext_split, "text")
        spec = OFFLINE_SPEC
    if str(spec) == OFFLINE_SPEC:
        path = offline_corpus_path(cache_dir)
        return Corpus(text=path.read_text(encoding="utf-8"), name="enwiki-excerpt", source=str(path))
    path = Path(spec).expanduser()
    if path.exists():
        return _load_local(path)
    name, _, config = str(spec).partition(":")
    return _load_hub(name, config or None, split, text_column)
