"""scripts/gpu_check, the prepared GPU check, on CPU: its dry run (every module the check
imports resolves, the gpu tests are collected, bench/gpu_step.py and bench/gpu_attention.py
run --quick, what a device call carries fits in 64 MiB), its help (how to run it, how to
leave the drafts out), and how it reads pytest's JUnit XML and a benchmark's last JSON
line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts.script_module import load_script as load_script_at

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check"


def load_script() -> ModuleType:
    return load_script_at(SCRIPT)


def test_the_dry_run_passes_on_cpu() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["ok"] is True
    assert "tests/kernels/triton/test_triton_gpu.py" in result["gpu_test_files"]
    assert 0 < result["travelling_mib"] <= 64
    assert "bench/gpu_step.py --quick: ran on CPU" in done.stderr
    assert "bench/gpu_attention.py --quick: ran on CPU" in done.stderr
    assert "bench/cuda_ipc.py: refused on CPU as it should be" in done.stderr
    # The collection ran in a child that had every package: those the GPU image lacks are
    # named (tandem's own modules never are).
    assert all(not name.startswith("tandem") for name in result["missing_on_gpu"])


@pytest.mark.slow
def test_the_check_itself_on_cpu_leaves_a_summary_within_its_budget(tmp_path: Path) -> None:
    """The GPU run's code path, here: the gpu tests skip, the full benchmark is cut off at
    the budget, and what is left is a summary with every key (None where not measured),
    within the files a GPU run brings back."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--budget-s", "60"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert time.monotonic() - started < 90
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(summary) >= {
        "device",
        "roofline_fraction_8b_bs1",
        "spec_step_over_plain_step_8b_bs1",
        "tandem_tok_s_smollm2_bs1",
        "hf_tok_s_smollm2_bs1",
        "cuda_ipc_over_d2d",
    }
    assert summary["versions"]["cuda_available"] is False and summary["device"] is None
    tests = summary["phases"]["gpu_tests"]
    assert tests["exit"] == 0 and tests["tests"] > 0 and tests["skipped"] == tests["tests"]
    assert summary["phases"]["gpu_step"]["exit"] is None  # cut off at the budget
    assert summary["phases"]["cuda_ipc"]["exit"] == 2  # no CUDA device: said, not measured
    assert summary["cuda_ipc_over_d2d"] is None
    assert summary["phases"]["gpu_attention"]["exit"] == 2  # on CPU only with --quick
    files = list(tmp_path.iterdir())
    assert len(files) <= 8 and all(f.stat().st_size < 16 << 20 for f in files)
    assert json.loads(done.stdout.strip().splitlines()[-1])["device"] is None


def test_help_says_how_to_run_it_and_how_to_leave_the_drafts_out() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert "python3 scripts/gpu_check --out $OUT" in done.stdout
    assert "git rm -r -q --cached drafts" in done.stdout
    assert 'carry [".whl"]' in done.stdout


def test_without_an_output_folder_it_says_what_it_needs(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 2
    assert "--out DIR (or $OUT) is needed" in done.stderr


def test_junit_counts_and_the_last_json_line(tmp_path: Path) -> None:
    gpu_check = load_script()
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert gpu_check.junit_counts(xml) == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "failing": ["tests.a::test_bad"],
    }
    assert gpu_check.junit_counts(tmp_path / "none.xml") == {"junit": "missing"}
    log = tmp_path / "bench.log"
    log.write_text('warming up\n{"a": 1}\n{"device": "H200", "x": 2}\n[done]\n')
    assert gpu_check.last_json(log) == {"device": "H200", "x": 2}
    assert gpu_check.missing_on_gpu(["torch", "xgrammar", "tandem-client", "grpcio"]) == [
        "xgrammar",
        "grpcio",
    ]
