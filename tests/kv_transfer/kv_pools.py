"""Random paged KV pools and a full push, shared by the KV transfer tests and their
receiver subprocess (same seeds give the same pools in both processes)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import grpc
import torch

from engine.kv_cache import KVCacheParams, PagedKVCache
from kv_transfer import (
    Handshake,
    KvLayout,
    KvPool,
    KvReceiver,
    KvReservation,
    KvSender,
    PoolShape,
    ShmAttacher,
    add_kv_transfer_servicer,
    server_options,
)
from kv_transfer.receiver import ChunkSource
from kv_transfer.shm_transport import SharedFile
from tandem.v1 import kv_transfer_pb2 as pb

NUM_BLOCKS = 16
# Runs: 3-5 -> 10-12 (one copy), 9 -> 0, 1-2 -> 6-7 (one copy), 12 -> 2, 13-14 -> 4, 3.
SRC_IDS = (3, 4, 5, 9, 1, 2, 12, 13, 14)
DST_IDS = (10, 11, 12, 0, 6, 7, 2, 4, 3)
SRC_SEED, DST_SEED = 1, 100


def layout_for(dtype: torch.dtype, *, draft_fingerprint: str = "eagle3-abc") -> KvLayout:
    return KvLayout(
        model="tiny",
        dtype=dtype,
        block_size=4,
        target=PoolShape(num_layers=3, num_kv_heads=2, head_dim=8),
        draft=PoolShape(num_layers=1, num_kv_heads=2, head_dim=8),
        draft_fingerprint=draft_fingerprint,
    )


def make_pools(
    layout: KvLayout, seed: int, num_blocks: int = NUM_BLOCKS
) -> dict[KvPool, PagedKVCache]:
    """Target and draft pools filled with random values from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    pools = {}
    for pool in KvPool:
        shape = layout.pool_shape(pool)
        assert shape is not None
        params = KVCacheParams(
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            layout.block_size,
            layout.dtype,
            shape.num_tensors,
        )
        cache = PagedKVCache(params, num_blocks, torch.device("cpu"))
        for kv in cache.layers:
            for t in kv:
                t.copy_(torch.randn(t.shape, generator=generator).to(t.dtype))
        pools[pool] = cache
    return pools


def extra_tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "hidden_states": torch.arange(15, dtype=torch.float32).reshape(5, 3).to(dtype),
        "input_row_offsets": torch.tensor([0, 2, 5], dtype=torch.int64),
    }


async def push_all(
    sender: KvSender,
    request_id: str,
    layout: KvLayout,
    src: Mapping[KvPool, PagedKVCache],
    src_ids: Sequence[int] = SRC_IDS,
    dst_ids: Sequence[int] = DST_IDS,
    *,
    decode_epoch: int = 0,
) -> None:
    """begin, every layer of every pool, finish with the extra tensors."""
    await sender.begin(Handshake(request_id, layout, decode_epoch))
    for pool in KvPool:
        for layer, kv in enumerate(src[pool].layers):
            await sender.send_layer(pool, layer, kv, src_ids, dst_ids)
    await sender.finish(extra_tensors(layout.dtype))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def mismatches(
    dst: Mapping[KvPool, PagedKVCache],
    src: Mapping[KvPool, PagedKVCache],
    before: Mapping[KvPool, PagedKVCache],
    src_ids: Sequence[int] = SRC_IDS,
    dst_ids: Sequence[int] = DST_IDS,
) -> list[str]:
    """Where ``dst`` differs from: ``src`` on the transferred blocks (bit for bit), and
    ``before`` on every other block."""
    wrong = []
    mapping = dict(zip(dst_ids, src_ids, strict=True))
    for pool in KvPool:
        for layer, (dst_kv, src_kv, before_kv) in enumerate(
            zip(dst[pool].layers, src[pool].layers, before[pool].layers, strict=True)
        ):
            names = "kv" if len(dst_kv) == 2 else ["latent"]
            for name, d, s, b in zip(names, dst_kv, src_kv, before_kv, strict=True):
                for block in range(d.shape[0]):
                    want = s[mapping[block]] if block in mapping else b[block]
                    if not torch.equal(bits(d[block]), bits(want)):
                        wrong.append(f"{pool} layer {layer} {name} block {block}")
    return wrong


class Receiving:
    """A grpc.aio server with a KvReceiver (shared memory enabled) and a client channel;
    ``rings_seen`` lists the shared-memory rings it was handed, in order."""

    def __init__(self) -> None:
        self.rings_seen: list[pb.ShmSegment] = []
        attacher = ShmAttacher()

        def attach(segment: pb.ShmSegment) -> ChunkSource:
            self.rings_seen.append(segment)
            return attacher(segment)

        self.receiver = KvReceiver(attach_segment=attach)
        self.server = grpc.aio.server(options=server_options())
        add_kv_transfer_servicer(self.server, self.receiver)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")

    def reserve(self, request_id: str, layout: KvLayout) -> dict[KvPool, PagedKVCache]:
        pools = make_pools(layout, DST_SEED)
        self.receiver.reserve(KvReservation(request_id, DST_IDS, pools, layout))
        return pools


def is_held(segment: pb.ShmSegment) -> bool:
    """Whether the segment's owner still holds it open: the file and, for a ring, its pipes."""
    files = [f for f in (segment.file, segment.ready, segment.free) if f.inode]
    return all(SharedFile.is_open(segment.owner_pid, f) for f in files)
