"""KV cache transfer from prefill to decode workers: one chunker composed with a channel per
transport (loopback, gRPC, same-host shared memory), and the in-process hand-over of a
co-located worker, whose prefill writes the reserved blocks itself."""

from kv_transfer.base import (
    KV_WIRE_VERSION,
    Handshake,
    KvLayout,
    KvPool,
    KvSender,
    KvTransferError,
    PoolShape,
    TransferState,
)
from kv_transfer.chunking import Channel, ChunkedKvSender, Destination, TransferOptions
from kv_transfer.grpc_transport import (
    GrpcChannel,
    KvTransferServicer,
    add_kv_transfer_servicer,
    grpc_sender,
    server_options,
)
from kv_transfer.in_place import InPlaceChannel, InPlaceHandOver
from kv_transfer.loopback import LoopbackChannel, LoopbackTransport
from kv_transfer.receiver import KvReceiver, KvReservation
from kv_transfer.shared_pools import SharedKvPools
from kv_transfer.shm_channel import ShmChannel, make_sender, shm_sender
from kv_transfer.shm_transport import ShmAttacher, ShmRingPool, host_id

__all__ = [
    "KV_WIRE_VERSION",
    "Channel",
    "ChunkedKvSender",
    "Destination",
    "GrpcChannel",
    "Handshake",
    "InPlaceChannel",
    "InPlaceHandOver",
    "KvLayout",
    "KvPool",
    "KvReceiver",
    "KvReservation",
    "KvSender",
    "KvTransferError",
    "KvTransferServicer",
    "LoopbackChannel",
    "LoopbackTransport",
    "PoolShape",
    "SharedKvPools",
    "ShmAttacher",
    "ShmChannel",
    "ShmRingPool",
    "TransferOptions",
    "TransferState",
    "add_kv_transfer_servicer",
    "grpc_sender",
    "host_id",
    "make_sender",
    "server_options",
    "shm_sender",
]
