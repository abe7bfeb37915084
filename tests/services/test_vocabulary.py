"""One vocabulary across layers that may not import each other: a KV pool's names are
declared by the engine (its ``kv_pools`` keys), the KV transfer and the ledger, and must
agree, or a block pushed as one pool would be recorded as another."""

from __future__ import annotations

from pathlib import Path

from engine.llm_engine import EngineConfig, LLMEngine
from engine.spec.config import SpeculativeConfig
from kv_transfer import KvPool as TransferPool
from ledger.records import KvPool as LedgerPool
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama


def test_the_engine_the_transfer_and_the_ledger_name_the_pools_alike(tmp_path: Path) -> None:
    build_tiny_llama(
        tmp_path / "target", "gqa4_llama3rope_hd72_mlpbias", num_layers=2, vocab_size=64
    )
    build_random_draft(tmp_path / "target", tmp_path / "eagle3", "eagle3")
    config = EngineConfig(
        model=str(tmp_path / "target"),
        dtype="float32",
        kv_cache_memory=1 << 20,
        speculative=SpeculativeConfig(str(tmp_path / "eagle3"), num_draft_tokens=2),
    )
    engine_pools = set(LLMEngine(config).kv_pools)
    assert engine_pools == {"target", "draft"}
    assert {str(p) for p in TransferPool} == engine_pools
    assert {str(p) for p in LedgerPool} == engine_pools
