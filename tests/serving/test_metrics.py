"""serving.metrics: each role's registry exports the expected `tandem_*` families with a
`role` label, Redis commands are timed, /metrics is served over HTTP."""

from __future__ import annotations

import asyncio
import urllib.request
from typing import Any

import pytest

from ledger.redis_server import free_port
from serving.metrics import DecodeFigures, DecodeMetrics, Metrics, PrefillMetrics, RouterMetrics

COMMON = {"tandem_redis_seconds", "tandem_event_loop_lag_seconds"}
EXPECTED: dict[type[Metrics], set[str]] = {
    RouterMetrics: COMMON
    | {
        "tandem_time_to_first_token_seconds",
        "tandem_inter_token_latency_seconds",
        "tandem_e2e_request_latency_seconds",
        "tandem_queue_seconds",
        "tandem_requests",  # exposed as tandem_requests_total
        "tandem_migrations",  # requests resumed after losing their decode worker
        "tandem_requests_in_flight",  # gauges: admitted, waiting for KV room
        "tandem_requests_waiting",
        "tandem_prefill_workers",  # live workers the router picks from
        "tandem_decode_workers",
        "tandem_model_requests",  # per model or LoRA adapter named: ended requests,
        "tandem_model_prompt_tokens",  # prompt tokens and streamed tokens
        "tandem_model_generation_tokens",
        "tandem_lora_adapters",  # gauge: adapters the live workers serve
    },
    PrefillMetrics: COMMON
    | {"tandem_prefill_seconds", "tandem_kv_transfer_bytes", "tandem_kv_transfer_seconds"},
    DecodeMetrics: COMMON
    | {
        "tandem_kv_blocks_used",
        "tandem_kv_blocks_free",
        "tandem_running_requests",
        "tandem_spec_drafts",
        "tandem_spec_draft_tokens",
        "tandem_spec_accepted_tokens",
        "tandem_requests",  # finished, aborted, preempted
    },
}


@pytest.mark.parametrize("cls", list(EXPECTED), ids=lambda c: c.__name__)
def test_registry_exposes_the_role_s_families(cls: type[Metrics]) -> None:
    metrics = cls()  # type: ignore[call-arg]
    names = {family.name for family in metrics.registry.collect()}
    assert names == EXPECTED[cls]


def test_decode_gauges_and_counters_read_the_service_figures() -> None:
    metrics = DecodeMetrics()
    figures = DecodeFigures(num_kv_blocks_used=3, num_kv_blocks_free=5, num_accepted_tokens=7)
    metrics.read_figures_from(lambda: figures)
    get = metrics.registry.get_sample_value
    assert get("tandem_kv_blocks_used", {"role": "decode"}) == 3
    assert get("tandem_kv_blocks_free", {"role": "decode"}) == 5
    assert get("tandem_spec_accepted_tokens_total", {"role": "decode"}) == 7


async def test_the_loop_lag_is_measured_until_close() -> None:
    metrics = PrefillMetrics()
    metrics.watch_loop()
    await asyncio.sleep(0.5)  # about 10 ticks of 50 ms
    metrics.close()
    count = metrics.registry.get_sample_value(
        "tandem_event_loop_lag_seconds_count", {"role": "prefill"}
    )
    assert count is not None and 5 <= count <= 10
    await asyncio.sleep(0.2)
    after = metrics.registry.get_sample_value(
        "tandem_event_loop_lag_seconds_count", {"role": "prefill"}
    )
    assert after == count  # stopped


class _FakeRedis:
    def execute_command(self, *args: Any, **options: Any) -> Any:
        if args[0] == "FAIL":
            raise ConnectionError("down")
        return "OK"


def test_redis_commands_are_timed_failures_included() -> None:
    metrics = PrefillMetrics()
    client = metrics.instrument_redis(_FakeRedis())
    assert client.execute_command("SADD", "k", "v") == "OK"
    with pytest.raises(ConnectionError):
        client.execute_command("FAIL")
    get = metrics.registry.get_sample_value
    assert get("tandem_redis_seconds_count", {"role": "prefill", "command": "SADD"}) == 1
    assert get("tandem_redis_seconds_count", {"role": "prefill", "command": "FAIL"}) == 1


def test_metrics_served_over_http_and_off_with_port_0() -> None:
    metrics = RouterMetrics()
    assert metrics.serve("127.0.0.1", 0) == 0
    metrics.requests.labels("router", "finished").inc(2)
    port = metrics.serve("127.0.0.1", free_port())
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    finally:
        metrics.close()
    assert 'tandem_requests_total{role="router",status="finished"} 2.0' in text
