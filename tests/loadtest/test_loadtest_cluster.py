"""`tandem loadtest` end to end, as a user runs it (the installed command, a fresh
process), against a live tiny cluster: over gRPC (token ids) and over the router's own
OpenAI-compatible HTTP API (completions and chat); every request completes with exactly
--output-len tokens (EOS ignored), the JSON line and --output agree, a sweep reports each
rate; the harness imports no torch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from serving.launcher import Cluster
from tests.services.cluster_helpers import build_tiny_target, tiny_cluster_spec

pytestmark = pytest.mark.timeout(180)
OUTPUT_LEN = 5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    target = build_tiny_target(tmp_path_factory.mktemp("loadtest") / "target")
    spec = tiny_cluster_spec(target, tmp_path_factory.mktemp("loadtest_logs"))
    with Cluster(spec) as started:
        yield started


def loadtest(*args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run `tandem loadtest ARGS` in a fresh interpreter; its last stdout line as JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem_client", "loadtest", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def check_run(run: dict[str, Any], num_requests: int) -> None:
    assert run["num_requests"] == run["num_completed"] == num_requests, run["errors"]
    assert run["num_failed"] == 0 and run["errors"] == {}
    assert run["num_output_tokens"] == num_requests * OUTPUT_LEN
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        f = run[key]
        assert 0 < f["p50"] <= f["p90"] <= f["p99"], (key, f)
    assert 0 < run["goodput"] <= run["request_throughput"]


def test_tandem_target(cluster: Cluster, tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    summary, done = loadtest(
        "--router", cluster.router_address, "--token-ids", "3:64",
        "--input-len", "12", "--prefix-len", "8",
        "--num-prefix-groups", "2", "--output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--num-requests", "8", "--concurrency", "4", "--warmup", "2",
        "--slo", "ttft_ms=60000", "--output", str(out),
    )  # fmt: skip
    assert summary["target"] == "tandem" and summary["model"] == "target"
    assert len(summary["runs"]) == 1
    run = summary["runs"][0]
    check_run(run, 8)
    assert run["concurrency"] == 4 and run["num_good"] == 8
    assert json.loads(out.read_text()) == summary
    assert "TTFT" in done.stdout and "goodput" in done.stdout


def test_tandem_rate_sweep(cluster: Cluster) -> None:
    summary, _ = loadtest(
        "--router", cluster.router_address, "--token-ids", "3:64", "--input-len", "6",
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--num-requests", "4",
        "--request-rate", "20,50", "--burstiness", "0.5",
    )  # fmt: skip
    assert [r["request_rate"] for r in summary["runs"]] == [20, 50]
    for run in summary["runs"]:
        check_run(run, 4)


@pytest.mark.parametrize(
    "extra", [("--endpoint", "completions"), ("--endpoint", "chat", "--dataset", "builtin")]
)
def test_openai_target(cluster: Cluster, extra: tuple[str, ...]) -> None:
    assert cluster.router is not None and cluster.router.base_url
    summary, _ = loadtest(
        "--target", "openai", "--base-url", cluster.router.base_url, *extra,
        "--input-len", "10", "--output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--num-requests", "6", "--concurrency", "3",
    )  # fmt: skip
    assert summary["target"] == "openai" and summary["model"] == "target"
    check_run(summary["runs"][0], 6)


def failed_check(*args: str) -> subprocess.CompletedProcess[str]:
    """`tandem loadtest ARGS` whose target fails its check: one line on stderr, no JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem_client", "loadtest", "--num-requests", "1", *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.stderr.count("\n") == 1 and "no load sent" in done.stderr, done.stderr
    assert done.stdout == ""
    return done


def test_failed_checks_send_no_load(cluster: Cluster) -> None:
    assert cluster.router is not None and cluster.router.base_url
    assert failed_check("--router", "127.0.0.1:1").returncode == 3
    assert failed_check("--router", cluster.router_address, "--model", "nope").returncode == 4
    http = ("--target", "openai", "--base-url", cluster.router.base_url)
    assert failed_check(*http, "--model", "nope").returncode == 4
    assert failed_check("--target", "openai", "--base-url", "http://127.0.0.1:1/v1").returncode == 3


def test_harness_imports_no_torch() -> None:
    code = (
        "import sys, loadtest.cli, loadtest.runner, loadtest.targets, openai, tqdm; "
        "print('torch' in sys.modules, 'transformers' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False"]
