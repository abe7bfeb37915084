"""Training prompts for draft models, built only from text that this machine's packages carry.

Sources: Python stdlib code, installed packages' code, Python's documentation files and
fortunes. A missing source contributes nothing; held-out evaluation prompts never leak in.
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import os
import re
import sys
import sysconfig
import textwrap
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from random import Random

MAX_PROMPT_CHARS = 800  # ~200 tokens
SHINGLE_WORDS = 12
# Package data, so that an installed wheel finds them too.
HELDOUT_DIR = files("training") / "heldout"
HELDOUT_NAMES = ("chat", "code")

_MAX_ITEMS_PER_FILE = 3  # spreads code prompts over many files
_MAX_FILE_BYTES = 256_000
_SKIP_DIRS = frozenset({"__pycache__", "test", "tests", "idle_test", "site-packages"})
_DOC_NAME = re.compile(r"(NEWS|HISTORY|README[\w.]*|python-policy\.txt)(\.gz)?")
_RULE = re.compile(r"([=\-~^*+#])\1{2,}")  # reST heading underline
_ROLE = re.compile(r":[\w:.+-]+:`~?([^`<]*?)\s*(<[^>]*>)?`")  # :func:`~a.b` -> a.b
_LITERAL = re.compile(r"``(.+?)``")
_ISSUE = re.compile(r"(gh-issue-\d+|gh-\d+|bpo-\d+|Issues? #\d+((, | and )#\d+)*):\s*")
_PATCH_BY = re.compile(r"\s*(Patch|Contributed|Initial patch) by [^.]*\.?$")
_WORD = re.compile(r"\w+")

_CODE_TASKS = (
    "Explain what this Python function does:",
    "Review this Python function and point out possible bugs or edge cases:",
    "Write pytest unit tests for this Python function:",
    "Rewrite this Python function so that it is easier to read:",
)
_DOC_TASKS = (
    "Summarize this in one sentence:",
    "Explain this in simple terms:",
    "What does this mean?",
    "Rewrite this so that a beginner can follow it:",
    "List the key points of this text:",
    "Write a short, friendly announcement based on this note:",
)
_FORTUNE_TASKS = (
    "Explain this saying:",
    "Write a short story inspired by:",
    "Do you agree with this? Give your reasons:",
    "What is the point of this quote, in plain words?",
)


@dataclass(frozen=True)
class Prompt:
    """One training prompt and the source it came from."""

    source: str
    text: str

    @property
    def flavour(self) -> str:
        """Either "code" or "chat" (messages the target wrote itself are chat)."""
        return _SOURCES[self.source].flavour if self.source in _SOURCES else "chat"


@dataclass(frozen=True)
class SourceRoots:
    """Where each source lives; a missing path simply contributes nothing."""

    stdlib: tuple[Path, ...]
    packages: tuple[Path, ...]
    docs: tuple[Path, ...]
    fortunes: tuple[Path, ...]

    @classmethod
    def default(cls) -> SourceRoots:
        """This machine's paths for the running interpreter."""
        paths = sysconfig.get_paths()
        version = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return cls(
            stdlib=(Path(paths["stdlib"]),),
            packages=tuple(dict.fromkeys(Path(paths[key]) for key in ("purelib", "platlib"))),
            docs=tuple(sorted(Path("/usr/share/doc").glob(f"{version}*"))),
            fortunes=(Path("/usr/share/games/fortunes"),),
        )


@dataclass(frozen=True)
class _Function:
    """A function's dedented source, its def line(s), and its docstring ("" if none)."""

    source: str
    header: str
    undocumented: str
    doc: str


@dataclass(frozen=True)
class _Source:
    """A source's flavour, how many raw items it holds, and its stream of prompt texts."""

    flavour: str
    count: Callable[[SourceRoots], int]
    prompts: Callable[[SourceRoots, Random], Iterator[str]]


def normalize(text: str) -> str:
    """Lowercase with whitespace runs collapsed to one space."""
    return " ".join(text.lower().split())


def shingles(text: str, size: int = SHINGLE_WORDS) -> set[tuple[str, ...]]:
    """All runs of `size` consecutive words (\\w+ tokens of the normalized text)."""
    words = _WORD.findall(normalize(text))
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


class _Blocklist:
    """Texts a prompt must not equal, contain, sit inside, or share a shingle with."""

    def __init__(self, texts: Iterable[str]) -> None:
        self._texts = [t for t in map(normalize, texts) if t]
        self._shingles = set[tuple[str, ...]]().union(*map(shingles, self._texts))

    def blocks(self, text: str) -> bool:
        norm = normalize(text)
        if any(t in norm or norm in t for t in self._texts):
            return True
        return not self._shingles.isdisjoint(shingles(norm))


def load_heldout(name: str) -> list[str]:
    """The held-out evaluation prompts of one set ("chat" or "code")."""
    if name not in HELDOUT_NAMES:
        raise ValueError(f"unknown held-out set {name!r}; expected one of {HELDOUT_NAMES}")
    lines = (HELDOUT_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]


def corpus_sources(roots: SourceRoots | None = None) -> dict[str, int]:
    """Raw items per source: Python files for code sources, paragraphs or fortunes for text."""
    roots = roots or SourceRoots.default()
    return {name: source.count(roots) for name, source in _SOURCES.items()}


def build_corpus(
    num_prompts: int,
    seed: int = 0,
    exclude: Iterable[str] = (),
    roots: SourceRoots | None = None,
) -> list[Prompt]:
    """About half code and half chat prompts, deduplicated and disjoint from held-out sets.

    Returns fewer than `num_prompts` only when the sources run dry.
    """
    roots = roots or SourceRoots.default()
    accept = heldout_acceptor(exclude)
    code, chat = (_flavour_stream(flavour, roots, seed) for flavour in ("code", "chat"))
    num_code = (num_prompts + 1) // 2
    prompts = _take(code, num_code, accept) + _take(chat, num_prompts - num_code, accept)
    prompts += _take(_round_robin([code, chat]), num_prompts - len(prompts), accept)
    Random(seed).shuffle(prompts)
    return prompts


def heldout_acceptor(exclude: Iterable[str] = ()) -> Callable[[Prompt], bool]:
    """A filter that keeps new, small prompts disjoint from the held-out sets and from
    ``exclude``, and remembers what it kept."""
    blocklist = _Blocklist([*load_heldout("chat"), *load_heldout("code"), *exclude])
    seen: set[str] = set()

    def accept(prompt: Prompt) -> bool:
        key = normalize(prompt.text)
        if key in seen or len(prompt.text) > MAX_PROMPT_CHARS or blocklist.blocks(key):
            return False
        seen.add(key)
        return True

    return accept


def _take(stream: Iterator[Prompt], count: int, accept: Callable[[Prompt], bool]) -> list[Prompt]:
    """Up to `count` accepted prompts from `stream`, leaving the rest of it unread."""
    taken: list[Prompt] = []
    while len(taken) < count:
        prompt = next(stream, None)
        if prompt is None:
            break
        if accept(prompt):
            taken.append(prompt)
    return taken


def _flavour_stream(flavour: str, roots: SourceRoots, seed: int) -> Iterator[Prompt]:
    """The prompts of every source of one flavour, interleaved."""
    streams = [
        _tagged(name, source.prompts(roots, Random(f"{seed}:{name}")))
        for name, source in _SOURCES.items()
        if source.flavour == flavour
    ]
    return _round_robin(streams)


def _tagged(name: str, texts: Iterator[str]) -> Iterator[Prompt]:
    return (Prompt(name, text) for text in texts)


def _round_robin(streams: list[Iterator[Prompt]]) -> Iterator[Prompt]:
    """One item from each stream in turn until all are exhausted."""
    active = list(streams)
    while active:
        for stream in list(active):
            prompt = next(stream, None)
            if prompt is None:
                active.remove(stream)
            else:
                yield prompt


# Code sources: functions and module docstrings of Python files.


@functools.cache
def _python_files(roots: tuple[Path, ...]) -> tuple[tuple[str, Path], ...]:
    """(module name, path) of every Python file under `roots`, in a fixed order."""
    files: list[tuple[str, Path]] = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
            for name in sorted(f for f in filenames if f.endswith(".py")):
                path = Path(dirpath, name)
                files.append((_module_name(root, path), path))
    return tuple(files)


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _code_prompts(roots: tuple[Path, ...], rng: Random) -> Iterator[str]:
    files = list(_python_files(roots))
    rng.shuffle(files)
    for module, path in files:
        yield from _file_prompts(module, path, rng)


def _file_prompts(module: str, path: Path, rng: Random) -> list[str]:
    """Prompts for a few of a file's functions and for its module docstring."""
    tree, lines = _parse(path)
    if tree is None:
        return []
    functions = [f for node in _function_nodes(tree.body) if (f := _function(node, lines))]
    picked = rng.sample(functions, min(len(functions), _MAX_ITEMS_PER_FILE))
    texts = [_function_prompt(f, rng) for f in picked]
    doc = ast.get_docstring(tree)
    if doc and module:
        texts.append(_module_prompt(module, doc, rng))
    return [t for t in texts if t]


def _parse(path: Path) -> tuple[ast.Module | None, list[str]]:
    try:
        if path.stat().st_size > _MAX_FILE_BYTES:
            return None, []
        source = path.read_text(encoding="utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes etc. in third-party code
            return ast.parse(source), source.splitlines()
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, RecursionError):
        return None, []


def _function_nodes(body: list[ast.stmt]) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    """Functions and methods at module or class level; a full ast.walk costs twice the parse."""
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from _function_nodes(node.body)


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> _Function | None:
    """A function worth prompting about: at least 3 lines, not just a docstring."""
    if node.end_lineno is None:
        return None
    first, body = node.lineno - 1, node.body[0]
    if node.end_lineno - first < 3 or body.lineno - 1 <= first:
        return None
    doc = ast.get_docstring(node) or ""
    if doc and len(node.body) == 1:
        return None
    code_start = (body.end_lineno or body.lineno) if doc else body.lineno - 1
    header = lines[first : body.lineno - 1]
    return _Function(
        source=_dedent(lines[first : node.end_lineno]),
        header=_dedent(header),
        undocumented=_dedent(header + lines[code_start : node.end_lineno]),
        doc=doc,
    )


def _dedent(lines: list[str]) -> str:
    return textwrap.dedent("\n".join(lines)).strip("\n")


def _function_prompt(function: _Function, rng: Random) -> str:
    """One task about `function`, picked at random among those that fit the size limit."""
    options = [f"{task}\n{_fence(function.source)}" for task in _CODE_TASKS]
    options.append(f"Continue this Python code:\n{_fence(_head(function.undocumented))}")
    summary = _first_paragraph(function.doc)
    if summary:
        options.append(
            f"Write a docstring for this Python function:\n{_fence(function.undocumented)}"
        )
        options.append(
            f"Write a Python function with this signature:\n{_fence(function.header)}\n"
            f"It should do the following: {summary}"
        )
    fitting = [text for text in options if len(text) <= MAX_PROMPT_CHARS]
    return rng.choice(fitting) if fitting else ""


def _module_prompt(module: str, doc: str, rng: Random) -> str:
    summary = _first_paragraph(doc)
    if not summary:
        return ""
    task = rng.choice(
        (
            f"Write a short example that uses the Python module `{module}`, described as:",
            f"Explain what the Python module `{module}` is for, given its description:",
        )
    )
    return f"{task}\n{summary}"


def _fence(code: str) -> str:
    return f"```python\n{code}\n```"


def _head(code: str) -> str:
    """The first half of `code` (at least two lines), cut to leave room for an answer."""
    lines = code.splitlines()
    head = lines[: max(2, len(lines) // 2)]
    while len(head) > 2 and len("\n".join(head)) > MAX_PROMPT_CHARS // 2:
        head.pop()
    return "\n".join(head)


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line, or "" if it is too short or too long."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    return paragraph if len(paragraph.split()) >= 4 and len(paragraph) <= 400 else ""


# Chat sources: documentation paragraphs and fortunes.


@functools.cache
def _doc_paragraphs(dirs: tuple[Path, ...]) -> tuple[str, ...]:
    """Prose paragraphs of Python's NEWS, HISTORY, READMEs, policy and reST sources."""
    paragraphs: dict[str, None] = {}
    for path in _doc_files(dirs):
        for block in _blocks(_read_text(path)):
            if cleaned := _clean_paragraph(block):
                paragraphs[cleaned] = None
    return tuple(paragraphs)


def _doc_files(dirs: tuple[Path, ...]) -> list[Path]:
    """Documentation files, each name once (python3.X-dev and -venv repeat python3.X's)."""
    by_name: dict[str, Path] = {}
    for directory in dirs:
        found = [p for p in _files(directory) if _DOC_NAME.fullmatch(p.name)]
        found += _files(directory / "html" / "_sources", recursive=True)
        for path in found:
            by_name.setdefault(str(path.relative_to(directory)), path)
    return [by_name[name] for name in sorted(by_name)]


def _files(directory: Path, recursive: bool = False) -> list[Path]:
    if not directory.is_dir():
        return []
    paths = directory.rglob("*") if recursive else directory.iterdir()
    return sorted(p for p in paths if p.is_file())


def _read_text(path: Path) -> str:
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8", errors="replace") as f:
                return f.read()
        return path.read_text(encoding="utf-8", errors="replace")
    except (OSError, EOFError):
        return ""


def _blocks(text: str) -> Iterator[str]:
    """Blank-line separated blocks; each list item is its own block, headings are dropped."""
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        stripped = line.strip()
        if _RULE.fullmatch(stripped):
            block = []  # the lines above an underline are a heading
            continue
        if (not stripped or stripped.startswith(("- ", "* "))) and block:
            yield " ".join(block)
            block = []
        if stripped:
            block.append(stripped.removeprefix("- ").removeprefix("* "))


def _clean_paragraph(block: str) -> str:
    """Plain prose from a reST block, or "" when the block is not prose."""
    if block.startswith(("..", ":")) or "::" in block or "://" in block:
        return ""
    text = _LITERAL.sub(r"\1", _ROLE.sub(r"\1", block))
    text = " ".join(_PATCH_BY.sub("", _ISSUE.sub("", text)).split())
    num_words = len(text.split())
    num_alpha = sum(c.isalpha() or c.isspace() for c in text)
    if not 10 <= num_words <= 120 or num_alpha < 0.85 * len(text) or "\ufffd" in text:
        return ""
    return text


def _doc_prompts(dirs: tuple[Path, ...], rng: Random) -> Iterator[str]:
    paragraphs = list(_doc_paragraphs(dirs))
    rng.shuffle(paragraphs)
    return (f"{rng.choice(_DOC_TASKS)}\n\n{p}" for p in paragraphs)


@functools.cache
def _fortunes(dirs: tuple[Path, ...]) -> tuple[str, ...]:
    """Fortunes of 3 to 60 words from fortune files, skipping the offensive set."""
    fortunes: dict[str, None] = {}
    for directory in dirs:
        for path in _files(directory, recursive=True):
            if path.suffix in {".dat", ".u8"} or "off" in path.relative_to(directory).parts:
                continue
            for entry in re.split(r"^%$", _read_text(path), flags=re.MULTILINE):
                text = entry.strip()
                if 3 <= len(text.split()) <= 60 and "\ufffd" not in text:
                    fortunes[text] = None
    return tuple(fortunes)


def _fortune_prompts(dirs: tuple[Path, ...], rng: Random) -> Iterator[str]:
    fortunes = list(_fortunes(dirs))
    rng.shuffle(fortunes)
    return (f"{rng.choice(_FORTUNE_TASKS)}\n\n{f}" for f in fortunes)


_SOURCES = {
    "stdlib_code": _Source(
        "code",
        lambda roots: len(_python_files(roots.stdlib)),
        lambda roots, rng: _code_prompts(roots.stdlib, rng),
    ),
    "site_packages_code": _Source(
        "code",
        lambda roots: len(_python_files(roots.packages)),
        lambda roots, rng: _code_prompts(roots.packages, rng),
    ),
    "python_docs": _Source(
        "chat",
        lambda roots: len(_doc_paragraphs(roots.docs)),
        lambda roots, rng: _doc_prompts(roots.docs, rng),
    ),
    "fortunes": _Source(
        "chat",
        lambda roots: len(_fortunes(roots.fortunes)),
        lambda roots, rng: _fortune_prompts(roots.fortunes, rng),
    ),
}
