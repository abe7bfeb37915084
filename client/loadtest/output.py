"""A load test's files in ``--output-dir``: every request of every run as one JSON line
(``requests.jsonl``), the summary the last stdout line carries (``summary.json``), one CSV
row of figures per run (``summary.csv``), and the plots (``loadtest.plots``)."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from loadtest.metrics import RequestRecord, e2e, itls, meets_slos, tpot, ttft
from loadtest.report import to_json

REQUESTS_FILE = "requests.jsonl"
SUMMARY_FILE = "summary.json"
CSV_FILE = "summary.csv"
LATENCY_KEYS = ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")
SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_step")


def request_row(
    run_index: int, record: RequestRecord, run_start: float, slos: Mapping[str, float]
) -> dict[str, Any]:
    """One request as the JSONL has it: times in ms from the run's first start; the chunks
    as [arrival_ms, num_tokens]; the latencies (None where not defined, all None for a
    failed request) and whether it met the SLOs."""

    def ms(seconds: float | None) -> float | None:
        return None if seconds is None else seconds * 1000

    is_ok = record.is_ok
    spec = record.speculative
    return {
        "run": run_index,
        "index": record.index,
        "start_ms": ms(record.start - run_start),
        "ok": is_ok,
        "error": record.error if record.error is not None else (None if is_ok else "INCOMPLETE"),
        "max_tokens": record.max_tokens,
        "prompt_tokens": record.prompt_tokens,
        "output_tokens": record.num_output_tokens,
        "chunks": [[ms(at - run_start), n] for at, n in record.chunks],
        "ttft_ms": ms(ttft(record)) if is_ok else None,
        "tpot_ms": ms(tpot(record)) if is_ok else None,
        "e2e_ms": ms(e2e(record)) if is_ok else None,
        "itl_ms": [ms(gap) for gap in itls(record)] if is_ok else [],
        "good": is_ok and meets_slos(record, slos),
        "speculative": None if spec is None else {k: getattr(spec, k) for k in SPEC_KEYS[:3]},
    }


def csv_row(run: Mapping[str, Any]) -> dict[str, Any]:
    """One run's figures flat: the latency summaries as ``ttft_ms_p50``..., the errors as
    ``code:n;...``, the speculative figures as ``spec_*`` (empty without them)."""
    row: dict[str, Any] = {
        key: run[key]
        for key in (
            "request_rate", "burstiness", "concurrency", "num_requests", "num_completed",
            "num_failed", "num_output_tokens", "num_prompt_tokens", "duration_s",
            "request_throughput", "output_throughput", "goodput", "num_good",
        )
    }  # fmt: skip
    row["errors"] = ";".join(f"{code}:{n}" for code, n in run["errors"].items())
    for key in LATENCY_KEYS:
        for stat, value in run[key].items():
            row[f"{key}_{stat}"] = value
    spec = run.get("speculative") or {}
    for key in SPEC_KEYS:
        row[f"spec_{key}"] = spec.get(key)
    return row


def write_outputs(
    out_dir: Path,
    summary: Mapping[str, Any],
    records: Sequence[Sequence[RequestRecord]],
    run_starts: Sequence[float],
) -> list[Path]:
    """Write the JSONL, the summary JSON and the CSV for ``summary``'s runs, whose requests
    are ``records`` (one list per run, started at ``run_starts``); the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = summary["runs"]
    requests_path = out_dir / REQUESTS_FILE
    with requests_path.open("w", encoding="utf-8") as f:
        for i, (run, run_records, start) in enumerate(zip(runs, records, run_starts, strict=True)):
            for record in run_records:
                f.write(to_json(request_row(i, record, start, run["slos"])) + "\n")
    summary_path = out_dir / SUMMARY_FILE
    summary_path.write_text(to_json(summary) + "\n", encoding="utf-8")
    csv_path = out_dir / CSV_FILE
    rows = [csv_row(run) for run in runs]
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return [requests_path, summary_path, csv_path]
