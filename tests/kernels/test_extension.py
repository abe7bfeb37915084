"""Building the CPU kernels: a build lock left by a killed process does not hang loads."""

from __future__ import annotations

import os
import time
from pathlib import Path

from kernels.cpu import extension


def test_a_lock_older_than_any_build_is_removed_and_a_recent_one_kept(tmp_path: Path) -> None:
    lock = tmp_path / "lock"
    lock.touch()
    extension._remove_stale_lock(tmp_path)
    assert lock.exists()  # a build may be running: wait for it
    old = time.time() - extension.STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    extension._remove_stale_lock(tmp_path)
    assert not lock.exists()
    extension._remove_stale_lock(tmp_path)  # none: nothing to do
