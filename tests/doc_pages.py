"""The project's Markdown as tests read it: README.md and the pages under docs/, their
sections and the code blocks whose examples the tests run."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

_HEADING = re.compile(r"(#{1,6}) (.*)")


def page(name: str) -> str:
    """The text of the page ``docs/<name>``."""
    return (DOCS / name).read_text()


def section(text: str, title: str) -> str:
    """The text under the heading ``title`` (any level) up to the next heading of that level
    or above; lines inside fenced code are never headings (a shell comment starts with #)."""
    lines = text.splitlines(keepends=True)
    start = level = None
    is_fenced = False
    for i, line in enumerate(lines):
        if line.startswith("```"):
            is_fenced = not is_fenced
            continue
        match = None if is_fenced else _HEADING.fullmatch(line.rstrip("\n"))
        if match is None:
            continue
        if start is None:
            if match.group(2).strip() == title:
                start, level = i + 1, len(match.group(1))
        elif len(match.group(1)) <= (level or 0):
            return "".join(lines[start:i])
    if start is None:
        raise KeyError(f"no heading {title!r}")
    return "".join(lines[start:])


def code_blocks(text: str, lang: str = "python") -> list[str]:
    """The fenced ```lang blocks of ``text``, in order."""
    return re.findall(rf"^```{re.escape(lang)}\n(.*?)^```", text, re.M | re.S)
