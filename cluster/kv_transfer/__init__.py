"""KV cache transfer from prefill to decode workers: loopback, gRPC and shared memory."""

from cluster.kv_transfer.base import (
    Handshake,
    KvLayout,
    KvPool,
    KvSender,
    KvTransferError,
    PoolShape,
    TransferState,
)
from cluster.kv_transfer.chunking import TransferOptions
from cluster.kv_transfer.grpc_transport import (
    GrpcKvSender,
    KvTransferServicer,
    add_kv_transfer_servicer,
    server_options,
)
from cluster.kv_transfer.loopback import LoopbackTransport
from cluster.kv_transfer.receiver import KvReceiver, KvReservation
from cluster.kv_transfer.shm_transport import (
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
