"""What an engine is built from: an engine told not to build the CPU kernels (as serving
workers are) never compiles, says so in one line, and runs on aten with the same tokens."""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch
from torch.utils import cpp_extension

from engine.llm_engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from kernels.cpu import extension, paged_attention
from tests.comparator import compare_greedy
from tests.engine.tiny_models import build_tiny_llama

PROMPTS = [[1, 2, 3], [5, 8, 13, 21, 34, 55], [7]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tiny")
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out, model


def greedy_tokens(model_dir: Path) -> list[list[int]]:
    """A serving worker's engine (building forbidden) in fp32, each prompt's 12 greedy tokens."""
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            kv_cache_memory=1 << 21,
            block_size=4,
            build_cpu_kernels=False,
        )
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("why", ["missing", "stale"])
def test_an_engine_forbidden_to_build_runs_on_aten_with_the_built_paths_tokens(
    tiny, why: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    model_dir, model = tiny
    monkeypatch.delenv(extension.DISABLE_ENV, raising=False)
    monkeypatch.setattr(cpp_extension, "load", None)  # any build would fail the engine
    monkeypatch.setattr(extension, "_loaded", None)  # this process's answer, asked afresh
    built = greedy_tokens(model_dir)
    if not paged_attention.available():
        pytest.skip(f"the CPU kernels are not built here: `{extension.BUILD_COMMAND}`")

    # A separate build directory (none built there), or the real one's stamp not matching.
    changed = {"build_root": tmp_path} if why == "missing" else {"cflags": ("-DCHANGED",)}
    monkeypatch.setattr(extension, "KERNELS", dataclasses.replace(extension.KERNELS, **changed))
    monkeypatch.setattr(extension, "_loaded", None)
    caplog.set_level(logging.INFO)
    on_aten = greedy_tokens(model_dir)
    assert not paged_attention.available()
    (line,) = [r.getMessage() for r in caplog.records if r.name == extension.__name__]
    assert why in line and extension.BUILD_COMMAND in line, line
    with torch.inference_mode():
        compare_greedy(model, PROMPTS, on_aten, built)
