"""The KV transfer's block copies on the Triton path (``kv_transfer.copying.pack_runs`` and
``unpack_runs`` with ``use_triton``: what CUDA pools take), through the interpreter on CPU
pools: the same bytes and checksums as the torch path, for the chunks a push over gRPC
(whole layers grouped) and over the shared-memory ring with small slots (a layer split at
block bounds) cuts, K/V and MLA pools."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine.kv_cache import PagedKVCache
from kv_transfer import KvLayout, KvPool, TransferOptions
from kv_transfer.base import POOL_FROM_WIRE
from kv_transfer.checksum import checksum_kind, running_checksum
from kv_transfer.chunking import ChunkedKvSender
from kv_transfer.copying import byte_view, pack_runs, unpack_runs
from tandem.v1 import kv_transfer_pb2 as pb
from tests.kv_transfer.kv_pools import (
    DST_IDS,
    DST_SEED,
    SRC_IDS,
    SRC_SEED,
    layout_for,
    make_pools,
    mismatches,
    push_all,
)
from tests.kv_transfer.test_kv_mla_layout import mla_layout

CHUNKING = {
    "grpc": TransferOptions(window=2, timeout_s=10),  # 4 MiB: a pool's layers in one chunk
    "shm_small_slots": TransferOptions(chunk_bytes=1024, window=2, timeout_s=10),
}
LAYOUTS = {
    "kv_fp32": lambda: layout_for(torch.float32),
    "kv_bf16": lambda: layout_for(torch.bfloat16),
    "mla_fp16": lambda: mla_layout(torch.float16),
}


class Recording:
    """A channel that keeps each chunk's header and bytes, grouping layers as gRPC's and
    the shared-memory ring's channels do."""

    groups_layers = True

    def __init__(self) -> None:
        self.chunks: list[tuple[pb.KvChunk, torch.Tensor]] = []

    async def open(self, handshake: pb.KvHandshake, layout: KvLayout) -> None:
        return None

    async def acquire(self, num_bytes: int) -> torch.Tensor:
        return torch.empty(num_bytes, dtype=torch.uint8)

    async def send(self, header: pb.KvChunk, data: torch.Tensor | None) -> None:
        assert data is not None
        self.chunks.append((header, data.clone()))

    async def close(self, last: pb.KvChunk) -> pb.KvPushReply:
        return pb.KvPushReply(status=pb.KV_PUSH_STATUS_OK)

    def on_failed(self, status: int, message: str) -> None:
        raise AssertionError(message)


def pushed_chunks(
    layout: KvLayout, src: dict[KvPool, PagedKVCache], options: TransferOptions
) -> list[tuple[pb.KvChunk, torch.Tensor]]:
    """The chunks the sender cuts (packed on the CPU pools' torch path)."""
    channel = Recording()
    asyncio.run(push_all(ChunkedKvSender(channel, options), "r1", layout, src))
    return channel.chunks


@pytest.mark.parametrize("chunking", list(CHUNKING))
@pytest.mark.parametrize("shape", list(LAYOUTS))
def test_triton_block_copies_move_the_torch_paths_bytes(chunking, shape) -> None:
    layout, options = LAYOUTS[shape](), CHUNKING[chunking]
    kind = checksum_kind(options.checksum)
    src = make_pools(layout, SRC_SEED)
    chunks = pushed_chunks(layout, src, options)
    assert any(c.layer_end - c.layer_start > 1 for c, _ in chunks) == (chunking == "grpc")
    to_src = dict(zip(DST_IDS, SRC_IDS, strict=True))
    received = {use_triton: make_pools(layout, DST_SEED) for use_triton in (False, True)}
    for header, data in chunks:
        pool = POOL_FROM_WIRE[header.pool]
        dst_runs = [(r.first_block_id, r.num_blocks) for r in header.runs]
        src_runs = [(to_src[first], n) for first, n in dst_runs]
        # Sender: the gather, then one copy, gives the chunk's bytes and checksum.
        packed = torch.zeros_like(data)
        running, offset = running_checksum(kind), 0
        out = byte_view(packed)
        assert out is not None
        for layer in range(header.layer_start, header.layer_end):
            kv = src[pool].layers[layer]
            offset += pack_runs(out[offset:], kv, src_runs, running, use_triton=True)
        assert offset == data.numel() and torch.equal(packed, data)
        assert running.intdigest() == header.checksum
        # Receiver: one copy, then the scatter, writes what the torch path writes.
        wire = byte_view(data)
        assert wire is not None
        for use_triton, dst in received.items():
            running, offset = running_checksum(kind), 0
            for layer in range(header.layer_start, header.layer_end):
                kv = dst[pool].layers[layer]
                offset += unpack_runs(kv, dst_runs, wire[offset:], running, use_triton=use_triton)
            assert offset == data.numel() and running.intdigest() == header.checksum
    before = make_pools(layout, DST_SEED)
    assert mismatches(received[True], src, before) == []
    assert mismatches(received[False], src, before) == []


def test_pools_pick_the_torch_copy_on_the_cpu(monkeypatch) -> None:
    """Without ``use_triton``, CPU pools never reach the block kernels."""
    import kernels.triton.blocks as blocks

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the Triton block kernels ran for CPU pools")

    monkeypatch.setattr(blocks, "gather_block_runs", refuse)
    monkeypatch.setattr(blocks, "scatter_block_runs", refuse)
    layout = layout_for(torch.float32)
    src, dst = make_pools(layout, SRC_SEED), make_pools(layout, DST_SEED)
    kv, runs = src[KvPool.TARGET].layers[0], [(3, 3), (9, 1)]
    buffer = torch.empty(4 * layout.block_bytes(KvPool.TARGET), dtype=torch.uint8)
    view = byte_view(buffer)
    assert view is not None
    kind = checksum_kind("auto")
    pack_runs(view, kv, runs, running_checksum(kind))
    unpack_runs(dst[KvPool.TARGET].layers[0], [(0, 3), (3, 1)], view, running_checksum(kind))
    for got, want in zip(dst[KvPool.TARGET].layers[0], kv, strict=True):
        assert torch.equal(got[:4], want[[3, 4, 5, 9]])
