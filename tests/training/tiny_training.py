"""A tiny target, its own greedy continuations and the trainer's settings for it, shared by
the draft trainer's tests."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import read_hf_config
from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from engine.spec.config import SpeculativeConfig
from engine.spec.stats import SpecDecodeStats
from tests.engine.tiny_models import build_tiny_llama
from training.data import SequenceSet
from training.generation import generate_continuations
from training.train_draft import TrainConfig

VOCAB = 128
NEW_TOKENS = 40
K = 4  # drafts per step when serving (DFlash: its block of 4, so 3)


def build_target(out: Path, shape: str) -> Path:
    build_tiny_llama(out, shape, vocab_size=VOCAB, num_layers=2)
    return out


def tiny_data(out: Path) -> tuple[Path, SequenceSet]:
    """A tiny target and its own fp32 greedy continuations of a few random prompts: loops
    of period 1 to 13, so a draft must learn which token follows which in context."""
    target = build_target(out, "mha_plain")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (8,), generator=gen).tolist() for _ in range(9)]
    continuations, _ = generate_continuations(
        target, prompts, NEW_TOKENS, dtype="float32", log=lambda _: None
    )
    data = SequenceSet(
        [p + c for p, c in zip(prompts, continuations, strict=True)], [len(p) for p in prompts]
    )
    return target, data


def config(target: Path, out: Path, kind: str, **overrides: object) -> TrainConfig:
    values: dict[str, object] = dict(
        target=str(target),
        kind=kind,
        out=str(out),
        epochs=20,
        batch_size=2,
        lr=2e-2,
        anchors_per_seq=0,
        intermediate_size=64,
        num_layers=1,
        block_size=4,
        draft_vocab_size=96,
        val_fraction=0.1,
        threads=1,
    )
    values.update(overrides)
    return TrainConfig(**values)  # type: ignore[arg-type]


def run_engine(
    target: Path, prompt: list[int], draft: Path | None, max_tokens: int = NEW_TOKENS
) -> tuple[list[int], SpecDecodeStats]:
    spec = None if draft is None else SpeculativeConfig(draft_model=str(draft), num_draft_tokens=K)
    engine = LLMEngine(
        EngineConfig(model=str(target), dtype="float32", kv_cache_memory=8 << 20, speculative=spec)
    )
    engine.add_request("r", prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
    return tokens, engine.spec.stats if engine.spec is not None else SpecDecodeStats()


def load_hf(target: Path) -> dict[str, object]:
    return read_hf_config(target)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)
