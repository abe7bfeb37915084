"""Prometheus metrics of the router, prefill and decode workers (`tandem_*`, label `role`).

Each component owns one ``*Metrics`` object with a registry of its own (no module-level
global), serves it on ``--metrics-port`` (0: off) and passes it to its servicer. Redis
round trips are timed by wrapping the client's ``execute_command``, through which every
ledger call (scripts included) goes.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from serving.loop_watchdog import LoopWatchdog

# Latencies from 1 ms to 2 min; ITL and Redis round trips need the low end.
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip
REDIS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class Metrics:
    """What every component exports: Redis round trips, event-loop lag."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        self.redis_seconds = self._histogram(
            "tandem_redis_seconds",
            "Round trip of one Redis command (ledger calls)",
            ["command"],
            buckets=REDIS_BUCKETS,
        )
        self.loop_lag_seconds = self._histogram(
            "tandem_event_loop_lag_seconds",
            "How late the event loop ran a tick due every 50 ms (a stall delays every RPC, "
            "stream and heartbeat of the component)",
        )
        self._server: Any = None
        self._watchdog: LoopWatchdog | None = None

    def watch_loop(self) -> None:
        """Measures the running event loop's lag, and logs its stalls with their cause
        (serving.loop_watchdog), until ``close``."""
        self._watchdog = LoopWatchdog(self.loop_lag_seconds.labels(self.role).observe)
        self._watchdog.start()

    def _histogram(
        self,
        name: str,
        documentation: str,
        labels: list[str] | None = None,
        buckets: tuple[float, ...] = LATENCY_BUCKETS,
    ) -> Histogram:
        return Histogram(
            name,
            documentation,
            ["role", *(labels or [])],
            registry=self.registry,
            buckets=buckets,
        )

    def _counter(self, name: str, documentation: str, labels: list[str] | None = None) -> Counter:
        return Counter(name, documentation, ["role", *(labels or [])], registry=self.registry)

    def _gauge(self, name: str, documentation: str) -> Gauge:
        return Gauge(name, documentation, ["role"], registry=self.registry)

    def instrument_redis(self, client: Any) -> Any:
        """Times every command ``client`` (a redis-py client) sends; returns the client."""
        execute = client.execute_command
        histogram = self.redis_seconds

        def timed(*args: Any, **options: Any) -> Any:
            start = time.perf_counter()
            try:
                return execute(*args, **options)
            finally:
                command = str(args[0]).upper() if args else "?"
                histogram.labels(self.role, command).observe(time.perf_counter() - start)

        client.execute_command = timed
        return client

    def serve(self, host: str, port: int) -> int:
        """Serves /metrics on ``host:port`` in a daemon thread (0: off); returns the port."""
        if port == 0:
            return 0
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_port)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class RouterMetrics(Metrics):
    """Client-visible latencies and outcomes, measured where the stream leaves the cluster."""

    def __init__(self) -> None:
        super().__init__("router")
        self.ttft_seconds = self._histogram(
            "tandem_time_to_first_token_seconds", "Arrival at the router to the first token sent"
        )
        self.inter_token_seconds = self._histogram(
            "tandem_inter_token_latency_seconds",
            "Between consecutive streamed chunks (a chunk carries 1..K+1 tokens)",
        )
        self.e2e_seconds = self._histogram(
            "tandem_e2e_request_latency_seconds", "Arrival at the router to the request's end"
        )
        self.queue_seconds = self._histogram(
            "tandem_queue_seconds",
            "Arrival to the start of prefill compute (routing, reservation, prefill queue)",
        )
        self.requests = self._counter(
            "tandem_requests",
            "Requests by how they ended: finished, cancelled, failed, rejected",
            ["status"],
        )
        self.migrations = self._counter(
            "tandem_migrations",
            "Requests resumed on another decode worker after losing the stream of theirs",
        )
        self.in_flight = self._gauge(
            "tandem_requests_in_flight", "Requests admitted and not ended (--max-in-flight)"
        )
        self.waiting = self._gauge(
            "tandem_requests_waiting",
            "Of those, requests waiting for KV room on a decode worker (--max-waiting)",
        )
        self.prefill_workers = self._gauge(
            "tandem_prefill_workers", "Live prefill workers of the model this router picks from"
        )
        self.decode_workers = self._gauge(
            "tandem_decode_workers",
            "Live decode workers (co-located ones too) of the model this router picks from",
        )
        # Per model: the served model's name, or a LoRA adapter's its requests named.
        self.model_requests = self._counter(
            "tandem_model_requests",
            "Requests by the model or LoRA adapter they named, and how they ended",
            ["model", "status"],
        )
        self.model_prompt_tokens = self._counter(
            "tandem_model_prompt_tokens",
            "Prompt tokens of admitted requests, by the model or LoRA adapter they named",
            ["model"],
        )
        self.model_generation_tokens = self._counter(
            "tandem_model_generation_tokens",
            "Tokens streamed to clients, by the model or LoRA adapter their requests named",
            ["model"],
        )
        self.lora_adapters = self._gauge(
            "tandem_lora_adapters", "LoRA adapters the live workers of the model serve"
        )


class PrefillMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__("prefill")
        self.prefill_seconds = self._histogram(
            "tandem_prefill_seconds", "Prefill compute of one prompt (target and draft)"
        )
        self.kv_transfer_bytes = self._counter(
            "tandem_kv_transfer_bytes", "KV bytes pushed to decode workers"
        )
        self.kv_transfer_seconds = self._histogram(
            "tandem_kv_transfer_seconds", "KV push of one request, handshake to acknowledgement"
        )


@dataclass(frozen=True)
class DecodeFigures:
    """A decode worker's current figures, read at scrape time."""

    num_kv_blocks_used: int = 0
    num_kv_blocks_free: int = 0
    num_running: int = 0
    num_drafts: int = 0  # speculative steps' draft rows, since start
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    steps_per_k: tuple[int, ...] = ()  # [k]: decode steps that verified k drafts
    max_k: int = 0  # the deepest a step may draft (--num-draft-tokens); 0 without a draft


class _DecodeCollector(Collector):
    """Gauges and counters the engine already keeps, read when scraped (no hot-loop work)."""

    def __init__(self, role: str, figures: Callable[[], DecodeFigures]) -> None:
        self.role = role
        self.figures = figures

    def collect(self) -> Iterator[Metric]:
        f = self.figures()
        gauges = (
            ("tandem_kv_blocks_used", "KV blocks held by requests", f.num_kv_blocks_used),
            (
                "tandem_kv_blocks_free",
                "KV blocks free (cached ones included)",
                f.num_kv_blocks_free,
            ),
            ("tandem_running_requests", "Requests in the running batch", f.num_running),
        )
        for name, documentation, value in gauges:
            gauge = GaugeMetricFamily(name, documentation, labels=["role"])
            gauge.add_metric([self.role], value)
            yield gauge
        counters = (
            ("tandem_spec_drafts", "Speculative draft rows proposed", f.num_drafts),
            ("tandem_spec_draft_tokens", "Draft tokens proposed", f.num_draft_tokens),
            ("tandem_spec_accepted_tokens", "Draft tokens accepted", f.num_accepted_tokens),
        )
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation, labels=["role"])
            counter.add_metric([self.role], value)
            yield counter
        if f.max_k:
            yield _k_histogram(self.role, f.steps_per_k, f.max_k)


def _k_histogram(role: str, steps_per_k: Sequence[int], max_k: int) -> HistogramMetricFamily:
    """``tandem_spec_k``: the draft tokens each decode step verified (0 to --num-draft-tokens),
    one observation per step; with adaptive speculation, the depths the worker chose."""
    counts = [*steps_per_k, *[0] * (max_k + 1 - len(steps_per_k))]
    cumulative = list(itertools.accumulate(counts))
    buckets = [(floatToGoString(k), float(cumulative[k])) for k in range(max_k + 1)]
    buckets.append(("+Inf", float(cumulative[-1])))
    histogram = HistogramMetricFamily(
        "tandem_spec_k", "Draft tokens verified per decode step (K as chosen)", labels=["role"]
    )
    total = float(sum(k * n for k, n in enumerate(counts)))
    histogram.add_metric([role], buckets, total)
    return histogram


class DecodeMetrics(Metrics):
    def __init__(self) -> None:
        super().__init__("decode")
        self.requests = self._counter(
            "tandem_requests",
            "Requests that reached this decode worker, by how they ended: finished, aborted",
            ["status"],
        )
        self._figures: Callable[[], DecodeFigures] = DecodeFigures
        self.registry.register(_DecodeCollector(self.role, lambda: self._figures()))

    def read_figures_from(self, figures: Callable[[], DecodeFigures]) -> None:
        """Where scrapes read the gauges and speculative counters (the decode service)."""
        self._figures = figures


class ColocatedMetrics(DecodeMetrics):
    """A co-located worker's: its decode side's, and its prefill side's compute of each
    prompt (its KV is handed over in place: no transfer to time)."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_seconds = self._histogram(
            "tandem_prefill_seconds", "Prefill compute of one prompt (target and draft)"
        )
