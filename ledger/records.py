"""The ledger's records and states: what a request, a worker, a holding and a generation
look like once read from Redis, and the checks every key part passes first."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
import redis.cluster

RedisClient = redis.Redis | redis.cluster.RedisCluster

DEFAULT_REQUEST_TTL_MS = 6 * 3600 * 1000  # live requests: refreshed at every transition
DEFAULT_FINISHED_TTL_MS = 10 * 60 * 1000  # FINISHED / FAILED / CANCELLED records
MAX_BLOCK_ID = 2**32 - 1
ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")
RECORD_FIELDS = frozenset(
    {"state", "owner", "epoch", "version", "created_ms", "updated_ms", "error", "retryable"}
)
WORKER_FIELDS = frozenset(
    {"role", "address", "capacity", "load", "epoch", "registered_ms", "heartbeat_ms"}
)


PREFIX_KEY_TTL_MS = 3_600_000  # a prefix-index key outlives its entries by up to this


class LedgerConflict(Exception):
    """A refused change: wrong state, stale epoch, expired lease; says expected vs found."""


class RequestState(StrEnum):
    QUEUED = "QUEUED"
    PREFILLING = "PREFILLING"
    TRANSFERRING = "TRANSFERRING"
    DECODING = "DECODING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED})
_ABANDON = frozenset({RequestState.CANCELLED, RequestState.FAILED})
ALLOWED_TRANSITIONS: Mapping[RequestState, frozenset[RequestState]] = {
    RequestState.QUEUED: _ABANDON | {RequestState.PREFILLING},
    # QUEUED (from PREFILLING, TRANSFERRING and DECODING): a preempted request handed
    # back, or the router taking back a request whose prefill failed or whose decode
    # worker it lost; either is re-prefilled elsewhere and resumed.
    RequestState.PREFILLING: _ABANDON | {RequestState.TRANSFERRING, RequestState.QUEUED},
    RequestState.TRANSFERRING: _ABANDON | {RequestState.DECODING, RequestState.QUEUED},
    RequestState.DECODING: _ABANDON | {RequestState.FINISHED, RequestState.QUEUED},
    RequestState.FINISHED: frozenset(),
    RequestState.FAILED: frozenset(),
    RequestState.CANCELLED: frozenset(),
}


class KvPool(StrEnum):
    """Which paged KV pool a block id indexes: the same names as ``kv_transfer.KvPool``
    and the engine's ``LLMEngine.kv_pools`` keys. Three declarations of one vocabulary, as
    the layering wants: the engine, the KV transfer and the ledger import none of each
    other (``tests/services/test_vocabulary.py`` keeps them equal)."""

    TARGET = "target"
    DRAFT = "draft"


class WorkerRole(StrEnum):
    ROUTER = "router"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    state: RequestState
    owner: str  # worker id of the current owner (router, prefill or decode worker)
    epoch: int  # the owner's epoch: the fencing token a transition must present
    version: int  # number of transitions so far
    created_ms: int  # Redis server clock
    updated_ms: int
    error: str  # set by a transition to FAILED (or any transition given one)
    retryable: bool  # FAILED with a status the client retries: the id may be used again
    fields: Mapping[str, str]  # caller fields given at creation (model, num_prompt_tokens...)

    @classmethod
    def from_redis(cls, request_id: str, raw: Mapping[str, str]) -> RequestRecord:
        """The record from its Redis hash."""
        return cls(
            request_id=request_id,
            state=RequestState(raw["state"]),
            owner=raw["owner"],
            epoch=int(raw["epoch"]),
            version=int(raw["version"]),
            created_ms=int(raw["created_ms"]),
            updated_ms=int(raw["updated_ms"]),
            error=raw.get("error", ""),
            retryable=raw.get("retryable") == "1",
            fields={k: v for k, v in raw.items() if k not in RECORD_FIELDS},
        )


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: WorkerRole
    address: str  # host:port of its gRPC services
    capacity: int  # KV blocks in its pools
    load: float  # in [0, 1], from the last heartbeat
    epoch: int
    registered_ms: int
    heartbeat_ms: int
    stats: Mapping[str, str]  # further figures from heartbeats (num_running, ...)


@dataclass(frozen=True)
class Generation:
    """One lifetime of the ledger's data, as a component last read it."""

    id: str  # random; a new one when the data was lost (restarted empty, restored)
    started_ms: int  # Redis server clock: a record last changed before is from before it
    tick: int  # this component's clock in the ledger, which only its own reads advance


@dataclass(frozen=True)
class Holding:
    """Blocks one worker instance holds for one request."""

    request_id: str
    worker_id: str
    epoch: int
    blocks: Mapping[KvPool, frozenset[int]]
    lease_ttl_ms: int  # remaining; -2: expired (reclaimable)
    request_state: RequestState | None  # None: the record is gone (expired)

    @property
    def is_request_live(self) -> bool:
        return self.request_state is not None and not self.request_state.is_terminal


@dataclass(frozen=True)
class Reclaimed:
    """Blocks taken back from a worker whose lease on a request expired."""

    request_id: str
    worker_id: str
    epoch: int
    blocks: Mapping[KvPool, frozenset[int]]


def text_of(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pairs_of(flat: Sequence[Any]) -> dict[str, str]:
    return {text_of(flat[i]): text_of(flat[i + 1]) for i in range(0, len(flat), 2)}


def check_id(kind: str, value: str) -> None:
    # Braces would break the {req:ID} hash tag; "/" separates ids in the holdings index.
    if not isinstance(value, str) or not ID_PATTERN.fullmatch(value):
        raise ValueError(f"{kind}: 1..128 characters of [A-Za-z0-9._:-], got {value!r}")


def check_block_ids(block_ids: Iterable[int]) -> list[str]:
    ids = list(block_ids)
    for b in ids:
        if not isinstance(b, int) or not 0 <= b <= MAX_BLOCK_ID:
            raise ValueError(f"block_ids: integers in [0, 2**32), got {b!r}")
    return [str(b) for b in ids]
