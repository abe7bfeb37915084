"""The KV transfer interface: states, the layout both ends must share, and the sender.

A prefill worker's ``KvSender`` ships one request's KV layer by layer into blocks a decode
worker reserved; the decode worker's ``KvReceiver`` (receiver.py) checks and writes it.
Transports (loopback, gRPC, shared memory) implement the sender and feed the receiver.
"""

from __future__ import annotations

import abc
import enum
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.v1 import kv_transfer_pb2 as pb
from tandem_client.wire import KV_PUSH_STATUS_KEY

# One layer's pools as chunk data orders them: K blocks of a run, then V blocks of the run;
# or an MLA layer's one pool of latent and rope vectors (DeepSeek-V3).
KV_LAYOUT = "kv,block,token,head,dim"
LATENT_LAYOUT = "latent,block,token,head,dim"
POOL_LAYOUTS = {2: KV_LAYOUT, 1: LATENT_LAYOUT}  # pools per layer -> its layout name
DRAFT_LAYOUT_SEP = ";draft="  # then the draft's layout, where it differs from the target's
KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


class TransferState(enum.Enum):
    RESERVED = "reserved"  # receiver: blocks reserved; sender: created, not begun
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


class KvPool(enum.StrEnum):
    """Which paged pool; both are indexed by the same block ids (as ledger.records.KvPool
    and the engine's kv_pools keys)."""

    TARGET = "target"
    DRAFT = "draft"


POOL_TO_WIRE = {KvPool.TARGET: pb.KV_POOL_TARGET, KvPool.DRAFT: pb.KV_POOL_DRAFT}
POOL_FROM_WIRE = {wire: pool for pool, wire in POOL_TO_WIRE.items()}


class KvTransferError(Exception):
    """A refused or broken transfer; ``status`` is the wire KvPushStatus."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{pb.KvPushStatus.Name(pb.KvPushStatus.ValueType(status))}: {message}")
        self.status = status
        self.message = message

    @property
    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """Sent with the gRPC status this error becomes (see serving.rpc)."""
        return ((KV_PUSH_STATUS_KEY, pb.KvPushStatus.Name(pb.KvPushStatus.ValueType(self.status))),)


class PagedPools(Protocol):
    """What a transfer needs of engine.kv_cache.PagedKVCache: per layer its pools, (k, v)
    or MLA's (latent,), each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""

    @property
    def layers(self) -> Sequence[tuple[torch.Tensor, ...]]: ...


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_tensors: int = 2  # pools per layer: K and V, or 1 (MLA's latent and rope part)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.num_tensors not in POOL_LAYOUTS:
            raise ValueError(f"num_tensors: {self.num_tensors}; allowed: {list(POOL_LAYOUTS)}")


def layout_name(target: PoolShape, draft: PoolShape | None) -> str:
    """The handshake's ``layout``: how chunk data orders the pools of a layer."""
    name = POOL_LAYOUTS[target.num_tensors]
    if draft is not None and draft.num_tensors != target.num_tensors:
        name += DRAFT_LAYOUT_SEP + POOL_LAYOUTS[draft.num_tensors]
    return name


def parse_layout_name(name: str) -> tuple[int, int]:
    """Pools per layer of the target and of the draft that ``layout_name`` wrote."""
    tensors = {layout: n for n, layout in POOL_LAYOUTS.items()}
    target, _, draft = name.partition(DRAFT_LAYOUT_SEP)
    if target not in tensors or (draft and draft not in tensors):
        raise ValueError(f"layout: {name!r} is not a KV layout; allowed: {list(tensors)}")
    return tensors[target], tensors[draft or target]


# The KV handshake's version (KvHandshake.wire_version): bumped by every change to what
# sender and receiver must agree on, so that workers of different versions refuse each
# other. 2: head_layout (tensor-parallel workers). 3: lora and lora_digest (LoRA adapters).
# 4: cuda_ipc_bus_ids and CHECKSUM_KIND_SUM64 (pushes into a GPU's pools through CUDA IPC).
KV_WIRE_VERSION = 4
# KvHandshake.head_layout: chunks carry every KV head of the model, in order, whatever the
# tensor-parallel ranks of either end hold (a split engine's ``kv_pools`` are whole).
WHOLE_HEADS = "whole"


@dataclass(frozen=True)
class KvLayout:
    """What one request's KV looks like; sender and receiver must agree on every field."""

    model: str
    dtype: torch.dtype
    block_size: int
    target: PoolShape
    draft: PoolShape | None = None
    draft_fingerprint: str = ""  # the drafter's config fingerprint; "" without a draft
    layout: str = ""  # "": ``layout_name`` of the pools
    wire_version: int = KV_WIRE_VERSION  # the handshake's; a sender's may be older
    head_layout: str = WHOLE_HEADS  # which heads chunks carry (WHOLE_HEADS, the only one)

    def __post_init__(self) -> None:
        if not self.layout:
            object.__setattr__(self, "layout", layout_name(self.target, self.draft))
        if dtype_name(self.dtype) not in KV_DTYPES:
            raise ValueError(f"dtype: {self.dtype} is not a KV dtype; allowed: {list(KV_DTYPES)}")
        if self.block_size <= 0:
            raise ValueError(f"block_size: must be positive, got {self.block_size}")
        if (self.draft is None) != (self.draft_fingerprint == ""):
            raise ValueError("draft and draft_fingerprint: give both or neither")

    @classmethod
    def of_pools(
        cls,
        model: str,
        target: PagedPools,
        draft: PagedPools | None = None,
        draft_fingerprint: str = "",
    ) -> KvLayout:
        """The layout of existing pools (shapes read from their first layer's first pool)."""

        def shape(pools: PagedPools) -> tuple[PoolShape, torch.Tensor]:
            first = pools.layers[0]
            k = first[0]
            return PoolShape(len(pools.layers), k.shape[2], k.shape[3], len(first)), k

        target_shape, k = shape(target)
        draft_shape = shape(draft)[0] if draft is not None else None
        return cls(model, k.dtype, k.shape[1], target_shape, draft_shape, draft_fingerprint)

    def pool_shape(self, pool: KvPool) -> PoolShape | None:
        return self.target if pool is KvPool.TARGET else self.draft

    def block_bytes(self, pool: KvPool) -> int:
        """Bytes of one block of one layer of ``pool``: K and V, or MLA's one pool."""
        shape = self.pool_shape(pool)
        assert shape is not None
        return shape.num_tensors * self.tensor_block_bytes(pool)

    def tensor_block_bytes(self, pool: KvPool) -> int:
        """Bytes of one block of one of a layer's pools (K, V or MLA's latent)."""
        shape = self.pool_shape(pool)
        assert shape is not None
        return self.block_size * shape.num_kv_heads * shape.head_dim * self.dtype.itemsize

    def wire_fields(self) -> dict[str, str | int]:
        """The KvHandshake fields this layout sets, by their wire names."""
        draft = self.draft or PoolShape(1, self.target.num_kv_heads, self.target.head_dim)
        return {
            "wire_version": self.wire_version,
            "model": self.model,
            "dtype": dtype_name(self.dtype),
            "block_size": self.block_size,
            "num_layers": self.target.num_layers,
            "num_draft_layers": self.draft.num_layers if self.draft else 0,
            "num_kv_heads": self.target.num_kv_heads,
            "head_dim": self.target.head_dim,
            "num_draft_kv_heads": draft.num_kv_heads,
            "draft_head_dim": draft.head_dim,
            "layout": self.layout,
            "draft_fingerprint": self.draft_fingerprint,
            "head_layout": self.head_layout,
        }

    def fingerprint(self) -> str:
        """A short stable hash of every field, e.g. for a registry to pair compatible workers."""
        text = ";".join(f"{k}={v}" for k, v in self.wire_fields().items())
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def mismatch(self, sender: KvLayout) -> str | None:
        """None when ``sender`` matches this (receiver's) layout, else a refusal message
        naming the first field that differs and both values."""
        mine, theirs = self.wire_fields(), sender.wire_fields()
        for name, expected in mine.items():
            if theirs[name] != expected:
                return f"{name}: sender has {theirs[name]!r}, receiver expects {expected!r}"
        return None

    def to_handshake(self, request_id: str, decode_epoch: int, checksum: int) -> pb.KvHandshake:
        return pb.KvHandshake(
            request_id=request_id,
            decode_epoch=decode_epoch,
            checksum_kind=checksum,  # type: ignore[arg-type]
            **self.wire_fields(),  # type: ignore[arg-type]
        )

    @classmethod
    def from_handshake(cls, hs: pb.KvHandshake) -> KvLayout:
        """Raises ValueError (with the field) on a handshake that describes no valid layout."""
        if hs.dtype not in KV_DTYPES:
            raise ValueError(f"dtype: {hs.dtype!r} is not a KV dtype; allowed: {list(KV_DTYPES)}")
        target_tensors, draft_tensors = parse_layout_name(hs.layout)
        draft = None
        if hs.num_draft_layers:
            draft = PoolShape(
                hs.num_draft_layers,
                hs.num_draft_kv_heads or hs.num_kv_heads,
                hs.draft_head_dim or hs.head_dim,
                draft_tensors,
            )
        return cls(
            model=hs.model,
            dtype=KV_DTYPES[hs.dtype],
            block_size=hs.block_size,
            target=PoolShape(hs.num_layers, hs.num_kv_heads, hs.head_dim, target_tensors),
            draft=draft,
            draft_fingerprint=hs.draft_fingerprint,
            layout=hs.layout,
            wire_version=hs.wire_version,
            head_layout=hs.head_layout,
        )


@dataclass(frozen=True)
class Handshake:
    """What a sender announces before any KV: whose blocks, and what the KV looks like."""

    request_id: str
    layout: KvLayout
    decode_epoch: int = 0  # the decode worker's ReserveReply.epoch
    lora: str = ""  # the LoRA adapter the KV was computed under; "": the base model
    lora_digest: str = ""  # its files' digest (serving.lora_setup)

    def to_wire(self, checksum: int) -> pb.KvHandshake:
        wire = self.layout.to_handshake(self.request_id, self.decode_epoch, checksum)
        wire.lora, wire.lora_digest = self.lora, self.lora_digest
        return wire


@dataclass(frozen=True)
class RunPair:
    """``num_blocks`` consecutive source ids from ``src_start`` go to consecutive
    destination ids from ``dst_start``: one slice copy per layer, K and V."""

    src_start: int
    dst_start: int
    num_blocks: int


def merge_runs(src_block_ids: Sequence[int], dst_block_ids: Sequence[int]) -> list[RunPair]:
    """Pairs of maximal runs that are consecutive on both sides."""
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(
            f"block ids: {len(src_block_ids)} source ids but {len(dst_block_ids)} destination ids"
        )
    # Plain ints in the loop, RunPairs at the end: called per layer and pool (7x faster).
    starts: list[tuple[int, int]] = []  # (src, dst) where each run starts
    lengths: list[int] = []
    next_src = next_dst = -1
    for src, dst in zip(src_block_ids, dst_block_ids, strict=True):
        if src < 0 or dst < 0:
            raise ValueError(f"block ids: negative id in {src} -> {dst}")
        if src == next_src and dst == next_dst:
            lengths[-1] += 1
        else:
            starts.append((src, dst))
            lengths.append(1)
        next_src, next_dst = src + 1, dst + 1
    return [RunPair(s, d, n) for (s, d), n in zip(starts, lengths, strict=True)]


def split_runs(runs: Sequence[RunPair], max_blocks: int) -> list[list[RunPair]]:
    """Consecutive groups of at most ``max_blocks`` blocks, cutting runs where needed."""
    groups: list[list[RunPair]] = [[]]
    room = max_blocks
    for run in runs:
        done = 0
        while done < run.num_blocks:
            if room == 0:
                groups.append([])
                room = max_blocks
            n = min(room, run.num_blocks - done)
            groups[-1].append(RunPair(run.src_start + done, run.dst_start + done, n))
            done += n
            room -= n
    return [g for g in groups if g]


class KvSender(abc.ABC):
    """Ships one request's KV: ``begin``, ``send_layer`` per pool and layer, ``finish``.

    Methods raise KvTransferError once the transfer failed (``state`` FAILED, ``message``).
    """

    def __init__(self) -> None:
        self.state = TransferState.RESERVED
        self.message = ""
        self.num_bytes_sent = 0  # KV bytes handed to the transport (extra tensors excluded)
        self.num_chunks_sent = 0
        self.seconds = 0.0  # begin .. finish (or failure)

    @abc.abstractmethod
    async def begin(self, handshake: Handshake) -> None: ...

    @abc.abstractmethod
    async def send_layer(
        self,
        pool: KvPool,
        layer: int,
        src_cache_layer: tuple[torch.Tensor, ...],
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
    ) -> None:
        """Copies the blocks out of ``src_cache_layer`` before returning: the caller may
        overwrite them afterwards. Runs consecutive on both sides become one copy."""

    @abc.abstractmethod
    async def finish(self, extra_tensors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Sends the extra tensors, waits until the receiver has written everything."""

    @abc.abstractmethod
    async def abort(self, reason: str) -> None:
        """Ends the transfer early; the receiver marks the request FAILED."""

    @property
    def gbps(self) -> float:
        return self.num_bytes_sent / self.seconds / 1e9 if self.seconds else 0.0
