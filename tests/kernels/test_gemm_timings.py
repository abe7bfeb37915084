"""Product timings cached per machine key: reused, re-measured when the key changes, and a
corrupt file ignored. Timings are injected (a fake ``measure``); nothing is timed here."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from kernels.cpu import gemm_timings
from kernels.cpu.gemm_plan import ATEN, BUCKETS, KERNEL, ONEDNN, GemmPlan
from kernels.cpu.gemm_timings import Timings

BF16, FP32 = torch.bfloat16, torch.float32


class FakeMeasure:
    """Timings as an AMX machine's (the kernel wins below 8 rows, oneDNN from 8), counted."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, torch.dtype]] = []

    def __call__(self, n: int, k: int, dtype: torch.dtype, products: Sequence[str]) -> Timings:
        self.calls.append((n, k, dtype))
        costs = {
            KERNEL: lambda r: 10.0 * r,
            ATEN: lambda r: 40.0 + 4 * r,
            ONEDNN: lambda r: 30 + 3 * r,
        }
        return {rows: {p: costs[p](rows) for p in products} for rows in BUCKETS}


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeMeasure:
    """A quiet machine with the kernel and oneDNN, whatever this one has."""
    monkeypatch.setattr(gemm_timings, "is_busy", lambda: False)
    monkeypatch.setattr(
        gemm_timings,
        "candidates",
        lambda dtype: (KERNEL, ATEN, ONEDNN) if dtype == BF16 else (ATEN, ONEDNN),
    )
    for name in gemm_timings.TIMING_ENV:
        monkeypatch.delenv(name, raising=False)
    return FakeMeasure()


SHAPES = [(960, 576, BF16), (576, 1536, BF16), (960, 576, FP32)]


def test_timings_are_cached_and_reused(tmp_path: Path, fake: FakeMeasure) -> None:
    plans = gemm_timings.plans(SHAPES, cache_dir=tmp_path, timer=fake)
    assert sorted(fake.calls, key=str) == sorted(SHAPES, key=str)
    assert plans[960, 576, BF16].describe() == "kernel 1-7, onednn 8+"
    assert plans[960, 576, FP32] == GemmPlan.uniform(ONEDNN)
    (path,) = tmp_path.glob("*.json")
    data = json.loads(path.read_text())
    assert data["key"] == gemm_timings.machine_key()
    assert data["timings_us"]["bfloat16 960x576"]["1"] == {
        "kernel": 10.0,
        "aten": 44.0,
        "onednn": 33.0,
    }
    again = gemm_timings.plans([*SHAPES[:2], (3072, 576, BF16)], cache_dir=tmp_path, timer=fake)
    assert fake.calls[len(SHAPES) :] == [(3072, 576, BF16)]  # only the new shape
    assert again[960, 576, BF16] == plans[960, 576, BF16]
    assert len(json.loads(path.read_text())["timings_us"]) == 4


def test_wide_weights_are_timed_once_at_the_widest_timed_width(
    tmp_path: Path, fake: FakeMeasure
) -> None:
    """LM heads: 49152 and 16384 outputs share the timings of 8192."""
    gemm_timings.plans([(49152, 576, BF16), (16384, 576, BF16)], cache_dir=tmp_path, timer=fake)
    assert fake.calls == [(gemm_timings.MAX_TIMED_N, 576, BF16)]


@pytest.mark.parametrize(
    "change",
    [
        "ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16",
        "ONEDNN_MAX_CPU_ISA=AVX2",
        "ATEN_CPU_CAPABILITY=avx2",
        "TANDEM_CPU_BF16_DOT=0",
        "flags",
        "threads",
    ],
)
def test_another_flag_set_cap_or_thread_count_measures_again(
    tmp_path: Path, fake: FakeMeasure, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    gemm_timings.plans(SHAPES[:1], cache_dir=tmp_path, timer=fake)
    if change == "flags":  # the same CPU name could come with other flags: AMX on, say
        flags = gemm_timings.cpu_flags()
        monkeypatch.setattr(gemm_timings, "cpu_flags", lambda: [*flags, "amx_bf16", "amx_tile"])
    elif change == "threads":
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    else:
        name, _, value = change.partition("=")
        monkeypatch.setenv(name, value)
    gemm_timings.plans(SHAPES[:1], cache_dir=tmp_path, timer=fake)
    assert len(fake.calls) == 2
    assert len(list(tmp_path.glob("*.json"))) == 2  # the first machine's file stays
    gemm_timings.plans(SHAPES[:1], cache_dir=tmp_path, timer=fake)
    assert len(fake.calls) == 2


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"key": 3}', '{"timings_us": {}}', "[1, 2]", "KEY"],
    ids=["not-json", "no-timings", "no-key", "a-list", "bad-entries"],
)
def test_a_corrupt_file_is_ignored_with_a_warning(
    tmp_path: Path, fake: FakeMeasure, caplog: pytest.LogCaptureFixture, content: str
) -> None:
    path = gemm_timings.cache_path(gemm_timings.machine_key(), tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if content == "KEY":  # the right key, entries of the wrong shape
        data = {"key": gemm_timings.machine_key(), "timings_us": {"bfloat16 960x576": [1]}}
        content = json.dumps(data)
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger=gemm_timings.__name__):
        plans = gemm_timings.plans(SHAPES[:1], cache_dir=tmp_path, timer=fake)
    assert "ignoring the product timings" in caplog.text
    assert len(fake.calls) == 1 and plans[SHAPES[0]].describe() == "kernel 1-7, onednn 8+"
    assert json.loads(path.read_text())["key"] == gemm_timings.machine_key()  # rewritten


def test_a_busy_machine_runs_the_default_products_and_caches_nothing(
    tmp_path: Path,
    fake: FakeMeasure,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Timings taken while other processes hold the cores are time slices, not products."""
    monkeypatch.setattr(gemm_timings, "is_busy", lambda: True)
    with caplog.at_level(logging.WARNING, logger=gemm_timings.__name__):
        plans = gemm_timings.plans(SHAPES, cache_dir=tmp_path, timer=fake)
    assert "too busy to time products" in caplog.text
    assert not fake.calls and not list(tmp_path.glob("*.json"))
    assert plans[960, 576, BF16] == GemmPlan.uniform(KERNEL)
    assert plans[960, 576, FP32].describe() == "aten 1, onednn 2+"


def test_timings_taken_without_a_core_of_their_own_are_not_kept(
    tmp_path: Path, fake: FakeMeasure, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At one thread the parallel-region check cannot see a busy machine; CPU time under
    0.8 of the wall time does (the process waited for a core)."""
    waited = gemm_timings.waited_for_a_core
    assert waited(1.0, 0.5) and not waited(1.0, 0.95) and not waited(0.01, 0.0)
    monkeypatch.setattr(gemm_timings, "waited_for_a_core", lambda wall_s, cpu_s: True)
    plans = gemm_timings.plans(SHAPES, cache_dir=tmp_path, timer=fake)
    assert fake.calls and not list(tmp_path.glob("*.json"))
    assert plans[960, 576, BF16] == GemmPlan.uniform(KERNEL)


def test_measure_times_every_product_at_the_first_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one real timing here: a tiny weight, a few ms (with time for three buckets
    however slow the machine is)."""
    monkeypatch.setattr(gemm_timings, "SHAPE_BUDGET_S", 5.0)
    products = gemm_timings.candidates(BF16)
    timings = gemm_timings.measure(16, 8, BF16, products)
    assert list(timings)[:3] == [1, 2, 4] and set(timings) <= set(BUCKETS)
    assert all(set(t) == set(products) and min(t.values()) > 0 for t in timings.values())
