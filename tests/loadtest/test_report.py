"""The report: the summary screen a person reads (rich tables), and JSON that scripts parse
(no NaN or Infinity)."""

from __future__ import annotations

import io
import json
import math

from rich.console import Console

from loadtest.metrics import RequestRecord, run_figures
from loadtest.report import print_summary, summary, to_json
from loadtest.speculative import SpecCounts


def one_run() -> dict[str, object]:
    records = [
        RequestRecord(
            0.0, [(0.25, 1), (0.625, 3), (0.75, 1)], 1.0, speculative=SpecCounts(2, 6, 3)
        ),
        RequestRecord(0.0, error="429"),
    ]
    slos = {"ttft_ms": 500.0}
    return {
        "request_rate": math.inf, "burstiness": 1.0, "concurrency": 4, "slos": slos,
        **run_figures(records, 2.0, slos),
    }  # fmt: skip


def test_summary_screen() -> None:
    paced = {**one_run(), "request_rate": 2.0}
    out = io.StringIO()
    print_summary(Console(file=out, width=80), "tandem 127.0.0.1:1 (m)", [one_run(), paced])
    lines = out.getvalue().splitlines()
    assert lines[0].strip() == "tandem 127.0.0.1:1 (m); concurrency 4; SLOs ttft_ms <= 500"
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in lines if "│" in line]
    expected = ["1/2 in 2.00 s", "1 (429: 1)", "0.50", "2.5", "0.50 (1)", "1.50"]
    assert cells[0] == ["unlimited", *expected]
    assert cells[1] == ["2/s", *expected]
    latency = cells[2:]
    assert latency[0] == ["unlimited", "TTFT", "250.0", "250.0", "250.0", "250.0"]
    assert latency[1] == ["", "ITL", "125.0", "125.0", "125.0", "125.0"]
    assert latency[4][0] == "2/s"
    assert [row[1] for row in latency] == ["TTFT", "ITL", "TPOT", "E2E"] * 2
    assert len(lines) < 30 and max(map(len, lines)) <= 80  # one screen


def test_json() -> None:
    line = to_json(summary({"target": "tandem"}, [one_run()]))
    assert "\n" not in line and "Infinity" not in line and "NaN" not in line
    parsed = json.loads(line)
    assert parsed["target"] == "tandem" and parsed["runs"][0]["request_rate"] is None
    assert parsed["runs"][0]["errors"] == {"429": 1}
    assert parsed["runs"][0]["speculative"] == {
        "source": "usage", "num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 3,
        "accepted_per_step": 1.5, "tokens_per_step": 2.5, "acceptance_rate": 0.5,
    }  # fmt: skip
