"""The report: a table a person reads, and JSON that scripts parse (no NaN or Infinity)."""

from __future__ import annotations

import json
import math

from loadtest.metrics import RequestRecord, run_figures
from loadtest.report import summary, table, to_json


def test_table_and_json() -> None:
    records = [
        RequestRecord(0.0, [(0.25, 1), (0.625, 3), (0.75, 1)], 1.0),
        RequestRecord(0.0, error="429"),
    ]
    slos = {"ttft_ms": 500.0}
    run = {
        "request_rate": math.inf, "burstiness": 1.0, "concurrency": 4, "slos": slos,
        **run_figures(records, 2.0, slos),
    }  # fmt: skip
    text = table(run)
    assert "rate unlimited, concurrency 4" in text
    assert "completed 1/2 requests in 2.00 s; failed 1 (429: 1)" in text
    assert "1 requests within ttft_ms <= 500" in text
    assert text.splitlines()[-3].split() == ["ITL", "125.0", "125.0", "125.0", "125.0"]
    line = to_json(summary({"target": "tandem"}, [run]))
    assert "\n" not in line and "Infinity" not in line and "NaN" not in line
    parsed = json.loads(line)
    assert parsed["target"] == "tandem" and parsed["runs"][0]["request_rate"] is None
    assert parsed["runs"][0]["errors"] == {"429": 1}
