"""The pages under docs/ build with mkdocs in strict mode, into a temporary directory: a link
to a missing page or anchor, an absolute link, or a page left out of the nav fails the
build. Every page is in the nav, and the README's documentation list links each one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.doc_pages import DOCS, README, ROOT, section

CONFIG = ROOT / "mkdocs.yml"


def nav_pages(nav: list[Any]) -> list[str]:
    """The page paths of an mkdocs ``nav``, sections flattened."""
    pages = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages += nav_pages(value) if isinstance(value, list) else [value]
    return pages


def docs_pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def test_build_is_strict_and_passes(tmp_path: Path) -> None:
    site = tmp_path / "site"
    build = [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(CONFIG)]
    result = subprocess.run(
        [*build, "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    assert (site / "index.html").is_file()
    assert (site / "serving" / "index.html").is_file()


def test_config_fails_on_broken_links_and_omitted_pages() -> None:
    """strict turns each of these warnings into an error; without them mkdocs only logs
    most link problems at INFO level."""
    config = yaml.safe_load(CONFIG.read_text())
    assert config["strict"] is True
    for check in ("omitted_files", "absolute_links", "unrecognized_links", "not_found"):
        assert config["validation"][check] == "warn", check
    assert config["validation"]["anchors"] == "warn"


def test_every_page_is_in_the_nav() -> None:
    nav = nav_pages(yaml.safe_load(CONFIG.read_text())["nav"])
    assert len(nav) == len(set(nav)), f"pages listed twice: {nav}"
    assert set(nav) == docs_pages()


def test_readme_links_every_page() -> None:
    """The README's documentation list names each page but the landing one, and every
    relative link in the README reaches a file."""
    text = README.read_text()
    listed = re.findall(r"\]\(docs/([^)#]+\.md)\)", section(text, "Documentation"))
    assert sorted(listed) == sorted(docs_pages() - {"index.md"})
    for target in re.findall(r"\]\(([^)]+)\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (ROOT / target.split("#")[0]).is_file(), target
