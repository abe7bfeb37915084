"""`tandem loadtest` end to end against one live tiny cluster with an EAGLE-3 draft: 50
requests over gRPC and 50 over the router's own OpenAI-compatible HTTP API, each with
--output-dir, as a user runs it (`python -m tandem_client`, a fresh process). The files exist
and agree with the JSON line: counts add up, percentiles are ordered, goodput is at most
throughput, each request's token counts equal what the SDK or the openai client returns
for the same request sent again, and accepted tokens per step from the requests' usage
equal the decode worker's /metrics. Also, in this process: a sweep (its plot), the chat
endpoint, the checks that refuse a target before any load; and no torch in the harness."""

from __future__ import annotations

import asyncio
import csv
import json
import subprocess
import sys
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from loadtest.data import Lengths, random_requests
from serving.launcher import Cluster
from tandem_client import AsyncTandemClient
from tandem_client.cli import main
from tests.engine.tiny_drafts import build_random_draft
from tests.services.cluster_helpers import build_tiny_target, tiny_cluster_spec

pytestmark = pytest.mark.timeout(240)
NUM_REQUESTS = 50
OUTPUT_LEN = 6
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    torch.set_num_threads(1)  # this process shares the cores with the cluster's
    out = tmp_path_factory.mktemp("loadtest")
    target = build_tiny_target(out / "target")
    # Seed and scale as tests/services/test_cluster_tiny.py: some drafts are accepted.
    draft = build_random_draft(target, out / "eagle3", "eagle3", seed=1, std=0.3)
    spec = tiny_cluster_spec(
        target,
        tmp_path_factory.mktemp("loadtest_logs"),
        draft=str(draft),
        num_draft_tokens=3,
        adaptive_speculation=False,  # K every step: drafts are counted
    )
    with Cluster(spec) as started:
        yield started


def loadtest(*args: str) -> tuple[dict[str, Any], subprocess.CompletedProcess[str]]:
    """Run `tandem loadtest ARGS` in a fresh interpreter; its last stdout line as JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "tandem_client", "loadtest", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done


def loadtest_here(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    """`tandem loadtest ARGS` in this process (no interpreter start); its JSON line, the
    only line of stdout."""
    assert main(["loadtest", "--no-progress", *args]) == 0
    (line,) = capsys.readouterr().out.splitlines()
    result: dict[str, Any] = json.loads(line)
    return result


def check_run(run: dict[str, Any], num_requests: int) -> None:
    """The figures of a run where every request completed agree with each other."""
    assert run["num_requests"] == run["num_completed"] == num_requests, run["errors"]
    assert run["num_failed"] == 0 and run["errors"] == {}
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        f = run[key]
        assert 0 < f["p50"] <= f["p90"] <= f["p99"], (key, f)
    assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"]
    assert 0 < run["goodput"] <= run["request_throughput"]
    assert run["num_good"] <= run["num_completed"]
    assert run["request_throughput"] == pytest.approx(num_requests / run["duration_s"])
    assert run["output_throughput"] == pytest.approx(run["num_output_tokens"] / run["duration_s"])


def check_files(out: Path, summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The files of --output-dir agree with the JSON line; the per-request rows."""
    assert json.loads((out / "summary.json").read_text()) == summary
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    with (out / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(summary["runs"])
    for i, (run, csv_row) in enumerate(zip(summary["runs"], table, strict=True)):
        mine = [r for r in rows if r["run"] == i]
        assert sorted(r["index"] for r in mine) == list(range(run["num_requests"]))
        assert sum(r["ok"] for r in mine) == run["num_completed"]
        assert sum(r["good"] for r in mine) == run["num_good"]
        assert sum(r["output_tokens"] for r in mine) == run["num_output_tokens"]
        for r in mine:
            assert r["output_tokens"] == sum(n for _, n in r["chunks"])
            assert r["ttft_ms"] <= r["e2e_ms"] and len(r["itl_ms"]) <= r["output_tokens"] - 1
        assert int(csv_row["num_completed"]) == run["num_completed"]
        assert float(csv_row["output_throughput"]) == pytest.approx(run["output_throughput"])
        assert float(csv_row["ttft_ms_p99"]) == pytest.approx(run["ttft_ms"]["p99"])
    assert (out / "latency_cdf.png").read_bytes().startswith(PNG)
    return rows


def test_tandem_target(cluster: Cluster, tmp_path: Path) -> None:
    """50 requests over gRPC; each one's tokens equal the SDK's for the same request (sent
    again, all at once), and the speculative counters of their usage equal the decode
    worker's /metrics over the run."""
    out = tmp_path / "report"
    metrics_url = cluster.decode[0].metrics_url
    summary, done = loadtest(
        "--router", cluster.router_address, "--token-ids", "3:64",
        "--input-len", "12", "--range-ratio", "0.5", "--prefix-len", "8",
        "--num-prefix-groups", "2", "--output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--num-requests", str(NUM_REQUESTS), "--concurrency", "8", "--warmup", "2",
        "--slo", "ttft_ms=60000", "--slo", "tpot_ms=60000", "--output-dir", str(out),
        "--metrics-url", metrics_url,
    )  # fmt: skip
    assert summary["target"] == "tandem" and summary["model"] == "target"
    (run,) = summary["runs"]
    check_run(run, NUM_REQUESTS)
    assert run["concurrency"] == 8 and run["num_good"] == NUM_REQUESTS
    rows = check_files(out, summary)
    assert "TTFT" in done.stderr and "acc/step" in done.stderr  # the summary screen

    # The same requests again, through the SDK.
    specs = list(
        islice(
            random_requests(
                Lengths(12, 0.5), Lengths(OUTPUT_LEN, 0.5), as_token_ids=True,
                token_ids=(3, 64), prefix_len=8, num_prefix_groups=2, seed=0,
            ),
            NUM_REQUESTS,
        )
    )  # fmt: skip

    async def again() -> list[Any]:
        async with AsyncTandemClient(cluster.router_address, timeout=60) as client:
            return await asyncio.gather(
                *(
                    client.generate(s.prompt, max_tokens=s.output_len, ignore_eos=True)
                    for s in specs
                )
            )

    completions = asyncio.run(again())
    assert len({s.output_len for s in specs}) > 1  # the counts differ between requests
    for row in rows:
        usage = completions[row["index"]].usage
        assert row["max_tokens"] == specs[row["index"]].output_len
        assert row["output_tokens"] == usage.completion_tokens == row["max_tokens"]
        assert row["prompt_tokens"] == usage.prompt_tokens == len(specs[row["index"]].prompt)

    spec = run["speculative"]
    assert spec["source"] == "metrics" and spec["num_drafts"] > 0
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert spec[key] == sum(r["speculative"][key] for r in rows), key
    assert spec["accepted_per_step"] == spec["num_accepted_tokens"] / spec["num_drafts"]
    assert 0 <= spec["acceptance_rate"] <= 1


def test_openai_target(cluster: Cluster, tmp_path: Path) -> None:
    """50 requests over the router's HTTP API; each one's token counts equal the usage of
    the same request sent again by the openai client, not streamed (all at once)."""
    assert cluster.router is not None and cluster.router.base_url
    out = tmp_path / "report"
    summary, _ = loadtest(
        "--target", "openai", "--base-url", cluster.router.base_url, "--endpoint",
        "completions", "--input-len", "10", "--range-ratio", "0.5",
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--num-requests", str(NUM_REQUESTS),
        "--concurrency", "8", "--output-dir", str(out), "--no-plots",
        "--metrics-url", cluster.decode[0].metrics_url,
    )  # fmt: skip
    assert summary["target"] == "openai" and summary["model"] == "target"
    (run,) = summary["runs"]
    check_run(run, NUM_REQUESTS)
    assert run["speculative"]["source"] == "metrics" and run["speculative"]["num_drafts"] > 0
    assert not (out / "latency_cdf.png").exists()
    (out / "latency_cdf.png").write_bytes(PNG)  # as check_files expects with plots
    rows = check_files(out, summary)
    assert all(r["speculative"] is None for r in rows)  # HTTP usage carries none

    specs = list(
        islice(
            random_requests(Lengths(10, 0.5), Lengths(OUTPUT_LEN, 0.5), as_token_ids=False, seed=0),
            NUM_REQUESTS,
        )
    )

    async def again() -> list[Any]:
        assert cluster.router is not None
        client = openai.AsyncOpenAI(base_url=cluster.router.base_url, api_key="none")
        body = {"ignore_eos": True}
        try:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model="target",
                        prompt=str(s.prompt),
                        max_tokens=s.output_len,
                        temperature=0.0,
                        extra_body=body,
                    )
                    for s in specs
                )
            )
        finally:
            await client.close()

    completions = asyncio.run(again())
    for row in rows:
        usage = completions[row["index"]].usage
        assert usage is not None
        assert row["max_tokens"] == specs[row["index"]].output_len
        assert row["output_tokens"] == usage.completion_tokens == row["max_tokens"]
        assert row["prompt_tokens"] == usage.prompt_tokens


def test_rate_sweep_and_its_plot(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sweep"
    summary = loadtest_here(
        capsys, "--router", cluster.router_address, "--token-ids", "3:64", "--input-len", "6",
        "--output-len", str(OUTPUT_LEN), "--ignore-eos", "--num-requests", "4",
        "--request-rate", "20,50", "--burstiness", "0.5", "--output-dir", str(out),
    )  # fmt: skip
    assert [r["request_rate"] for r in summary["runs"]] == [20, 50]
    for run in summary["runs"]:
        check_run(run, 4)
        assert run["speculative"]["source"] == "usage"  # no --metrics-url
    check_files(out, summary)
    assert (out / "throughput_vs_rate.png").read_bytes().startswith(PNG)


def test_openai_chat(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster.router is not None and cluster.router.base_url
    summary = loadtest_here(
        capsys, "--target", "openai", "--base-url", cluster.router.base_url, "--endpoint", "chat",
        "--dataset", "builtin", "--output-len", str(OUTPUT_LEN), "--ignore-eos",
        "--num-requests", "4", "--concurrency", "2",
    )  # fmt: skip
    check_run(summary["runs"][0], 4)
    assert summary["runs"][0]["num_output_tokens"] == 4 * OUTPUT_LEN
    assert summary["runs"][0]["speculative"] is None


def failed_check(capsys: pytest.CaptureFixture[str], *args: str) -> int:
    """`tandem loadtest ARGS` (in this process) whose target fails its check: one line on
    stderr, nothing on stdout; its exit code."""
    code = main(["loadtest", "--num-requests", "1", "--no-progress", *args])
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "no load sent" in captured.err, captured.err
    assert captured.out == ""
    return code


def test_failed_checks_send_no_load(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    assert cluster.router is not None and cluster.router.base_url
    router = ("--router", cluster.router_address)
    assert failed_check(capsys, "--router", "127.0.0.1:1") == 3
    assert failed_check(capsys, *router, "--model", "nope") == 4
    assert failed_check(capsys, *router, "--metrics-url", "http://127.0.0.1:1/metrics") == 3
    http = ("--target", "openai", "--base-url", cluster.router.base_url)
    assert failed_check(capsys, *http, "--model", "nope") == 4
    assert failed_check(capsys, "--target", "openai", "--base-url", "http://127.0.0.1:1/v1") == 3


def test_harness_imports_no_torch() -> None:
    code = (
        "import sys, loadtest.cli, loadtest.runner, loadtest.targets, loadtest.output, "
        "loadtest.plots, loadtest.speculative, openai, tqdm, rich; "
        "print('torch' in sys.modules, 'transformers' in sys.modules, 'matplotlib' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["False", "False", "False"]  # matplotlib: only when plotting
