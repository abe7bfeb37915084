"""The KV cache is sized by configuration (a byte budget, or a fraction of the device's
total memory), never by what happens to be free: a worker restarted on a busy host gets
its capacity back, or refuses to start saying what to do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine import kv_cache
from engine.kv_cache import KVCacheCapacityError, KVCacheParams, plan_num_blocks

GB = 10**9
PARAMS = KVCacheParams(
    num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32
)  # 1 KiB a block: K and V, 2 layers, 4 tokens, 2 heads, 8 dims, fp32


def with_memory(monkeypatch: pytest.MonkeyPatch, *, available: int, total: int) -> None:
    memory = SimpleNamespace(available=available, total=total)
    monkeypatch.setattr(kv_cache.psutil, "virtual_memory", lambda: memory)


def test_a_fraction_is_of_the_total_whatever_is_free(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    with_memory(monkeypatch, available=20 * GB, total=24 * GB)
    first = plan_num_blocks(PARAMS, cpu, memory_fraction=0.1)
    with_memory(monkeypatch, available=3 * GB, total=24 * GB)  # a killed instance's leftovers
    assert plan_num_blocks(PARAMS, cpu, memory_fraction=0.1) == first == int(2.4 * GB) // 1024
    assert plan_num_blocks(PARAMS, cpu, memory_bytes=1024 * 100) == 100


def test_a_budget_that_does_not_fit_is_refused_saying_what_to_do(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with_memory(monkeypatch, available=2 * GB, total=24 * GB)
    with pytest.raises(KVCacheCapacityError) as refused:
        plan_num_blocks(PARAMS, torch.device("cpu"), memory_fraction=0.1)
    assert str(refused.value) == (
        "kv cache: 2.40 GB (kv_cache_memory_fraction 0.1 of 24.00 GB) does not fit in the "
        "2.00 GB free on cpu; set a smaller kv_cache_memory (--kv-cache-memory BYTES) or "
        "free memory"
    )
    with pytest.raises(KVCacheCapacityError, match=r"3.00 GB \(kv_cache_memory\)"):
        plan_num_blocks(PARAMS, torch.device("cpu"), memory_bytes=3 * GB)
