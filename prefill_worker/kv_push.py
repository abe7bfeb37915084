"""Pushes a request's KV while its prefill runs: written layers leave in groups while the
engine computes the next ones, so the transfer overlaps the compute.

Engine thread: ``LayerRelay`` is the engine's layer listener; it hands "layers i..j of pool
p are written for these rows" to the event loop (a group of at least a transfer chunk's
bytes, or the pool's last layers of the step) and never blocks. Event loop: one
``LayerPush`` per request opens the push when Prefill arrives, sends each written layer's
newly complete blocks in order, and finishes after the last layer of the last chunk.

Which blocks a step sends, and why the loop may read them while the engine thread runs on:
- A chunk that does not end the prompt sends the blocks its tokens completed, from the
  first block not sent yet up to ``end // block_size``; the chunk that ends it sends the
  rest of the prompt's blocks, its partial last one included (the reservation's lookahead
  blocks hold no KV yet and are not sent). Later chunks write
  only positions from ``end`` on, all in blocks this step does not send: a block that
  straddles a chunk boundary leaves with the chunk that completes it (never twice), so no
  block is read while the engine may still write it, in this layer or any other.
- A layer is read only after the engine said it wrote it (on a GPU, after its event), and
  the draft pool only at the end of the step, once the drafter's proposals (which write
  draft KV past the prompt) are done.
- A prefill-only request is given blocks for its whole prompt when it is admitted (it
  never grows, so it is never preempted) and keeps them until Prefill frees them, after
  its push stopped: LLMEngine holds them even when the first token ends the request. No
  other request writes them meanwhile (prefix-cache sharers only read full blocks).
- Blocks the decode worker already caches (``num_cached_blocks``) are never sent; blocks
  this worker had cached (never computed in a step) go with the request's first step.

The push's engine clock (``stall_s``): the request's first layer, and each next one, must
come within ``stall_s`` of the moment the push starts waiting for it or of the last layer
the engine wrote for any request, whichever is later. A busy engine (computing other
prompts while this one queues behind them) writes layers all the time and fails no one; a
stuck one (a step that never returns, a dead thread) writes none, and every push waiting
on it fails (Unavailable: the router passes this worker over).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.model_runner import RowKv, StepKv
from kv_transfer import Handshake, KvPool, KvSender, TransferOptions
from kv_transfer.base import PagedPools
from kv_transfer.chunking import stalled
from serving.rpc import PreconditionFailed, Unavailable


@dataclass(frozen=True)
class _Written:
    """One layer of one pool, written for ``row`` by a step."""

    pool: KvPool
    layer: int
    row: RowKv
    event: Any  # torch.cuda.Event recorded after the layer's kernels (or later); None on a CPU


class LayerPush:
    """One request's push, fed layer by layer by ``LayerRelay``; ``task`` returns the KV
    bytes sent. Holds one of ``slots`` (bounded concurrent pushes) from begin to finish."""

    def __init__(
        self,
        sender: KvSender,
        handshake: Handshake,
        pools: Mapping[str, PagedPools],
        dst_block_ids: Sequence[int],
        num_cached_blocks: int,  # leading blocks the decode worker already holds
        block_size: int,
        slots: asyncio.Semaphore,
        stall_s: float = TransferOptions.stall_s,
        engine_progress: Callable[[], float] | None = None,
    ) -> None:
        self.sender = sender
        # The engine clock (the module's docstring); ``engine_progress``: when the engine
        # last wrote a layer for any request (time.monotonic). Without it only this
        # request's layers count, and its first layer has no clock (it may queue for as
        # long as its deadline).
        self.stall_s = stall_s
        self._engine_progress = engine_progress
        self.seconds = 0.0  # begin .. finish acknowledged
        self._handshake = handshake
        self._pools = pools
        self._dst = list(dst_block_ids)
        self._block_size = block_size
        self._slots = slots
        # Unbounded by type, bounded by the request: one entry per layer of each of its steps.
        self._queue: asyncio.Queue[_Written] = asyncio.Queue()
        self._next_block = {KvPool(name): num_cached_blocks for name in pools}
        self._end = {KvPool(name): 0 for name in pools}
        self._window: dict[KvPool, tuple[int, int]] = {}
        last = KvPool(list(pools)[-1])
        self._last = (last, len(pools[last].layers) - 1)  # the layer after which it finishes
        self._abort_reason = "prefill failed or was cancelled"
        self.task: asyncio.Task[int] = asyncio.create_task(self._run())

    def on_written(self, written: _Written) -> None:
        """Event loop: a layer the engine wrote (ignored once the push has ended)."""
        if not self.task.done():
            self._queue.put_nowait(written)

    async def wait(self) -> int:
        """Until the last layer is sent and acknowledged; the KV bytes sent."""
        return await self.task

    async def stop(self, reason: str) -> None:
        """Ends the push if it still runs (the receiver marks the request failed) and
        returns once it reads no more blocks, so that they can be freed."""
        if not self.task.done():
            self._abort_reason = reason
            self.task.cancel()
        await asyncio.wait({self.task})
        if not self.task.cancelled():
            self.task.exception()  # retrieved: the caller has already raised what mattered

    async def _run(self) -> int:
        try:
            async with self._slots:
                start = time.perf_counter()
                await self.sender.begin(self._handshake)
                written = await self._next_written("first")
                while not await self._send(written):
                    written = await self._next_written("next")
                await self.sender.finish()
                self.seconds = time.perf_counter() - start
        except BaseException:
            await self.sender.abort(self._abort_reason)
            raise
        return self.sender.num_bytes_sent

    async def _next_written(self, which: str) -> _Written:
        """The ``which`` ("first" or "next") layer the engine writes for this request;
        Unavailable (this worker's engine stopped) when the engine clock runs out."""
        if self._engine_progress is None and which == "first":
            return await self._queue.get()
        waiting_since = time.monotonic()
        while self._queue.empty():
            progress = waiting_since
            if self._engine_progress is not None:
                progress = max(progress, self._engine_progress())
            left = progress + self.stall_s - time.monotonic()
            if left <= 0:
                self._abort_reason = stalled(
                    self.stall_s, f"waiting for the engine's {which} layer"
                )
                raise Unavailable(
                    f"prefill worker: request {self._handshake.request_id}: {self._abort_reason}"
                )
            try:
                async with asyncio.timeout(left):
                    return await self._queue.get()
            except TimeoutError:
                pass  # look again: the engine may have written other requests' layers
        return self._queue.get_nowait()

    async def _send(self, written: _Written) -> bool:
        """Sends one written layer's blocks; True once it was the push's last layer."""
        pool, layer, row = written.pool, written.layer, written.row
        lo, hi = self._blocks(pool, layer, row)
        if hi > lo:
            if written.event is not None:
                await asyncio.to_thread(written.event.synchronize)
            src = row.block_table[lo:hi]
            kv = self._pools[pool].layers[layer]
            await self.sender.send_layer(pool, layer, kv, src, self._dst[lo:hi])
        return row.is_last and (pool, layer) == self._last

    def _blocks(self, pool: KvPool, layer: int, row: RowKv) -> tuple[int, int]:
        """Block indices [lo, hi) of the request that this step of ``pool`` sends: fixed at
        the step's layer 0 (every step tells layers in order), the same for every layer."""
        if layer == 0:
            if row.start < self._end[pool]:  # cannot happen for a prefill-only request
                raise RuntimeError(f"{pool} KV recomputed from {row.start}: preempted mid-push")
            # Blocks past the prompt's KV (a decode worker's lookahead slots, more than a
            # prefill worker's where only the decode worker drafts) have nothing to send.
            filled = -(-row.end // self._block_size)
            if len(self._dst) < filled:
                raise PreconditionFailed(
                    f"decode_block_ids: {len(self._dst)} blocks, but the prompt's KV fills {filled}"
                )
            lo = self._next_block[pool]
            end = filled if row.is_last else row.end // self._block_size
            hi = max(lo, min(end, len(self._dst)))
            self._end[pool], self._next_block[pool], self._window[pool] = row.end, hi, (lo, hi)
        return self._window[pool]


# A layer the relay holds for the event loop: its pool, its index, the pushes it is for.
_HeldLayer = tuple[KvPool, int, list[tuple[LayerPush, RowKv]]]


class LayerRelay:
    """The engine's layer listener: hands written layers to the pushes of the step's
    requests through the event loop, never blocking the engine thread. Layers go over in
    groups of at least ``group_bytes`` of KV (0: one by one), a pool's last layer ending
    its group: each hand-over runs the loop's Python, which holds the GIL the engine thread
    needs between its ops (a hand-over per layer slowed prefill, `bench/RESULTS.md`)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        device: torch.device,
        pools: Mapping[str, PagedPools],
        group_bytes: int = 0,
    ) -> None:
        # Request id -> its push: registered by the engine thread as the request is added
        # (``register``), unregistered from either thread (``unregister``), read by the
        # engine thread at every layer; the lock makes check-and-pop one step.
        self._pushes: dict[str, LayerPush] = {}
        self._lock = threading.Lock()
        # When the engine last wrote a layer, for any request (time.monotonic; written by
        # the engine thread, read by the event loop): the pushes' engine clock.
        self.last_written_at = time.monotonic()
        self.num_hand_overs = 0  # wake-ups of the event loop (engine thread only)
        self._loop = loop
        self._is_cuda = device.type == "cuda"
        self._group_bytes = group_bytes
        # Per pool: its number of layers, and the KV bytes one token takes in one layer.
        self._shapes = {
            name: (len(cache.layers), sum(t[0, 0].nbytes for t in cache.layers[0]))
            for name, cache in pools.items()
        }
        self._held: list[_HeldLayer] = []
        self._held_bytes = 0

    def register(self, request_id: str, push: LayerPush) -> None:
        """The request's layers go to ``push`` from its next step on (engine thread, as
        the request is added: never an earlier attempt's layers)."""
        with self._lock:
            self._pushes[request_id] = push

    def unregister(self, request_id: str, push: LayerPush) -> None:
        """No more layers to ``push``; a later attempt's push under the same id stays."""
        with self._lock:
            if self._pushes.get(request_id) is push:
                del self._pushes[request_id]

    def __call__(self, pool: str, layer: int, step: StepKv) -> None:
        self.last_written_at = time.monotonic()
        if layer == 0:
            self._held.clear()  # layers of a step that failed before its pool's last one
            self._held_bytes = 0
        if not self._pushes and not self._held:
            return
        with self._lock:
            rows = [
                (push, row)
                for row in step.rows
                if (push := self._pushes.get(row.request_id)) is not None
            ]
        if rows:
            self._held.append((KvPool(pool), layer, rows))
        num_layers, token_bytes = self._shapes[pool]
        self._held_bytes += token_bytes * sum(row.end - row.start for _, row in rows)
        is_pool_done = not self._group_bytes or layer == num_layers - 1
        if self._held and (is_pool_done or self._held_bytes >= self._group_bytes):
            # On a GPU the layers' kernels are only queued: the reader waits for this event.
            event = torch.cuda.Event() if self._is_cuda else None
            if event is not None:
                event.record()
            held, self._held, self._held_bytes = self._held, [], 0
            self.num_hand_overs += 1
            self._loop.call_soon_threadsafe(_hand_over, held, event)


def _hand_over(held: list[_HeldLayer], event: Any) -> None:
    for pool, layer, rows in held:
        for push, row in rows:
            push.on_written(_Written(pool, layer, row, event))
