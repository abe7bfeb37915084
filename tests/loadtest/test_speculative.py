"""Accepted tokens per step: the counters parsed from a decode worker's real exposition
(serving.metrics), read over HTTP before and after a run, summed over workers; the ratios;
the command's scrapes around each run of a sweep (against a fake target)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
from prometheus_client import generate_latest

from loadtest import cli
from loadtest.speculative import SpecCounts, parse_counters, scrape, total
from serving.metrics import DecodeFigures, DecodeMetrics
from tandem_client.cli import main
from tests.loadtest.test_runner import FakeTarget


def exposition(drafts: int, draft_tokens: int, accepted: int) -> str:
    metrics = DecodeMetrics()
    figures = DecodeFigures(
        num_drafts=drafts, num_draft_tokens=draft_tokens, num_accepted_tokens=accepted
    )
    metrics.read_figures_from(lambda: figures)
    return generate_latest(metrics.registry).decode()


def test_parses_the_decode_workers_counters() -> None:
    assert parse_counters(exposition(7, 21, 12)) == SpecCounts(7, 21, 12)
    assert parse_counters("# no speculative counters\nother_total 3\n") == SpecCounts()
    two_roles = 'tandem_spec_drafts_total{role="a"} 2.0\ntandem_spec_drafts_total{role="b"} 3.0\n'
    assert parse_counters(two_roles).num_drafts == 5


def test_figures() -> None:
    figures = SpecCounts(num_drafts=4, num_draft_tokens=12, num_accepted_tokens=6).figures(
        "metrics"
    )
    assert figures == {
        "source": "metrics", "num_drafts": 4, "num_draft_tokens": 12, "num_accepted_tokens": 6,
        "accepted_per_step": 1.5, "tokens_per_step": 2.5, "acceptance_rate": 0.5,
    }  # fmt: skip
    none = SpecCounts().figures("usage")
    assert none["accepted_per_step"] is None and none["acceptance_rate"] is None
    assert total([None, SpecCounts(1, 3, 2), SpecCounts(2, 6, 1)]) == SpecCounts(3, 9, 3)
    assert total([None, None]) is None
    assert SpecCounts(5, 15, 9) - SpecCounts(1, 3, 2) == SpecCounts(4, 12, 7)


@pytest.fixture
def workers() -> Iterator[tuple[list[str], list[list[int]]]]:
    """Two /metrics servers whose counters the test sets (drafts, draft tokens, accepted)."""
    counters = [[0, 0, 0], [0, 0, 0]]
    servers = []
    for i in range(2):

        class Handler(BaseHTTPRequestHandler):
            index = i

            def do_GET(self) -> None:
                body = exposition(*counters[self.index]).encode()
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    yield [f"http://127.0.0.1:{s.server_port}/metrics" for s in servers], counters
    for server in servers:
        server.shutdown()
        server.server_close()


def test_scrape_before_and_after(workers: tuple[list[str], list[list[int]]]) -> None:
    urls, counters = workers
    counters[0][:] = [10, 30, 20]  # before the run (start-up, warm-up, other clients)
    before = scrape(urls)
    assert before == SpecCounts(10, 30, 20)
    counters[0][:] = [14, 42, 26]
    counters[1][:] = [3, 9, 0]
    assert scrape(urls) - before == SpecCounts(7, 21, 6)


def test_scrape_names_the_url_that_does_not_answer() -> None:
    with pytest.raises(OSError, match=r"http://127\.0\.0\.1:1/metrics did not answer"):
        scrape(["http://127.0.0.1:1/metrics"], timeout_s=2)


class CountingHandler(BaseHTTPRequestHandler):
    """/metrics whose counters grow by (2, 6, 3) per scrape; 500 from scrape ``fail_from``."""

    num_scrapes = 0
    fail_from = 1000

    def do_GET(self) -> None:
        CountingHandler.num_scrapes += 1
        n = CountingHandler.num_scrapes
        if n >= self.fail_from:
            self.send_error(500)
            return
        body = exposition(2 * n, 6 * n, 3 * n).encode()
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("fail_from", [1000, 3])
def test_the_command_reads_metrics_around_each_run(
    fail_from: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Scrapes: the check, then before and after each run; a worker that stops answering
    after the load began costs the figure (a warning), not the report."""
    monkeypatch.setattr(cli, "open_target", lambda args, parser: FakeTarget(step_s=0.001))
    monkeypatch.setattr(CountingHandler, "num_scrapes", 0)
    monkeypatch.setattr(CountingHandler, "fail_from", fail_from)
    server = HTTPServer(("127.0.0.1", 0), CountingHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/metrics"
    try:
        code = main(
            ["loadtest", "--no-progress", "--num-requests", "3", "--request-rate", "inf,inf",
             "--metrics-url", url]
        )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert code == 0
    captured = capsys.readouterr()
    runs = json.loads(captured.out.splitlines()[-1])["runs"]
    if fail_from > 10:
        assert CountingHandler.num_scrapes == 5
        assert [run["speculative"] for run in runs] == [SpecCounts(2, 6, 3).figures("metrics")] * 2
    else:
        assert [run["speculative"] for run in runs] == [None, None]
        assert "warning: --metrics-url" in captured.err and "not reported" in captured.err
