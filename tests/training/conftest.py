"""The tiny target and its data, built once for the draft trainer's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.training.tiny_training import tiny_data
from training.data import SequenceSet


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SequenceSet]:
    """A tiny target and its own fp32 greedy continuations (``tiny_data``)."""
    return tiny_data(tmp_path_factory.mktemp("target"))
