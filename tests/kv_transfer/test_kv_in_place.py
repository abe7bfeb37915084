"""The in-process hand-over of a co-located worker (kv_transfer.in_place): it moves a
reservation through the receiver's states as a push does (RESERVED -> TRANSFERRING ->
DONE, or FAILED), after the same handshake checks, and touches no block."""

from __future__ import annotations

import asyncio

import pytest
import torch

from kv_transfer import (
    Handshake,
    InPlaceChannel,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    TransferState,
)
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import DST_IDS, DST_SEED, layout_for, make_pools

LAYOUT = layout_for(torch.float32)


def reserved(rid: str = "r", epoch: int = 3) -> tuple[KvReceiver, dict[KvPool, object]]:
    receiver = KvReceiver(epoch=epoch)
    pools = make_pools(LAYOUT, DST_SEED)
    receiver.reserve(KvReservation(rid, list(DST_IDS), pools, LAYOUT))
    return receiver, pools


async def test_written_in_place_is_done_and_leaves_the_blocks_as_they_are() -> None:
    receiver, pools = reserved()
    before = {p: [k.clone() for kv in c.layers for k in kv] for p, c in pools.items()}
    hand_over = InPlaceChannel(receiver).open(Handshake("r", LAYOUT, decode_epoch=3))
    assert receiver.state("r") is TransferState.TRANSFERRING  # not lapsing while it computes
    waiting = asyncio.ensure_future(receiver.wait_done("r", timeout=5))
    await asyncio.sleep(0)
    assert not waiting.done()
    hand_over.written()
    assert await waiting == {}
    assert receiver.state("r") is TransferState.DONE
    after = {p: [k for kv in c.layers for k in kv] for p, c in pools.items()}
    assert all(torch.equal(a, b) for p in pools for a, b in zip(before[p], after[p], strict=True))
    hand_over.fail("too late")  # the first of written and fail acts
    assert receiver.state("r") is TransferState.DONE


@pytest.mark.parametrize(
    ("handshake", "status", "message"),
    [
        (Handshake("other", LAYOUT, 3), pb.KV_PUSH_STATUS_UNKNOWN_REQUEST, "no reservation"),
        (Handshake("r", LAYOUT, 2), pb.KV_PUSH_STATUS_STALE_EPOCH, "decode_epoch"),
        (
            Handshake("r", layout_for(torch.float32, draft_fingerprint="eagle3-xyz"), 3),
            pb.KV_PUSH_STATUS_INCOMPATIBLE,
            "draft_fingerprint",
        ),
    ],
    ids=["unknown_request", "stale_epoch", "another_draft"],
)
async def test_open_refuses_what_a_push_handshake_is_refused_for(
    handshake: Handshake, status: int, message: str
) -> None:
    receiver, _ = reserved()
    with pytest.raises(KvTransferError, match=message) as info:
        InPlaceChannel(receiver).open(handshake)
    assert info.value.status == status


@pytest.mark.parametrize(
    ("reserved_under", "sent_under", "refused"),
    [
        (("", ""), ("x", "01"), "lora: sender computed the KV under 'x'"),
        (("x", "01"), ("", ""), "lora: sender computed the KV under 'the base model'"),
        (("x", "01"), ("y", "01"), "reservation is under 'x'"),
        (("x", "01"), ("x", "02"), r"digest '02'\), the reservation is under 'x' \(digest '01'"),
        (("x", "01"), ("x", "01"), None),
    ],
    ids=["adapter_into_base", "base_into_adapter", "other_adapter", "other_files", "same"],
)
async def test_kv_made_under_another_adapter_is_refused(
    reserved_under: tuple[str, str], sent_under: tuple[str, str], refused: str | None
) -> None:
    """The handshake says which LoRA adapter (name and files' digest) the KV was computed
    under; a reservation under another, or under the base model, refuses it."""
    receiver = KvReceiver(epoch=3)
    pools = make_pools(LAYOUT, DST_SEED)
    receiver.reserve(KvReservation("r", list(DST_IDS), pools, LAYOUT, *reserved_under))
    handshake = Handshake("r", LAYOUT, 3, *sent_under)
    if refused is None:
        InPlaceChannel(receiver).open(handshake).written()
        assert receiver.state("r") is TransferState.DONE
        return
    with pytest.raises(KvTransferError, match=refused) as info:
        InPlaceChannel(receiver).open(handshake)
    assert info.value.status == pb.KV_PUSH_STATUS_INCOMPATIBLE


async def test_a_failed_or_dropped_hand_over_fails_the_wait_and_says_so() -> None:
    """Failed: the decode side's wait fails. Dropped (the decode side closed the request):
    a prefill waiting for its first token hears it at once (``until_ended``)."""
    receiver, _ = reserved()
    hand_over = InPlaceChannel(receiver).open(Handshake("r", LAYOUT, 3))
    hand_over.fail("prefill failed or was cancelled: CancelledError")
    with pytest.raises(KvTransferError, match="prefill failed or was cancelled"):
        await receiver.wait_done("r", timeout=5)

    receiver, _ = reserved("s")
    hand_over = InPlaceChannel(receiver).open(Handshake("s", LAYOUT, 3))
    ended = asyncio.ensure_future(hand_over.until_ended())  # what a prefill waits beside
    await asyncio.sleep(0)
    assert not ended.done()
    hand_over.check_live()
    assert receiver.drop("s") is None  # nothing writes the blocks but this engine
    await asyncio.wait_for(ended, 5)
    with pytest.raises(KvTransferError, match="dropped"):
        hand_over.check_live()
    with pytest.raises(KvTransferError, match="dropped"):
        hand_over.written()
