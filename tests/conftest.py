"""Fixtures shared by the whole suite."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M-Instruct directory (converted on first use, then cached)."""
    from engine.model_store import prepare

    return prepare("smollm2")
