"""What `tandem serve` and its ClusterSpec accept, and how they share the cores."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from serving.cli import register_serve
from serving.launcher import ClusterSpec


def test_colocated_clusters_have_no_prefill_workers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="co-located, no prefill workers"):
        ClusterSpec(model=str(tmp_path), num_prefill=1, colocate=True)
    with pytest.raises(ValueError, match="at least one of each"):
        ClusterSpec(model=str(tmp_path), num_prefill=0)
    assert ClusterSpec(model="m", num_prefill=0, colocate=True).num_workers == 1


@pytest.mark.parametrize(
    ("fields", "threads", "wait_policy"),
    [
        ({}, 1, None),  # 1 prefill + 1 decode worker on 2 cores
        ({"num_prefill": 0, "colocate": True}, 2, None),  # one co-located worker: both cores
        ({"num_prefill": 0, "num_decode": 2, "colocate": True}, 1, None),
        ({"threads": 3}, 3, "PASSIVE"),  # 6 threads on 2 cores: none may spin
        ({"threads": 1, "num_prefill": 2}, 1, "PASSIVE"),
    ],
)
def test_workers_share_the_cores_and_the_router_counts_for_none(
    monkeypatch: pytest.MonkeyPatch,
    fields: dict[str, object],
    threads: int,
    wait_policy: str | None,
) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    spec = ClusterSpec(model="m", **fields)  # type: ignore[arg-type]
    assert spec.threads_per_process() == threads
    assert spec.omp_wait_policy() == wait_policy


def test_serve_refuses_prefill_workers_with_colocate(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="tandem")
    register_serve(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m", "--colocate", "--prefill", "1"])
    assert args.func(args) == 2
    assert "--prefill: not with --colocate" in capsys.readouterr().err
