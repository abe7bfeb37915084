"""KV cache transfer from prefill to decode workers: loopback, gRPC and shared memory."""

from kv_transfer.base import (
    Handshake,
    KvLayout,
    KvPool,
    KvSender,
    KvTransferError,
    PoolShape,
    TransferState,
)
from kv_transfer.chunking import TransferOptions
from kv_transfer.grpc_transport import (
    GrpcKvSender,
    KvTransferServicer,
    add_kv_transfer_servicer,
    server_options,
)
from kv_transfer.loopback import LoopbackTransport
from kv_transfer.receiver import KvReceiver, KvReservation
from kv_transfer.shm_transport import (
    ShmAttacher,
    ShmKvSender,
    ShmRingPool,
    host_id,
    make_sender,
)

__all__ = [
    "GrpcKvSender",
    "Handshake",
    "KvLayout",
    "KvPool",
    "KvReceiver",
    "KvReservation",
    "KvSender",
    "KvTransferError",
    "KvTransferServicer",
    "LoopbackTransport",
    "PoolShape",
    "ShmAttacher",
    "ShmKvSender",
    "ShmRingPool",
    "TransferOptions",
    "TransferState",
    "add_kv_transfer_servicer",
    "host_id",
    "make_sender",
    "server_options",
]
