"""Training-prompt corpus: deterministic, deduplicated, both flavours, size-bounded, disjoint
from the held-out evaluation prompts, and still working when sources are missing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from training.corpus import (
    HELDOUT_DIR,
    HELDOUT_NAMES,
    MAX_PROMPT_CHARS,
    Prompt,
    SourceRoots,
    build_corpus,
    corpus_sources,
    load_heldout,
)


def _shingles(text: str, size: int = 12) -> set[tuple[str, ...]]:
    """Written again here so the check does not trust the module's own helper."""
    words = re.findall(r"\w+", text.lower())
    return {tuple(words[i : i + size]) for i in range(len(words) - size + 1)}


@pytest.fixture(scope="module")
def corpus() -> list[Prompt]:
    return build_corpus(300, seed=0)


def test_same_seed_same_corpus(corpus: list[Prompt]) -> None:
    assert build_corpus(300, seed=0) == corpus
    assert build_corpus(300, seed=1) != corpus


def test_size_dedup_and_flavours(corpus: list[Prompt]) -> None:
    assert len(corpus) == 300
    keys = [" ".join(p.text.lower().split()) for p in corpus]
    assert len(set(keys)) == len(keys)
    assert all(0 < len(p.text) <= MAX_PROMPT_CHARS for p in corpus)
    num_code = sum(p.flavour == "code" for p in corpus)
    assert 0 < num_code < len(corpus)
    counts = corpus_sources()
    if min(counts["python_docs"] + counts["fortunes"], counts["stdlib_code"]) > 300:
        assert num_code == len(corpus) // 2  # an even split whenever both flavours suffice


@pytest.mark.parametrize("name", HELDOUT_NAMES)
def test_heldout_sets(name: str) -> None:
    lines = (HELDOUT_DIR / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()
    records = [json.loads(line) for line in lines]
    prompts = load_heldout(name)
    assert len(records) == len(prompts) >= 64
    assert len({r["id"] for r in records}) == len(records)
    assert all(r["id"].startswith(f"{name}-") for r in records)
    assert len({" ".join(p.lower().split()) for p in prompts}) == len(prompts)
    assert all(5 <= len(p.split()) <= 80 for p in prompts)
    with pytest.raises(ValueError):
        load_heldout("unknown")


def test_disjoint_from_heldout() -> None:
    heldout = [*load_heldout("chat"), *load_heldout("code")]
    banned = set().union(*map(_shingles, heldout))
    corpus = build_corpus(2000, seed=3)
    assert len(corpus) == 2000
    assert not any(banned & _shingles(p.text) for p in corpus)


def test_exclude_drops_matching_prompts(corpus: list[Prompt]) -> None:
    excluded = corpus[0].text
    again = build_corpus(300, seed=0, exclude=[excluded[len(excluded) // 2 :]])
    assert excluded not in {p.text for p in again}


def test_missing_sources(tmp_path: Path) -> None:
    fortunes = tmp_path / "fortunes"
    fortunes.mkdir()
    sayings = [f"A watched pot number {i} never boils, said the cook." for i in range(5)]
    (fortunes / "kitchen").write_text("\n%\n".join(sayings) + "\n")
    (fortunes / "kitchen.dat").write_bytes(b"\x00\x01")
    roots = SourceRoots(stdlib=(), packages=(tmp_path / "absent",), docs=(), fortunes=(fortunes,))
    assert corpus_sources(roots) == {
        "stdlib_code": 0,
        "site_packages_code": 0,
        "python_docs": 0,
        "fortunes": 5,
    }
    prompts = build_corpus(20, roots=roots)
    assert len(prompts) == 5
    assert {p.source for p in prompts} == {"fortunes"}
    empty = SourceRoots(stdlib=(), packages=(), docs=(), fortunes=())
    assert build_corpus(10, roots=empty) == []
