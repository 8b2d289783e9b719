"""An input-grounded workload: chat requests whose answers repeat much of their own prompt.

Speculative decoding by n-gram prompt lookup drafts the next tokens by copying what followed the last few
tokens elsewhere in the request's prompt or answer so far. It can only pay where answers copy their input,
which the ShareGPT-shaped workload of `hf_paged_cache.bench.workload` (random token ids, EOS ignored) never
does. `grounded_workload` builds the other kind, where an instruct model's greedy answer is mostly a copy of
a passage in its prompt:

- ``repeat``: "repeat this passage exactly" (the answer is the passage);
- ``correct``: "correct the spelling mistakes in this passage", the passage with a few words' inner letters
  swapped (the answer is the original passage);
- ``summarise``: "summarise this passage" (no reference answer; summaries of a small model quote a lot);
- ``rename``: "rename the variable ``x`` to ``y`` in this Python function" (the answer is the function with
  every use of the name replaced, computed with `tokenize`);
- ``quote``: a document, then "quote the sentence that contains the word W" (the answer is one sentence of
  the document, W chosen to occur in no other sentence).

Request ``i`` is of kind ``KINDS[i % len(KINDS)]``, so every kind has its share of any head of the stream.

**Where the text comes from.** Nothing is written by hand and nothing is fetched: the passages are docstrings
and the functions are functions of this Python's standard library source files (``sysconfig``'s ``stdlib``
directory, tests, demos and vendored packages left out), read with `ast` (never imported). A generator seeded
with ``seed`` walks the sorted file list in a shuffled order and takes, from each file, one docstring or
function drawn at random among those that fit the length bounds; no passage or function is used twice. The
same seed on the same Python (version and build) gives the same requests; another Python's standard library
may give others (`GroundedWorkload.summary` records the version and a fingerprint of the requests).

**Answer lengths.** Answers end at the model's EOS (a benchmark should not ignore it here: a copy is only
worth drafting while the model is copying). ``max_tokens`` caps them at the reference answer's length (the
passage's for ``summarise``), in the caller's tokens, times 1.25, plus 16 tokens.
"""

from __future__ import annotations

import ast
import hashlib
import io
import json
import math
import random
import re
import sys
import sysconfig
import textwrap
import tokenize
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

KINDS: tuple[str, ...] = ("repeat", "correct", "summarise", "rename", "quote")
"""The request kinds, in the order requests cycle through them."""
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "turtledemo", "site-packages", "dist-packages", "__pycache__",
                       "ensurepip", "lib2to3", "pydoc_data", "venv", "__phello__", "config-3", "encodings"})
"""Folders of the standard library whose files are not read (tests, demos, vendored or generated code)."""
MAX_TOKENS_SCALE = 1.25
"""``max_tokens`` = ``ceil(reference tokens x MAX_TOKENS_SCALE) + MAX_TOKENS_EXTRA``."""
MAX_TOKENS_EXTRA = 16
RENAME_WORDS = ("alpha", "bravo", "cursor", "entry", "target", "record", "bucket", "needle", "payload",
                "widget", "anchor", "marker", "ledger", "parcel", "beacon", "summit")
"""The new names of ``rename`` requests: one of these, ``_`` and the old name (``code`` becomes ``anchor_code``)."""

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(\"'`])")
_WORD = re.compile(r"[A-Za-z]+")


def default_count_tokens(text: str) -> int:
    """A tokenizer-free estimate of `text`'s token count (4 characters a token)."""
    return max(1, math.ceil(len(text) / 4))


@dataclass(frozen=True)
class GroundedRequest:
    """One chat request of the grounded workload."""

    kind: str  # one of KINDS
    messages: tuple[dict[str, str], ...]  # OpenAI chat messages (a single user turn)
    grounding: str  # the text of the prompt the answer should copy from (a passage, a function, a document)
    expected: str | None  # a reference answer (None for summarise), text a copying answer would match
    max_tokens: int  # the answer's cap, from the reference's length
    source: str  # where the text came from: the file (relative to the stdlib folder) and the object

    @property
    def prompt(self) -> str:
        """The user message's text."""
        return self.messages[-1]["content"]


@dataclass(frozen=True)
class GroundedWorkload:
    """A seeded stream of grounded chat requests (see the module docstring)."""

    requests: tuple[GroundedRequest, ...]
    seed: int
    python: str = field(default_factory=lambda: sys.version.split()[0])

    def __len__(self) -> int:
        return len(self.requests)

    def fingerprint(self) -> str:
        """A short hash of every request's messages (not the caps, which depend on the token counter): equal
        fingerprints, equal prompts."""
        blob = json.dumps([list(r.messages) for r in self.requests], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def summary(self) -> dict[str, Any]:
        """What the JSON files record about the workload."""
        kinds = {kind: sum(r.kind == kind for r in self.requests) for kind in KINDS}
        return {
            "num_requests": len(self.requests), "seed": self.seed, "python": self.python,
            "fingerprint": self.fingerprint(), "kinds": kinds, "max_tokens": [r.max_tokens for r in self.requests],
            "sources": [r.source for r in self.requests],
            "text_source": "docstrings and functions of this Python's standard library source files, drawn "
                           "with a seeded generator (hf_paged_cache.bench.grounded)",
        }


# ------------------------------------------------------------------ reading the standard library


def stdlib_files(root: Path | None = None) -> tuple[Path, ...]:
    """The standard library's ``.py`` files, sorted, without the folders of `SKIP_DIRS`."""
    root = Path(root or sysconfig.get_path("stdlib"))
    return tuple(sorted(
        path for path in root.rglob("*.py")
        if not any(part in SKIP_DIRS or part.startswith("config-") for part in path.relative_to(root).parts[:-1])
    ))


@lru_cache(maxsize=64)
def _parse(path: Path) -> tuple[str, ast.Module] | None:
    try:
        text = path.read_text(encoding="utf-8")
        return text, ast.parse(text)
    except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
        return None


def _named_nodes(tree: ast.Module) -> Iterator[tuple[str, ast.AST]]:
    """The module, and every class and function in it, with a dotted name."""
    yield "<module>", tree
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        prefix, node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                stack.append((f"{name}.", child))


def prose(docstring: str, max_words: int) -> str:
    """The prose of a docstring: its paragraphs without code, doctests, tables or field lists, joined with blank
    lines, cut at the last sentence end within `max_words` words (whole, when it has no such end)."""
    paragraphs = []
    for paragraph in re.split(r"\n\s*\n", docstring.strip()):
        lines = paragraph.splitlines()
        if any(line.startswith((" ", "\t")) or ">>>" in line or line.lstrip().startswith((":", "|", "+-", "=="))
               for line in lines):
            continue
        if not _WORD.search(paragraph) or paragraph.rstrip().endswith("::"):
            continue
        paragraphs.append(re.sub(r"\s+", " ", " ".join(line.strip() for line in lines)))
    text = "\n\n".join(paragraphs)
    words = text.split(" ")
    if len(text.split()) <= max_words:
        return text
    cut = " ".join(words[:max_words])
    end = max(cut.rfind(". "), cut.rfind(".\n"), cut.rfind("? "), cut.rfind("! "))
    return cut[: end + 1] if end > 0 else cut


def _passages(path: Path, min_words: int, max_words: int) -> list[tuple[str, str]]:
    parsed = _parse(path)
    if parsed is None:
        return []
    found = []
    for name, node in _named_nodes(parsed[1]):
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if not doc:
            continue
        text = prose(doc, max_words)
        if len(text.split()) >= min_words and text.isascii():
            found.append((name, text))
    return found


def _functions(path: Path, min_lines: int, max_lines: int) -> list[tuple[str, str, list[str]]]:
    """``(name, source, renamable names)`` of the functions of `path` with `min_lines` to `max_lines` lines."""
    parsed = _parse(path)
    if parsed is None:
        return []
    text, tree = parsed
    lines = text.splitlines()
    found = []
    for name, node in _named_nodes(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
            continue
        if not min_lines <= node.end_lineno - node.lineno + 1 <= max_lines:
            continue
        source = textwrap.dedent("\n".join(lines[node.lineno - 1: node.end_lineno]))
        if not source.isascii() or "\t" in source:
            continue
        names = _renamable(node, source)
        if names:
            found.append((name, source, names))
    return found


def _renamable(node: ast.FunctionDef | ast.AsyncFunctionDef, source: str) -> list[str]:
    """The function's parameters and local names (not self/cls, 2+ letters) that `source` uses 3 times or more."""
    params = [a.arg for a in (*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs)]
    stored = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    try:
        counts = _name_positions(source)
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return []
    return [name for name in dict.fromkeys(params + stored)
            if name not in ("self", "cls") and len(name) >= 2 and not name.startswith("__")
            and len(counts.get(name, ())) >= 3]


def _name_positions(source: str) -> dict[str, list[tuple[int, int]]]:
    """Each NAME token's ``(row, column)`` places in `source`, attributes (after a ``.``) left out."""
    positions: dict[str, list[tuple[int, int]]] = {}
    previous = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.NAME and not (previous is not None and previous.string == "."):
            positions.setdefault(token.string, []).append(token.start)
        if token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            previous = token
    return positions


def rename(source: str, old: str, new: str) -> str:
    """`source` with every NAME token `old` (but attributes, strings and comments) replaced by `new`."""
    lines = source.split("\n")
    for row, col in sorted(_name_positions(source).get(old, ()), reverse=True):
        line = lines[row - 1]
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "\n".join(lines)


def misspell(passage: str, rng: random.Random, every: int = 8) -> tuple[str, int]:
    """`passage` with about one in `every` words of 5+ letters misspelt (two inner letters swapped, so the word
    changes), and how many were."""
    words = list(_WORD.finditer(passage))
    pieces, last, count = [], 0, 0
    for match in words:
        word = match.group()
        if len(word) >= 5 and rng.randrange(every) == 0:
            i = rng.randrange(1, len(word) - 2)
            if word[i] != word[i + 1]:
                word = word[:i] + word[i + 1] + word[i] + word[i + 2:]
                count += 1
        pieces += [passage[last: match.start()], word]
        last = match.end()
    pieces.append(passage[last:])
    return "".join(pieces), count


def sentences(text: str) -> list[str]:
    """`text`'s sentences (split after ``.``, ``!`` or ``?`` before a capital, and at paragraph breaks)."""
    return [s.strip() for paragraph in text.split("\n\n") for s in _SENTENCE_END.split(paragraph) if s.strip()]


# ------------------------------------------------------------------ the workload


def grounded_workload(
    num_requests: int,
    *,
    seed: int = 0,
    count_tokens: Callable[[str], int] = default_count_tokens,
    words: tuple[int, int] = (40, 160),
    function_lines: tuple[int, int] = (8, 30),
    kinds: Sequence[str] = KINDS,
    stdlib: Path | None = None,
) -> GroundedWorkload:
    """Draw `num_requests` grounded chat requests (see the module docstring).

    Args:
        num_requests: how many requests; request ``i`` is of kind ``kinds[i % len(kinds)]``.
        seed: seeds the choice of files, passages, functions, names and misspellings.
        count_tokens: the answers' length in the served model's tokens (``max_tokens`` is set from it).
        words: the passages' length in words, ``(least, most)``: longer prose is cut at a sentence end.
        function_lines: the ``rename`` functions' length in lines, ``(least, most)``.
        kinds: the kinds to cycle through (default: all of `KINDS`).
        stdlib: the standard library folder to read (default: this Python's).
    """
    unknown = set(kinds) - set(KINDS)
    if unknown or not kinds:
        raise ValueError(f"kinds must be some of {KINDS}, got {list(kinds)}")
    root = Path(stdlib or sysconfig.get_path("stdlib"))
    files = list(stdlib_files(root))
    rng = random.Random(f"grounded/{seed}")
    rng.shuffle(files)
    order = iter(files)
    used: set[str] = set()

    def draw(kind: str) -> GroundedRequest:
        for path in order:
            where = path.relative_to(root).as_posix()
            if kind == "rename":
                candidates = [c for c in _functions(path, *function_lines) if f"{where}:{c[0]}" not in used]
                if candidates:
                    name, code, names = rng.choice(candidates)
                    used.add(f"{where}:{name}")
                    return _rename_request(code, names, rng, count_tokens, f"{where}:{name}")
                continue
            candidates = [c for c in _passages(path, *words) if f"{where}:{c[0]}" not in used]
            if kind == "quote":
                candidates = [c for c in candidates if len(sentences(c[1])) >= 3 and _unique_words(c[1])]
            if candidates:
                name, text = rng.choice(candidates)
                used.add(f"{where}:{name}")
                return _prose_request(kind, text, rng, count_tokens, f"{where}:{name}")
        raise ValueError(f"the standard library under {root} ran out of passages for {kind!r} after "
                         f"{len(used)} requests")

    requests = tuple(draw(kinds[i % len(kinds)]) for i in range(num_requests))
    return GroundedWorkload(requests, seed)


def _cap(reference: str, count_tokens: Callable[[str], int]) -> int:
    return math.ceil(count_tokens(reference) * MAX_TOKENS_SCALE) + MAX_TOKENS_EXTRA


def _unique_words(text: str) -> list[tuple[str, str]]:
    """``(sentence, word)`` pairs: words of 5+ letters found in that sentence (of 5 words or more) and nowhere in
    any other (case ignored)."""
    split = sentences(text)
    pairs = []
    for i, sentence in enumerate(split):
        if len(_WORD.findall(sentence)) < 5:
            continue
        others = [s.lower() for j, s in enumerate(split) if j != i]
        words = sorted({w.lower() for w in _WORD.findall(sentence) if len(w) >= 5})
        pairs += [(sentence, w) for w in words if not any(w in other for other in others)]  # not even inside a word
    return pairs


def _user(content: str) -> tuple[dict[str, str], ...]:
    return ({"role": "user", "content": content},)


def _prose_request(kind: str, passage: str, rng: random.Random, count_tokens: Callable[[str], int],
                   source: str) -> GroundedRequest:
    if kind == "repeat":
        prompt = f"Repeat the following passage exactly, word for word, and add nothing.\n\n{passage}"
        return GroundedRequest(kind, _user(prompt), passage, passage, _cap(passage, count_tokens), source)
    if kind == "correct":
        wrong, count = misspell(passage, rng)
        if count == 0:  # at least one mistake to correct
            wrong, _ = misspell(passage, rng, every=1)
        prompt = ("Correct the spelling mistakes in the following passage. Reply with the corrected passage "
                  f"only.\n\n{wrong}")
        return GroundedRequest(kind, _user(prompt), wrong, passage, _cap(passage, count_tokens), source)
    if kind == "summarise":
        prompt = f"Summarise the following passage in a few sentences.\n\n{passage}"
        return GroundedRequest(kind, _user(prompt), passage, None, _cap(passage, count_tokens), source)
    if kind == "quote":
        sentence, word = rng.choice(_unique_words(passage))
        prompt = (f"Document:\n\n{passage}\n\nQuote, word for word, the sentence of the document above that "
                  f'contains the word "{word}". Reply with that sentence only.')
        return GroundedRequest(kind, _user(prompt), passage, sentence, _cap(sentence, count_tokens), source)
    raise ValueError(f"not a prose kind: {kind!r}")


def _rename_request(code: str, names: list[str], rng: random.Random, count_tokens: Callable[[str], int],
                    source: str) -> GroundedRequest:
    old = rng.choice(names)
    taken = set(_name_positions(code))
    choices = [f"{word}_{old.strip('_')}" for word in RENAME_WORDS]
    new = rng.choice([n for n in choices if n not in taken] or [f"{old}_renamed"])
    prompt = (f"In the Python function below, rename the variable `{old}` to `{new}`. Reply with the complete "
              f"updated function only.\n\n```python\n{code}\n```")
    renamed = rename(code, old, new)
    return GroundedRequest("rename", _user(prompt), code, renamed, _cap(renamed, count_tokens), source)
