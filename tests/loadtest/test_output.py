"""The files of --output-dir from hand-made records: one JSONL row per request agreeing with
its record, the summary JSON as the JSON line, a CSV row per run, and the PNG plots (a sweep
plot only for two or more finite rates)."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from loadtest.metrics import RequestRecord, run_figures
from loadtest.output import write_outputs
from loadtest.plots import write_plots
from loadtest.report import summary, to_json
from loadtest.speculative import SpecCounts

PNG = b"\x89PNG\r\n\x1a\n"
SLOS = {"ttft_ms": 500.0}


def records(start: float) -> list[RequestRecord]:
    """Two completed requests (one of a 3-token chunk, with speculative usage) and one
    refused, started at ``start``."""
    spec = SpecCounts(2, 6, 3)
    return [
        RequestRecord(start, [(start + 0.25, 1), (start + 0.625, 3), (start + 0.75, 1)],
                      start + 1.0, prompt_tokens=7, speculative=spec, index=0, max_tokens=5),
        RequestRecord(start + 0.5, [(start + 1.5, 2)], start + 1.5, prompt_tokens=4, index=1,
                      max_tokens=2),
        RequestRecord(start + 0.75, error="429", index=2, max_tokens=5),
    ]  # fmt: skip


def run(rate: float, rs: list[RequestRecord]) -> dict[str, object]:
    shape = {"request_rate": rate, "burstiness": 1.0, "concurrency": None, "slos": SLOS}
    return {**shape, **run_figures(rs, 2.0, SLOS)}


def test_files(tmp_path: Path) -> None:
    by_run = [records(10.0), records(20.0)]
    runs = [run(math.inf, by_run[0]), run(4.0, by_run[1])]
    result = summary({"target": "tandem"}, runs)
    out = tmp_path / "new" / "dir"
    written = write_outputs(out, result, by_run, [10.0, 20.0])
    assert [p.name for p in written] == ["requests.jsonl", "summary.json", "summary.csv"]
    assert (out / "summary.json").read_text() == to_json(result) + "\n"

    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert [(r["run"], r["index"]) for r in rows] == [(i, j) for i in (0, 1) for j in (0, 1, 2)]
    first, slow, refused = rows[3:]
    assert first == {
        "run": 1, "index": 0, "start_ms": 0.0, "ok": True, "error": None, "max_tokens": 5,
        "prompt_tokens": 7, "output_tokens": 5,
        "chunks": [[250.0, 1], [625.0, 3], [750.0, 1]],
        "ttft_ms": 250.0, "tpot_ms": 187.5, "e2e_ms": 1000.0, "itl_ms": [125.0] * 4,
        "good": True,
        "speculative": {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3},
    }  # fmt: skip
    assert slow["ttft_ms"] == 1000.0 and slow["good"] is False  # misses the TTFT SLO
    assert slow["speculative"] is None and slow["start_ms"] == 500.0
    assert refused["ok"] is False and refused["error"] == "429" and refused["ttft_ms"] is None
    assert sum(r["output_tokens"] for r in rows[3:]) == runs[1]["num_output_tokens"] == 7

    with (out / "summary.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [row["request_rate"] for row in table] == ["inf", "4.0"]
    row = table[1]
    assert (row["num_requests"], row["num_completed"], row["num_good"]) == ("3", "2", "1")
    assert row["errors"] == "429:1" and row["ttft_ms_p50"] == "625.0"
    assert row["spec_num_drafts"] == "2" and row["spec_accepted_per_step"] == "1.5"


def test_plots(tmp_path: Path) -> None:
    by_run = [records(0.0), records(5.0), records(9.0)]
    runs = [run(math.inf, by_run[0]), run(2.0, by_run[1]), run(1.0, by_run[2])]
    written = write_plots(tmp_path, runs, by_run)
    assert [p.name for p in written] == ["latency_cdf.png", "throughput_vs_rate.png"]
    assert all(p.read_bytes().startswith(PNG) for p in written)
    one_rate = tmp_path / "one"
    one_rate.mkdir()
    assert [p.name for p in write_plots(one_rate, runs[:2], by_run[:2])] == ["latency_cdf.png"]
