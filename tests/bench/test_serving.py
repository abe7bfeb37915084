"""``bench/serving.py``: its refusals before it starts anything, and how it counts failures."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "serving.py"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_without_llama_server_it_says_how_to_build_it_and_exits_2(tmp_path: Path) -> None:
    done = run("--quick", "--llama-dir", str(tmp_path))
    assert done.returncode == 2
    assert done.stdout == ""
    assert f"{tmp_path}/bin/llama-server" in done.stderr
    assert f"{tmp_path}/gguf/smollm2-bf16.gguf" in done.stderr
    assert "smollm2-q4_1.gguf" not in done.stderr  # --quick runs the bf16 GGUF only
    assert "scripts/build_llama_server --version 0.3.36" in done.stderr


def test_an_unknown_side_is_refused_naming_the_choices() -> None:
    done = run("--sides", "tandem,vllm")
    assert done.returncode == 2
    assert "--sides: unknown ['vllm']" in done.stderr
    choices = "tandem, tandem_eagle3, tandem_suffix, tandem_colocated, tandem_colocated_eagle3"
    assert choices in done.stderr


def load_serving_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_serving", ROOT / "bench" / "serving.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_tandem(tmp_path: Path, runs: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``tandem`` on PATH whose ``loadtest`` prints a table line, then ``runs``' JSON."""
    script = tmp_path / "tandem"
    script.write_text(f"#!/bin/sh\necho 'a table'\necho '{{\"runs\": {runs}}}'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")


def test_a_failed_request_is_counted_in_failed_not_an_abort(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = load_serving_module()
    run_json = (
        '[{"num_completed": 15, "num_failed": 1, "errors": {"connection": 1},'
        ' "output_throughput": 54.4, "ttft_ms": {"p50": 113.8}}]'
    )
    fake_tandem(tmp_path, run_json, monkeypatch)
    [run] = serving.loadtest("http://127.0.0.1:1/v1", [], "llamacpp_bf16")
    result: dict = {"failed": {}}
    serving.record(result, "llamacpp_bf16", 1, run)
    assert result == {
        "failed": {"llamacpp_bf16_c1": {"connection": 1}},
        "llamacpp_bf16_tok_s_c1": 54.4,
        "llamacpp_bf16_ttft_ms_p50_c1": 113.8,
    }


def test_a_level_where_every_request_failed_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving = load_serving_module()
    run_json = '[{"num_completed": 0, "num_failed": 16, "errors": {"503": 16}}]'
    fake_tandem(tmp_path, run_json, monkeypatch)
    with pytest.raises(RuntimeError, match=r"tandem: every request failed: \{'503': 16\}"):
        serving.loadtest("http://127.0.0.1:1/v1", [], "tandem")


def test_the_plain_ratio_leaves_the_eagle3_sides_out() -> None:
    """``best`` takes every bf16 Tandem side that ran, ``plain`` only those without a
    draft; the Q4_1 sides go against llama.cpp's Q4_1, the better of the two; a level
    without a peer gets no ratio to it."""
    serving = load_serving_module()
    sides = (
        "tandem",
        "tandem_eagle3",
        "tandem_colocated",
        "tandem_q4",
        "tandem_colocated_q4",
        "llamacpp_bf16",
        "llamacpp_q4",
    )
    result = {
        "tandem_tok_s_c1": 40.0,
        "tandem_eagle3_tok_s_c1": 60.0,
        "tandem_colocated_tok_s_c1": 30.0,
        "llamacpp_bf16_tok_s_c1": 50.0,
        "tandem_tok_s_c8": 90.0,
        "tandem_eagle3_tok_s_c8": 80.0,
        "tandem_colocated_tok_s_c8": 120.0,
        "llamacpp_bf16_tok_s_c8": 100.0,
        "llamacpp_bf16_tok_s_c32": None,
        "tandem_q4_tok_s_c1": 70.0,  # faster than every bf16 side: not in "best"
        "tandem_colocated_q4_tok_s_c1": 90.0,
        "llamacpp_q4_tok_s_c1": 100.0,
        "tandem_q4_tok_s_c32": 200.0,
        "tandem_colocated_q4_tok_s_c32": None,  # failed at this level
        "llamacpp_q4_tok_s_c32": 250.0,
    }
    assert serving.ratios_to_llamacpp(result, sides, [1, 8, 32]) == {
        "tandem_best_over_llamacpp_bf16_c1": 1.2,
        "tandem_plain_over_llamacpp_bf16_c1": 0.8,
        "tandem_q4_over_llamacpp_q4_c1": 0.9,
        "tandem_best_over_llamacpp_bf16_c8": 1.2,
        "tandem_plain_over_llamacpp_bf16_c8": 1.2,
        "tandem_q4_over_llamacpp_q4_c32": 0.8,
    }


def test_paired_runs_give_medians_and_the_median_of_the_pairs_ratios() -> None:
    serving = load_serving_module()

    def run(tok_s: float, ttft: float) -> dict[str, object]:
        return {"output_throughput": tok_s, "ttft_ms": {"p50": ttft}, "num_failed": 0, "errors": {}}

    runs = {
        "tandem": [run(100, 50), run(80, 70), run(90, 60)],
        "tandem_eagle3": [run(110, 40), run(72, 90), run(99, 65)],  # 1.1, 0.9, 1.1
    }
    result: dict[str, object] = {"failed": {}}
    serving.record_pairs(result, runs, 8, "_edit")
    assert result["tandem_tok_s_c8_edit"] == 90 and result["tandem_ttft_ms_p50_c8_edit"] == 60
    assert result["tandem_eagle3_tok_s_c8_edit"] == 99
    # the median of the pairs' ratios, not the ratio of the medians (99 / 90 = 1.1 too)
    assert result["tandem_eagle3_over_tandem_c8_edit"] == 1.1
    runs["tandem_eagle3"][2] = run(81, 65)  # 0.9: the pairs now say 1.1, 0.9, 0.9
    serving.record_pairs(result, runs, 8, "")
    assert result["tandem_eagle3_over_tandem_c8"] == 0.9
    assert "tandem_eagle3_tau_c8" not in result  # no speculative figures in these runs
    # a failure in any of the runs is counted, not only the median run's
    runs["tandem"][0] = {**run(100, 50), "num_failed": 1, "errors": {"connection": 1}}
    runs["tandem"][1] = {**run(80, 70), "num_failed": 2, "errors": {"connection": 2}}
    serving.record_pairs(result, runs, 1, "")
    assert result["failed"] == {"tandem_c1": {"connection": 3}}
