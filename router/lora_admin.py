"""LoRA adapters loaded and unloaded at run time, across the cluster: the router asks every
live worker of the model (prefill, decode and co-located) to load the adapter from a
path on its host, or to unload it (worker.proto's LoadLora and UnloadLora).

When one worker refuses a load (an unreadable file, a rank over its bound, another base)
or cannot be reached, the others unload it again, and the caller gets that worker's
refusal; so do workers that read different files (another digest) under the path. Each
worker lists the adapter in its heartbeat as soon as it has it (it publishes at once), so
requests may name it from then on: one that came in before an undo keeps the adapter on
its worker (logged). One load or unload at a time goes through a router.

Workers that join later load only their own ``--lora-modules``: a runtime load is not
recorded for them (the router's registry of adapters is not built).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc  # type: ignore[import-untyped]  # no types-grpcio in the dev extra

from ledger.ledger import WorkerInfo, WorkerRole
from router.routing import WorkerPicker
from router.validation import UnknownModel, ValidationError
from serving.lora_setup import check_load_request, worker_loras
from serving.rpc import ChannelPool, Unavailable
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

LORA_CALL_TIMEOUT_S = 120.0  # a worker reads and checks the adapter's files meanwhile
PREFILL_UNLOAD_WAIT_S = 10.0  # for a prefill under the adapter to end, on an unload


class LoraAdmin:
    """Loads and unloads adapters on the live workers ``picker`` sees (see the module's
    docstring)."""

    def __init__(self, picker: WorkerPicker, channels: ChannelPool, model_name: str) -> None:
        self.picker, self.channels, self.model_name = picker, channels, model_name
        self._lock = asyncio.Lock()  # one load or unload at a time through this router

    async def load(self, name: str, path: str) -> None:
        """Every live worker loads adapter ``name`` from ``path``; raises (a
        ValidationError, or the refusing worker's status) if any does not."""
        async with self._lock:
            await self._load(name, path)

    async def unload(self, name: str) -> None:
        """Every live worker holding adapter ``name`` unloads it (``_unload``)."""
        async with self._lock:
            await self._unload(name)

    async def _load(self, name: str, path: str) -> None:
        check_load_request(name, path, self.model_name)
        self.picker.forget_stale()
        if name in self.picker.lora_names():
            raise ValidationError(f"lora_name: {name!r} is already loaded")
        workers = self._live()
        request = pb.LoadLoraRequest(lora_name=name, lora_path=path)
        replies = await asyncio.gather(
            *(self._stub(w).LoadLora(request, timeout=LORA_CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        answers = list(zip(workers, replies, strict=True))
        refused = [(w, r) for w, r in answers if isinstance(r, BaseException)]
        digests = {r.lora_digest for r in replies if isinstance(r, pb.LoadLoraReply)}
        if refused or len(digests) > 1:
            # Every worker but those that refused outright may hold it (one that timed out
            # too): they unload it again. One with requests under it by now keeps it (each
            # failure is logged; the refusal is the caller's answer).
            undo = [w for w, r in answers if not _refused_outright(r)]
            with contextlib.suppress(Exception):
                await self._unload_from(undo, name)
            if refused:
                worker, error = refused[0]
                log.warning("loading adapter %r on %s: %s", name, worker.worker_id, error)
                raise error
            raise ValidationError(
                f"lora_path: the workers read different files at {path!r} (digests "
                f"{sorted(digests)}); give them the same adapter"
            )
        self.picker.forget_stale()  # their heartbeats list it now
        log.info("adapter %r loaded from %s on %d workers", name, path, len(workers))

    async def _unload(self, name: str) -> None:
        """Every live worker holding adapter ``name`` unloads it; UnknownModel when none
        does. Decode workers first, where requests run long: while one refuses
        (FAILED_PRECONDITION: requests run under it), the prefill workers keep the
        adapter, so that every decode worker still holding it still has a pair. A prefill
        worker's refusal (a prefill under way) is retried for ``PREFILL_UNLOAD_WAIT_S``."""
        self.picker.forget_stale()
        holding = [w for w in self._live() if name in worker_loras(w.stats)]
        if not holding:
            raise UnknownModel(f"lora_name: {name[:140]!r} is not loaded")
        prefillers = [w for w in holding if w.role is WorkerRole.PREFILL]
        await self._unload_from([w for w in holding if w not in prefillers], name)
        give_up = time.monotonic() + PREFILL_UNLOAD_WAIT_S
        while True:
            try:
                await self._unload_from(prefillers, name)
                break
            except grpc.aio.AioRpcError as e:
                if not is_in_use(e) or time.monotonic() > give_up:
                    raise
            await asyncio.sleep(0.1)
            self.picker.forget_stale()
            prefillers = [
                w for w in self.picker.workers(WorkerRole.PREFILL) if name in worker_loras(w.stats)
            ]
        self.picker.forget_stale()
        log.info("adapter %r unloaded from %d workers", name, len(holding))

    async def _unload_from(self, workers: list[WorkerInfo], name: str) -> None:
        """``workers`` unload ``name``; the first refusal is raised once all answered."""
        request = pb.UnloadLoraRequest(lora_name=name)
        results = await asyncio.gather(
            *(self._stub(w).UnloadLora(request, timeout=LORA_CALL_TIMEOUT_S) for w in workers),
            return_exceptions=True,
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                log.warning("unloading adapter %r on %s: %s", name, worker.worker_id, result)
        if errors:
            raise errors[0]

    def _live(self) -> list[WorkerInfo]:
        workers = self.picker.workers(WorkerRole.PREFILL) + self.picker.workers(WorkerRole.DECODE)
        if not workers:
            raise Unavailable(f"no live worker serves model {self.model_name!r}; retry later")
        return workers

    def _stub(self, worker: WorkerInfo) -> Any:
        channel = self.channels.get(worker.address)
        if worker.role is WorkerRole.PREFILL:
            return pb_grpc.PrefillWorkerStub(channel)
        return pb_grpc.DecodeWorkerStub(channel)


def _refused_outright(reply: object) -> bool:
    """A worker's answer that says it did not load the adapter (not a timeout or a lost
    connection, after which it may have)."""
    return isinstance(reply, grpc.aio.AioRpcError) and reply.code() in (
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.FAILED_PRECONDITION,
    )


def is_in_use(error: BaseException) -> bool:
    """A worker's refusal to unload an adapter requests still run under."""
    return isinstance(error, grpc.aio.AioRpcError) and (
        error.code() == grpc.StatusCode.FAILED_PRECONDITION
    )
