"""Each drafter declares what peers must agree on (``signature``) and how many decoder layers
its kind allows (``max_num_layers``), so that no caller branches on its kind."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch

from engine.models.llama3 import Llama3Model
from engine.registry import load_model
from engine.spec.drafters import DraftSignature, new_drafter
from tests.engine.tiny_drafts import draft_hf_config
from tests.engine.tiny_models import build_tiny_llama


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("target")
    build_tiny_llama(out, "mha_plain", vocab_size=64, num_layers=3)
    return out


@pytest.mark.parametrize(
    ("kind", "expected", "max_num_layers"),
    [
        ("eagle", DraftSignature("eagle"), 1),
        ("eagle3", DraftSignature("eagle3", target_layer_ids=(0, 2)), 1),
        ("dflash", DraftSignature("dflash", 4, 63, (0, 2)), None),
    ],
)
def test_signature_and_layer_limit(
    target_dir: Path, kind: str, expected: DraftSignature, max_num_layers: int | None
) -> None:
    target = cast(Llama3Model, load_model(target_dir, dtype="float32")[0])
    hf = draft_hf_config(target_dir, kind)
    drafter = new_drafter(kind, hf, target, torch.device("cpu"))
    assert drafter.signature() == expected
    assert drafter.max_num_layers == type(drafter).max_num_layers == max_num_layers
