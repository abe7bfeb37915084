from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.tiny_models import SHAPES, build_tiny_llama


@pytest.fixture(scope="session", params=sorted(SHAPES))
def tiny_llama(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(directory, transformers model) for each tiny shape."""
    out: Path = tmp_path_factory.mktemp(request.param)
    model = build_tiny_llama(out, request.param)
    return out, model
