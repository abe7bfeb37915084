"""WorkerPicker on a real Redis ledger: prefix affinity first (unless the warm worker is
nearly full), else least loaded; only decode workers with the prefill worker's draft
fingerprint; waiting for a worker that is late."""

from __future__ import annotations

import asyncio
import time

import pytest

from ledger.ledger import Ledger, WorkerRole
from router.routing import PREFIX_BLOCK_TOKENS, WorkerPicker, prefix_hashes
from serving.lora_setup import lora_figure
from serving.rpc import Unavailable


def join(
    ledger: Ledger,
    worker_id: str,
    role: WorkerRole,
    load: float,
    fp: str = "",
    colocated: bool = False,
    wire_version: int = 2,
    tp: int = 1,
    loras: dict[str, str] | None = None,
) -> None:
    epoch = ledger.register_worker(
        worker_id, role=role, address=f"{worker_id}:1", capacity=1, ttl_ms=60_000
    )
    stats = {
        "model": "m",
        "draining": 0,
        "draft_fingerprint": fp,
        "prefills_in_place": int(colocated),
        "kv_wire_version": wire_version,
        "tensor_parallel_size": tp,
        **lora_figure(loras or {}),
    }
    ledger.heartbeat(worker_id, epoch=epoch, ttl_ms=60_000, load=load, stats=stats)


def test_prefix_hashes_chain_full_blocks() -> None:
    a = list(range(40))
    assert len(prefix_hashes(a)) == 40 // PREFIX_BLOCK_TOKENS == 2
    assert prefix_hashes(a[:15]) == []
    b = [*a[:16], 99, *a[17:]]
    assert prefix_hashes(b)[0] == prefix_hashes(a)[0]
    assert prefix_hashes(b)[1] != prefix_hashes(a)[1]
    c = [*a[16:32], *a[:16]]  # the same blocks in another order: other chain
    assert set(prefix_hashes(c)).isdisjoint(prefix_hashes(a))


def test_prefix_hashes_under_an_adapter_are_its_own() -> None:
    a = list(range(40))
    plain, under_x, under_y = (prefix_hashes(a, lora=lora) for lora in ("", "x", "y"))
    assert len(under_x) == len(plain) == 2
    assert set(under_x).isdisjoint(plain) and set(under_x).isdisjoint(under_y)
    assert prefix_hashes(a, lora="x") == under_x


def test_a_request_under_an_adapter_goes_to_workers_with_its_files(ledger: Ledger) -> None:
    """Both workers of the pair hold the adapter with the same digest (the same files);
    the base model goes anywhere; an adapter no pair holds is Unavailable, and the
    adapters listed are every live worker's."""
    join(ledger, "p0", WorkerRole.PREFILL, 0.1)  # no adapters, least loaded
    join(ledger, "p1", WorkerRole.PREFILL, 0.5, loras={"x": "01", "y": "02"})
    join(ledger, "d0", WorkerRole.DECODE, 0.1, loras={"x": "ff"})  # other files under x
    join(ledger, "d1", WorkerRole.DECODE, 0.5, loras={"x": "01"})
    join(ledger, "d2", WorkerRole.DECODE, 0.6, loras={"y": "02"})
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    assert picker.lora_names() == ["x", "y"]
    for _ in range(3):
        assert [w.worker_id for w in picker.pick(lora="x")] == ["p1", "d1"]
        assert [w.worker_id for w in picker.pick(lora="y")] == ["p1", "d2"]
        assert picker.pick()[0].worker_id == "p0"
    by_id = {w.worker_id: w for w in ledger.list_workers()}
    assert [w.worker_id for w in picker.decoders_for(by_id["p1"], "x")] == ["d1"]
    with pytest.raises(Unavailable, match="LoRA adapter 'z'"):
        picker.pick(lora="z")
    join(ledger, "d1", WorkerRole.DECODE, 0.5)  # x unloaded: no pair holds p1's x now
    with pytest.raises(Unavailable, match="LoRA adapter 'x'"):
        picker.pick(lora="x")


def test_prefix_affinity_then_least_loaded(ledger: Ledger) -> None:
    for i, load in enumerate((0.1, 0.3)):
        join(ledger, f"p{i}", WorkerRole.PREFILL, load)
        join(ledger, f"d{i}", WorkerRole.DECODE, load)
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    prompt = list(range(100))
    hashes = prefix_hashes(prompt)
    p, d = picker.pick(hashes)
    assert (p.worker_id, d.worker_id) == ("p0", "d0")  # nothing seen: least loaded
    by_id = {w.worker_id: w for w in ledger.list_workers()}
    picker.remember([by_id["p1"], by_id["d1"]], hashes)
    p, d = picker.pick(hashes)
    assert (p.worker_id, d.worker_id) == ("p1", "d1")  # more loaded, but warm
    longer = prefix_hashes([*prompt[:48], 7, 7, 7])  # shares 3 of its blocks
    assert picker.pick(longer)[1].worker_id == "d1"
    picker.remember([by_id["d0"]], hashes[:2])
    assert picker.pick(hashes)[1].worker_id == "d1"  # the longest match wins
    assert picker.pick(prefix_hashes([5] * 64))[1].worker_id == "d0"  # unseen prompt
    picker.count_in_flight([by_id["d1"]], +3)  # 3 more in flight than d0: balance wins
    assert picker.pick(hashes)[1].worker_id == "d0"
    picker.count_in_flight([by_id["d1"]], -1)
    assert picker.pick(hashes)[1].worker_id == "d1"
    join(ledger, "d1", WorkerRole.DECODE, 0.95)  # nearly full: affinity yields to load
    assert picker.pick(hashes)[1].worker_id == "d0"
    picker.remember([by_id["d0"]], hashes[:2])
    join(ledger, "d1", WorkerRole.DECODE, 0.3)
    picker.count_in_flight([by_id["d1"]], -2)
    few = hashes[:2] + prefix_hashes([1] * 80)[2:]  # 2 of 5 blocks seen: not warm
    assert picker.pick(few)[1].worker_id == "d0"


def test_decode_workers_must_match_the_draft(ledger: Ledger) -> None:
    join(ledger, "p0", WorkerRole.PREFILL, 0.1, fp="eagle3:abc")
    join(ledger, "d0", WorkerRole.DECODE, 0.0, fp="")
    join(ledger, "d1", WorkerRole.DECODE, 0.5, fp="eagle3:abc")
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    assert picker.pick()[1].worker_id == "d1"


def test_an_unreachable_worker_is_passed_over_until_it_answers_or_restarts(
    ledger: Ledger,
) -> None:
    join(ledger, "p0", WorkerRole.PREFILL, 0.1)
    join(ledger, "d0", WorkerRole.DECODE, 0.1)
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    _, d = picker.pick()
    picker.mark_unreachable(d)
    with pytest.raises(Unavailable, match="no live decode worker"):
        picker.pick()
    picker.mark_reachable(d)  # it answered after all
    assert picker.pick()[1] == d
    picker.mark_unreachable(d)
    join(ledger, "d0", WorkerRole.DECODE, 0.1)  # restarted: registered with a new epoch
    assert picker.pick()[1].epoch > d.epoch


async def test_waits_for_a_late_worker_then_gives_up(ledger: Ledger) -> None:
    join(ledger, "p0", WorkerRole.PREFILL, 0.1)
    picker = WorkerPicker(ledger, "m", refresh_s=0.05, wait_s=2.0)

    async def late_decode_worker() -> None:
        await asyncio.sleep(0.3)
        join(ledger, "d0", WorkerRole.DECODE, 0.0)

    task = asyncio.create_task(late_decode_worker())
    start = time.monotonic()
    _, d = await picker.pick_waiting(time.monotonic() + 10)
    await task
    assert d.worker_id == "d0" and 0.25 < time.monotonic() - start < 1.5
    # Ready once, then the pair is lost: a request waits wait_s (a restart), not longer.
    assert picker.is_ready() and picker.has_been_ready
    assert ledger.deregister_worker("d0", epoch=d.epoch)
    picker.forget_stale()  # as the router does when a worker refuses or vanishes
    picker.wait_s = 0.3
    start = time.monotonic()
    with pytest.raises(Unavailable, match="no live decode worker serves model 'm'"):
        await picker.pick_waiting(time.monotonic() + 10)
    assert not picker.is_ready() and 0.25 < time.monotonic() - start < 1.0


async def test_a_router_that_never_had_workers_waits_until_the_deadline(ledger: Ledger) -> None:
    """Before the first live pair (the cluster warming up, compiling), a request waits
    for workers up to its deadline, whatever ``wait_s``."""
    lonely = WorkerPicker(ledger, "other-model", refresh_s=0.05, wait_s=0.1)
    assert not lonely.is_ready()
    start = time.monotonic()
    with pytest.raises(Unavailable, match="no live prefill worker serves model 'other-model'"):
        await lonely.pick_waiting(time.monotonic() + 0.8)
    assert 0.7 < time.monotonic() - start < 1.5 and not lonely.has_been_ready


async def test_a_drain_ends_the_wait_for_workers(ledger: Ledger) -> None:
    picker = WorkerPicker(ledger, "m", refresh_s=0.05)
    waiting = asyncio.create_task(picker.pick_waiting(time.monotonic() + 60))
    await asyncio.sleep(0.1)  # it has looked, found no pair, and waits
    assert not waiting.done()
    picker.close()
    with pytest.raises(Unavailable, match="draining; retry on another router"):
        await asyncio.wait_for(waiting, timeout=1.0)


def test_ready_takes_a_matching_pair_or_a_colocated_worker(ledger: Ledger) -> None:
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    join(ledger, "p0", WorkerRole.PREFILL, 0.1, fp="a")
    assert not picker.is_ready()  # no decode worker
    join(ledger, "d0", WorkerRole.DECODE, 0.1, fp="b")
    assert not picker.is_ready()  # one that cannot take p0's KV (another draft)
    join(ledger, "d1", WorkerRole.DECODE, 0.1, fp="a")
    assert picker.is_ready()
    alone = Ledger(ledger.client, namespace=f"{ledger.ns}-alone")
    colocated = WorkerPicker(alone, "m", refresh_s=0.0)
    join(alone, "c0", WorkerRole.DECODE, 0.1, colocated=True)
    assert colocated.is_ready()


def test_workers_of_different_kv_wire_versions_are_never_paired_but_splits_are(
    ledger: Ledger,
) -> None:
    """A rolling update: a decode worker of the next version does not take the KV of a
    prefill worker of this one, however less loaded it is. A worker whose KV heads are
    split over 2 ranks does: the wire carries whole heads."""
    join(ledger, "p0", WorkerRole.PREFILL, 0.1)
    join(ledger, "d_next", WorkerRole.DECODE, 0.0, wire_version=3)
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    assert not picker.is_ready()
    join(ledger, "d0", WorkerRole.DECODE, 0.9)
    p, d = picker.pick()
    assert (p.worker_id, d.worker_id) == ("p0", "d0")
    assert [w.worker_id for w in picker.decoders_for(p)] == ["d0"]
    join(ledger, "d_split", WorkerRole.DECODE, 0.5, tp=2)
    p, d = picker.pick()
    assert (p.worker_id, d.worker_id) == ("p0", "d_split")
    assert sorted(w.worker_id for w in picker.decoders_for(p)) == ["d0", "d_split"]


def test_a_colocated_worker_is_its_own_prefill_worker(ledger: Ledger) -> None:
    """Picked to prefill, a co-located worker serves the request whole; its requests move
    only to other co-located workers; a prefill worker may push to any decode worker."""
    join(ledger, "c0", WorkerRole.DECODE, 0.2, colocated=True)
    join(ledger, "c1", WorkerRole.DECODE, 0.5, colocated=True)
    picker = WorkerPicker(ledger, "m", refresh_s=0.0)
    p, d = picker.pick()
    assert (p.worker_id, d.worker_id) == ("c0", "c0")
    assert [w.worker_id for w in picker.decoders_for(p)] == ["c0", "c1"]
    join(ledger, "d0", WorkerRole.DECODE, 0.0)
    assert sorted(w.worker_id for w in picker.decoders_for(p)) == ["c0", "c1"]
    join(ledger, "p0", WorkerRole.PREFILL, 0.1)
    p, d = picker.pick()
    assert (p.worker_id, d.worker_id) == ("p0", "d0")
    assert sorted(w.worker_id for w in picker.decoders_for(p)) == ["c0", "c1", "d0"]
