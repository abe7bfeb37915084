"""Stopping a cluster is bounded: the router, then the workers, get SIGTERM and drain within
the grace period, and whatever still runs at ``grace_s`` + ``STOP_SLACK_S`` is killed; the
phases share one deadline instead of each taking the whole grace period."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from serving.launcher import STOP_SLACK_S, Cluster, ClusterSpec, Component

GRACE_S = 2.0


def stubborn(name: str) -> Component:
    """A real process that ignores SIGTERM, as a component stuck in its drain would;
    returned once it says that its trap is set."""
    script = "trap '' TERM; echo trapped; sleep 120 & wait"
    process = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "trapped\n"
    process.stdout.close()
    return Component(name, "127.0.0.1:1", process, log_path=None)


def test_a_stuck_cluster_stops_within_grace_and_slack(tmp_path: Path) -> None:
    cluster = Cluster(ClusterSpec(model=str(tmp_path), grace_s=GRACE_S))
    cluster.router = stubborn("router")
    cluster.prefill = [stubborn("prefill-0")]
    cluster.decode = [stubborn("decode-0")]
    processes = [c.process for c in cluster.components]
    start = time.monotonic()
    cluster.stop()
    took = time.monotonic() - start
    assert GRACE_S < took <= GRACE_S + STOP_SLACK_S + 0.5, took  # was 2 * (grace + 5)
    assert all(p.returncode == -9 for p in processes)  # killed at the deadline
    assert cluster.components == []
