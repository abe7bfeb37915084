"""The supervisor's restart policy and exit descriptions (the supervisor itself runs on a
real cluster in tests/chaos/test_cluster_supervisor.py)."""

from __future__ import annotations

import pytest

from serving.supervisor import RestartPolicy, describe_exit


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy()  # `tandem serve`'s: 0.5 s doubling to 10 s, 5 restarts a minute
    assert [policy.backoff_s(n) for n in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(ValueError, match="max_backoff_s"):
        RestartPolicy(initial_backoff_s=2.0, max_backoff_s=1.0)


def test_exit_codes_and_signals_are_named() -> None:
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-11) == "killed by SIGSEGV"
