"""``EngineConfig(torch_compile=True)``: decode steps and speculative verification run through
torch.compile, and the output equals the eager engine's (fp32, tie-aware comparator).

Compiling takes a while even for a tiny model (about 20 s per graph on two cores), so one
module-scoped pair of engines serves every test here.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import engine.spec.spec_runner as spec_runner
from engine.spec.adaptive import measure_costs
from engine.spec.config import SpeculativeConfig
from tests.comparator import compare_greedy
from tests.engine.spec.test_spec_greedy import PROMPTS, engine_for, greedy, run
from tests.engine.tiny_drafts import build_random_draft
from tests.engine.tiny_models import build_tiny_llama


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("compile_target")
    # packed fp32 GEMM on (the default): multi-row products go through the opaque op
    model = build_tiny_llama(out, "gqa3_llama3rope_tied_bias_hd40", num_layers=2, vocab_size=64)
    return out, model


def assert_same_greedy(hf_model, ours: dict, refs: dict, requests: dict) -> None:
    a = [ours[r].token_ids for r in requests]
    b = [refs[r].token_ids for r in requests]
    prompts = [requests[r][0] for r in requests]
    assert a == b or compare_greedy(hf_model, prompts, a, b).num_ties <= 1


def test_compiled_decode_equals_eager(target):
    model_dir, hf_model = target
    requests = {str(i): (p, greedy(20 + 3 * i)) for i, p in enumerate(PROMPTS)}
    eager = run(engine_for(model_dir), requests)
    counters.clear()
    engine = engine_for(model_dir, torch_compile=True)  # warms up: compiles here
    # One decode row, several rows; each with a one-block table and a wider one.
    assert counters["stats"]["unique_graphs"] == 4
    calls = counters["stats"]["calls_captured"]
    compiled = run(engine, requests)
    assert_same_greedy(hf_model, compiled, eager, requests)
    one = {"0": requests["3"]}  # batch 1 alone
    assert compiled["3"].token_ids == run(engine, one)["0"].token_ids
    # Batch sizes 6 down to 1 and every context length ran on the warm-up's graphs.
    assert counters["stats"]["unique_graphs"] == 4
    assert counters["stats"]["calls_captured"] == calls


def test_compiled_verify_is_lossless(target, tmp_path):
    model_dir, hf_model = target
    requests = {str(i): (p, greedy(24)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=3)
    engine = engine_for(model_dir, spec, torch_compile=True)
    assert engine.runner.decode_model is not engine.runner.model
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens == 0  # warm-up forgot
    out = run(engine, requests)
    assert engine.spec.stats.num_draft_tokens > 0
    assert_same_greedy(hf_model, out, base, requests)


def test_logits_of_a_compiled_step_match_eager(target):
    """The verify-shaped forward (4 rows of 3 tokens after a prompt) within 1e-5."""
    model_dir, _ = target
    engine = engine_for(model_dir, torch_compile=True)
    runner = engine.runner
    for rid, prompt in enumerate(PROMPTS[:4]):
        engine.add_request(str(rid), prompt, greedy(8))
    for _ in range(3):  # prompts, then decode steps
        engine.step()
    batch = engine.scheduler.schedule()
    inputs = runner.prepare(batch, return_n_logits=1)
    with torch.inference_mode():
        eager_logits = runner.model(
            inputs.tokens,
            inputs.layout.positions,
            runner.kv_cache.layers,
            runner.backend,
            runner.backend.build_metadata(inputs.layout),
            inputs.logit_indices,
        ).logits
        compiled_logits = runner.forward(inputs).logits
    torch.testing.assert_close(compiled_logits, eager_logits, rtol=1e-5, atol=1e-5)


def test_each_engine_compiles_its_own_graphs(target, tmp_path, monkeypatch):
    """Dynamo keys graphs on the code of ``forward``, which every model in the process
    shares, and past its limit runs the forward eagerly without a word. After the engines
    above, a speculative engine with adaptive K (a graph per tapped layers, per one or
    several rows and tokens, its start-up steps included) still compiles every graph it
    needs, and stays lossless."""
    model_dir, hf_model = target
    requests = {str(i): (p, greedy(16)) for i, p in enumerate(PROMPTS)}
    base = run(engine_for(model_dir), requests)
    draft = build_random_draft(model_dir, tmp_path / "eagle3", "eagle3")
    spec = SpeculativeConfig(str(draft), num_draft_tokens=2, adaptive=True)
    measured: list[dict[int, dict[int, float]]] = []

    def spy(*args: Any, **kwargs: Any) -> dict[int, dict[int, float]]:
        measured.append(copy.deepcopy(measure_costs(*args, **kwargs)))
        return measured[-1]

    monkeypatch.setattr(spec_runner, "measure_costs", spy)
    counters.clear()
    engine = engine_for(model_dir, spec, torch_compile=True, max_num_seqs=4)
    # The engine starts with the costs measured on compiled steps: the warm-up's steps,
    # which compile the graphs (seconds each), are not fed to the estimates. (They were:
    # SmolLM2 then started with K=0 and K=2 at 5.5 and 6.6 s per step, never chosen.)
    assert engine.spec is not None and engine.spec.adaptive is not None
    assert measured and engine.spec.adaptive.costs == measured[-1]
    out = run(engine, requests)
    assert_same_greedy(hf_model, out, base, requests)
    assert counters["stats"]["unique_graphs"] >= 3
    assert not [reason for reason in counters["unimplemented"] if "recompile limit" in reason]
    assert counters["frames"]["total"] == counters["frames"]["ok"]


def test_compiled_suffix_drafts_compile_nothing_after_the_warm_up(target):
    """With suffix drafts at a fixed K no start-up measurement runs the verify steps, so the
    warm-up itself compiles them: one row verifying drafts over a table wider than a block,
    and several rows, packed or not. Then a request alone, and all of them together, make
    no new graph; output stays the target's."""
    model_dir, hf_model = target
    repeating = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20] * 2 + [5, 6]]
    prompts = PROMPTS + repeating
    requests = {str(i): (p, greedy(24)) for i, p in enumerate(prompts)}
    base = run(engine_for(model_dir), requests)
    spec = SpeculativeConfig("", num_draft_tokens=3, kind="suffix")
    counters.clear()
    engine = engine_for(model_dir, spec, torch_compile=True)
    graphs = counters["stats"]["unique_graphs"]
    alone = run(engine, {"alone": requests[str(len(PROMPTS))]})["alone"]
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0
    out = run(engine, requests)
    assert alone.token_ids == out[str(len(PROMPTS))].token_ids
    assert_same_greedy(hf_model, out, base, requests)
    assert counters["stats"]["unique_graphs"] == graphs


def test_steps_compiled_through_the_cpp_wrapper_equal_eager(target, monkeypatch):
    """``compile_cpp_wrapper``: the same graphs, their kernels called from C++."""
    model_dir, hf_model = target
    requests = {str(i): (p, greedy(12 + 2 * i)) for i, p in enumerate(PROMPTS)}
    eager = run(engine_for(model_dir), requests)
    compile_options: list[dict[str, Any]] = []
    compile = torch.compile

    def recorded(*args: Any, **kwargs: Any) -> Any:
        compile_options.append(kwargs.get("options", {}))
        return compile(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", recorded)
    engine = engine_for(model_dir, torch_compile=True, compile_cpp_wrapper=True)
    assert [o["cpp_wrapper"] for o in compile_options] == [True]
    assert_same_greedy(hf_model, run(engine, requests), eager, requests)
