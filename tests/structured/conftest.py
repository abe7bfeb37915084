"""SmolLM2-135M in fp32 with and without its EAGLE-3 draft, shared by the module's tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import StructuredOutput
from engine.spec.config import SpeculativeConfig
from tests.engine.tiny_drafts import build_random_draft

COMMITTED = Path(__file__).resolve().parents[2] / "drafts" / "smollm2"

# Bounded: a 135M model loops inside open strings, so lengths and choices are capped.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PERSON_SPEC = StructuredOutput("json_schema", json.dumps(PERSON))
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PHONE_SPEC = StructuredOutput("regex", PHONE)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="session")
def eagle3_dir(smollm2_dir, tmp_path_factory) -> Path:
    if (COMMITTED / "eagle3" / "config.json").is_file():
        return COMMITTED / "eagle3"
    out = tmp_path_factory.mktemp("eagle3")
    return build_random_draft(smollm2_dir, out, "eagle3", std=0.02, intermediate_size=256)


def make_engine(model: Path, tokenizer, draft: Path | None = None, k: int = 3) -> LLMEngine:
    spec = None if draft is None else SpeculativeConfig(str(draft), num_draft_tokens=k)
    config = EngineConfig(
        model=str(model),
        dtype="float32",
        kv_cache_memory=96 << 20,
        speculative=spec,
    )
    return LLMEngine(config, tokenizer)


@pytest.fixture(scope="session")
def plain_engine(smollm2_dir, tokenizer) -> LLMEngine:
    return make_engine(smollm2_dir, tokenizer)


@pytest.fixture(scope="session")
def spec_engine(smollm2_dir, tokenizer, eagle3_dir) -> LLMEngine:
    return make_engine(smollm2_dir, tokenizer, eagle3_dir)
