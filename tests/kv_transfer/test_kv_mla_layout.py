"""MLA pools (DeepSeek-V3: one latent+rope pool per layer, no K and V) travel like K/V
pools: sized from the layout, bit for bit over every transport, and a layout whose pools
differ is refused at the handshake."""

from __future__ import annotations

import pytest
import torch

from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    KvTransferError,
    LoopbackTransport,
    PoolShape,
    ShmRingPool,
    TransferOptions,
    TransferState,
    host_id,
    make_sender,
)
from kv_transfer.base import KV_LAYOUT, LATENT_LAYOUT
from kv_transfer.shared_pools import SharedKvPools
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_SEED,
    Receiving,
    make_pools,
    mismatches,
    push_all,
)

SMALL_CHUNKS = TransferOptions(chunk_bytes=1024, window=2, timeout_s=10)


def mla_layout(dtype: torch.dtype = torch.float32, *, draft_tensors: int = 2) -> KvLayout:
    """A DeepSeek-V3 target (latent 20 + rope 4 per token) with an MHA or MLA draft."""
    draft_heads = 2 if draft_tensors == 2 else 1
    return KvLayout(
        model="tiny-deepseek",
        dtype=dtype,
        block_size=4,
        target=PoolShape(num_layers=3, num_kv_heads=1, head_dim=24, num_tensors=1),
        draft=PoolShape(1, draft_heads, 8 if draft_tensors == 2 else 24, draft_tensors),
        draft_fingerprint="eagle3-mla" if draft_tensors == 1 else "eagle3-mha",
    )


def test_the_handshake_carries_each_pools_layout() -> None:
    mha_draft, mla_draft = mla_layout(), mla_layout(draft_tensors=1)
    assert mha_draft.layout == f"{LATENT_LAYOUT};draft={KV_LAYOUT}"
    assert mla_draft.layout == LATENT_LAYOUT
    assert mha_draft.block_bytes(KvPool.TARGET) == 4 * 1 * 24 * 4  # one pool, no V
    assert mha_draft.block_bytes(KvPool.DRAFT) == 2 * 4 * 2 * 8 * 4
    for layout in (mha_draft, mla_draft):
        wire = layout.to_handshake("r", 0, pb.CHECKSUM_KIND_CRC32)
        assert KvLayout.from_handshake(wire) == layout
    # The same shapes as K/V pools: another layout, another fingerprint, refused by name.
    as_kv = KvLayout(
        "tiny-deepseek",
        torch.float32,
        4,
        PoolShape(3, 1, 24),
        PoolShape(1, 1, 24, 1),
        "eagle3-mla",
    )
    assert as_kv.fingerprint() != mla_draft.fingerprint()
    assert mla_draft.mismatch(as_kv) == (
        f"layout: sender has '{KV_LAYOUT};draft={LATENT_LAYOUT}', "
        f"receiver expects '{LATENT_LAYOUT}'"
    )
    wire = mla_draft.to_handshake("r", 0, pb.CHECKSUM_KIND_CRC32)
    wire.layout = "heads,block,token,dim"
    with pytest.raises(ValueError, match="layout: 'heads,block,token,dim' is not a KV layout"):
        KvLayout.from_handshake(wire)


async def test_loopback_copies_mla_blocks() -> None:
    layout = mla_layout()
    receiver = KvReceiver()
    dst = make_pools(layout, DST_SEED)
    assert all(len(kv) == 1 for kv in dst[KvPool.TARGET].layers)
    receiver.reserve(KvReservation("r1", DST_IDS, dst, layout))
    src = make_pools(layout, SRC_SEED)
    sender = LoopbackTransport(receiver).sender()
    await push_all(sender, "r1", layout, src)
    await receiver.wait_done("r1", timeout=1)
    assert sender.state is TransferState.DONE
    assert mismatches(dst, src, make_pools(layout, DST_SEED)) == []


@pytest.mark.parametrize("transport", ["grpc", "shm"])
@pytest.mark.parametrize("draft_tensors", [1, 2], ids=["mla_draft", "mha_draft"])
async def test_push_copies_mla_blocks_bit_for_bit(
    receiving: Receiving, transport: str, draft_tensors: int
) -> None:
    layout = mla_layout(torch.bfloat16, draft_tensors=draft_tensors)
    dst = receiving.reserve("r1", layout)
    src = make_pools(layout, SRC_SEED)
    rings = ShmRingPool.for_options(SMALL_CHUNKS)
    sender = make_sender(
        receiving.channel,
        peer_host_id=host_id() if transport == "shm" else "another-host",
        rings=rings,
        options=SMALL_CHUNKS,
    )
    await push_all(sender, "r1", layout, src)
    await receiving.receiver.wait_done("r1", timeout=5)
    rings.close()
    assert sender.state is TransferState.DONE
    assert mismatches(dst, src, make_pools(layout, DST_SEED)) == []


def test_mla_pools_move_into_shared_memory_contents_kept() -> None:
    layout = mla_layout()
    pools = make_pools(layout, SRC_SEED)
    before = make_pools(layout, SRC_SEED)
    by_name = {str(pool): cache for pool, cache in pools.items()}
    shared = SharedKvPools.adopt(layout, by_name)
    assert shared is not None
    for pool in KvPool:
        assert shared.holds(pool, pools[pool].layers)
        assert len(shared.layer(pool, 0)) == (1 if pool is KvPool.TARGET else 2)
    assert mismatches(pools, before, before, (), ()) == []


async def test_a_push_in_kv_layout_to_latent_pools_is_refused_at_the_handshake(
    receiving: Receiving,
) -> None:
    """Pools of the very same shapes, K and V instead of MLA's one latent pool: the
    handshake names the layout and the receiver refuses before any block arrives."""
    dst = receiving.reserve("r1", mla_layout(draft_tensors=1))
    theirs = KvLayout(
        "tiny-deepseek", torch.float32, 4, PoolShape(3, 1, 24), PoolShape(1, 1, 24), "eagle3-mla"
    )
    sender = make_sender(
        receiving.channel, peer_host_id="another-host", rings=None, options=SMALL_CHUNKS
    )
    with pytest.raises(KvTransferError) as refused:
        await push_all(sender, "r1", theirs, make_pools(theirs, SRC_SEED))
    assert refused.value.status == pb.KV_PUSH_STATUS_INCOMPATIBLE
    assert refused.value.message == (
        f"layout: sender has '{KV_LAYOUT}', receiver expects '{LATENT_LAYOUT}'"
    )
    assert receiving.receiver.state("r1") is TransferState.FAILED
    assert mismatches(dst, dst, make_pools(mla_layout(draft_tensors=1), DST_SEED), [], []) == []


async def test_a_layer_of_another_layout_is_refused_before_sending() -> None:
    layout = mla_layout()
    receiver = KvReceiver()
    receiver.reserve(KvReservation("r1", DST_IDS, make_pools(layout, DST_SEED), layout))
    src = make_pools(layout, SRC_SEED)
    sender = LoopbackTransport(receiver).sender()
    await sender.begin(Handshake("r1", layout))
    k_and_v = src[KvPool.DRAFT].layers[0]
    with pytest.raises(ValueError, match="src_cache_layer: 2 pools, the layout has 1 per layer"):
        await sender.send_layer(KvPool.TARGET, 0, k_and_v, [3], [10])
