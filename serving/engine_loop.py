"""One thread owns a worker's LLMEngine: commands (``serving.engine_commands``) arrive
through a bounded queue, ``step()`` runs while any request runs, and results go back to the
asyncio loop.

That thread also builds the engine (``TorchThread``), and it is the only thread of a
worker that runs torch's parallel regions. libgomp keeps a team of threads for each
thread that starts one, and once the teams of a process hold more threads than there are
cores it lets them sleep at the end of every region, so that each of a step's hundreds of
regions then waits for a wake-up. A model loaded on the main thread and stepped on this
one ran at 60 tok/s against 96 with both on one thread (SmolLM2 bf16, 2 threads, batch 1,
2 cores; bench/RESULTS.md, 2026-11-29).

The engine has no threads and no locks, so nothing but this thread touches it. KV pools
are the exception by design: transports read or write blocks that a request holds and
the engine leaves alone until the request moves on (PREFILLED or RESERVED), or, on a
prefill worker, blocks whose layers the engine has finished writing (kv_push.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from engine.engine_figures import engine_stats
from engine.executor.multiproc import RankLost
from engine.llm_engine import LLMEngine
from engine.outputs import RequestDelta
from serving.engine_commands import EngineCommand, ReadOwnedBlocks
from serving.rpc import Overloaded
from tandem.v1.worker_pb2 import StatsReply

log = logging.getLogger(__name__)

T = TypeVar("T")
Payload = TypeVar("Payload")


class TorchThread:
    """A worker's one torch thread: ``call`` runs functions on it (building the engine),
    ``run_forever`` hands it its last one (the engine loop). After the engine is built,
    ``confine_torch`` keeps the calling thread's own torch work (KV transports' copies)
    out of parallel regions."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[
            tuple[Callable[[], Any], concurrent.futures.Future[Any] | None]
        ] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on this thread; blocks until it returns or raises."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._jobs.put((lambda: fn(*args, **kwargs), future))
        return future.result()

    def run_forever(self, fn: Callable[[], None]) -> None:
        """Hands ``fn`` to the thread, which ends when ``fn`` returns."""
        self._jobs.put((fn, None))

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _serve(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if future is None:
                fn()
                return
            try:
                result = fn()
                _settle_thread_count()
            except BaseException as e:  # handed to the caller
                future.set_exception(e)
            else:
                future.set_result(result)


def _settle_thread_count() -> None:
    """ATen reads a thread's count once, lazily, from its process-wide one: read it now,
    while that is still this thread's (``confine_torch`` elsewhere changes it)."""
    import torch

    torch.get_num_threads()


def confine_torch() -> None:
    """The calling thread's parallel regions run on it alone from now on (OpenMP's
    thread count is per thread: the torch thread keeps its own). Call it on the asyncio
    thread once the engine is built on its TorchThread."""
    import torch

    torch.set_num_threads(1)


@dataclass(frozen=True)
class _Listener:
    on_step: Callable[[LLMEngine, list[RequestDelta]], Any]
    deliver: Callable[[Any], None]
    on_error: Callable[[BaseException], None]


@dataclass
class _Call:
    command: EngineCommand[Any]
    future: asyncio.Future[Any]


class EngineLoop(Generic[Payload]):
    """Runs ``engine`` in a thread of its own: ``thread``, the one that built it, else a
    new one.

    ``on_step(engine, deltas)`` runs in the engine thread after each step (it may call
    the engine) and its result is handed to ``deliver`` on the asyncio loop, which
    assembles the deltas into outputs (``engine.output_processor``): the engine thread
    does not detokenize. A step that raises hands the exception to ``on_error`` there
    instead. ``listen`` adds a further service (a co-located worker's prefill side, over
    its decode side's engine): each step goes to every listener, in the order they came.
    """

    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        *,
        on_step: Callable[[LLMEngine, list[RequestDelta]], Payload],
        deliver: Callable[[Payload], None],
        on_error: Callable[[BaseException], None],
        max_queued_calls: int = 256,
        name: str = "engine",
        thread: TorchThread | None = None,
    ) -> None:
        self.engine = engine
        self.stats = engine_stats(engine)
        self._loop = loop
        self._listeners = [_Listener(on_step, deliver, on_error)]
        self._max_queued_calls = max_queued_calls
        self._calls: deque[_Call] = deque()
        self._num_bounded = 0
        self._cv = threading.Condition()
        self._is_stopping = False
        self._busy_since: float | None = None  # monotonic start of the calls or step running
        self._thread = thread if thread is not None else TorchThread(name)
        self._is_started = False

    def listen(
        self,
        on_step: Callable[[LLMEngine, list[RequestDelta]], T],
        deliver: Callable[[T], None],
        on_error: Callable[[BaseException], None],
    ) -> None:
        """Another service's ``on_step``, ``deliver`` and ``on_error`` (as the
        constructor's); before ``start``."""
        assert not self._is_started, "listen before start"
        self._listeners.append(_Listener(on_step, deliver, on_error))

    def start(self) -> None:
        self._is_started = True
        self._thread.run_forever(self._run)

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._is_stopping = True
            self._cv.notify()
        if not self._is_started:  # the loop runs what is queued, then ends
            self.start()
        self._thread.join(timeout)

    def is_alive(self, stall_s: float) -> bool:
        """Whether the engine thread runs and has not spent more than ``stall_s`` in one
        batch of calls or one step (a kernel that never returns, a deadlock): what the
        worker's liveness reports."""
        busy_since = self._busy_since
        if not self._is_started or not self._thread.is_alive():
            return False
        return busy_since is None or time.monotonic() - busy_since < stall_s

    def submit(self, command: EngineCommand[T]) -> asyncio.Future[T]:
        """Queues ``command`` (serving.engine_commands) for the engine thread. New work is
        refused with Overloaded when ``max_queued_calls`` of it waits or when stopping;
        cleanup and reads are never refused (the thread runs what is queued before it
        exits)."""
        future: asyncio.Future[T] = self._loop.create_future()
        with self._cv:
            if command.is_new_work:
                if self._is_stopping:
                    raise Overloaded("engine: shutting down")
                if self._num_bounded >= self._max_queued_calls:
                    raise Overloaded(
                        f"engine queue: {self._max_queued_calls} calls waiting; retry later"
                    )
                self._num_bounded += 1
            self._calls.append(_Call(command, future))
            self._cv.notify()
        return future

    async def call(self, command: EngineCommand[T]) -> T:
        return await self.submit(command)

    async def report_block_ids(self, reply: StatsReply) -> None:
        """Fills a Stats reply's block ids held by requests (with their holders' count) and
        the count of cached ones."""
        blocks = await self.call(ReadOwnedBlocks())
        reply.owned_block_ids.extend(blocks.owned)
        reply.owned_block_ref_counts.extend(blocks.ref_counts)
        reply.num_kv_blocks_cached = len(blocks.cached)

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not self._calls and not self._is_stopping and not self._is_busy():
                    if engine.wants_cost_refresh():
                        break
                    self._cv.wait()
                calls = list(self._calls)
                self._calls.clear()
                self._num_bounded = 0
                if self._is_stopping and not calls:
                    return
            if not calls and not self._is_busy():
                # Idle: adaptive speculation times a stale cost bucket, one K (a short
                # pause, within its budget), then looks for work again.
                self._busy_since = time.monotonic()
                try:
                    engine.refresh_costs()
                except Exception:  # the step costs stay as they are; serving goes on
                    log.exception("refreshing step costs failed; not refreshing them again")
                    engine.stop_cost_refresh()
                self._busy_since = None
                continue
            # The stats snapshot is taken before anything leaves this thread, so that a
            # client who saw a request end never reads figures from before its end.
            done: list[tuple[Callable[..., None], Any, Any]] = []
            self._busy_since = time.monotonic()
            for call in calls:
                try:
                    result = call.command.run(engine)
                except BaseException as e:  # handed to the caller
                    done.append((_reject, call.future, e))
                else:
                    done.append((_resolve, call.future, result))
            self.stats = engine_stats(engine)
            for fn, future, value in done:
                self._loop.call_soon_threadsafe(fn, future, value)
            if self._is_busy():
                self._busy_since = time.monotonic()
                try:
                    deltas = engine.step_deltas()
                    payloads = [listener.on_step(engine, deltas) for listener in self._listeners]
                except RankLost as e:  # not the requests' fault: they move elsewhere
                    engine.runner.executor.abandon()
                    exit_worker(str(e))
                except Exception as e:
                    log.exception("engine step failed")
                    self.stats = engine_stats(engine)
                    for listener in self._listeners:
                        self._loop.call_soon_threadsafe(listener.on_error, e)
                else:
                    self.stats = engine_stats(engine)
                    for listener, payload in zip(self._listeners, payloads, strict=True):
                        self._loop.call_soon_threadsafe(listener.deliver, payload)
            self._busy_since = None

    def _is_busy(self) -> bool:
        return self.engine.has_unfinished_requests()


EXIT_RANK_LOST = 3  # a split worker's exit code when one of its ranks ended


def exit_worker(why: str) -> None:
    """A rank of this worker's split engine has ended: the worker ends at once, so that
    the router moves its requests and the supervisor starts the worker (all its ranks)
    again, rather than failing them or serving on with an engine that cannot step."""
    print(f"{why}: this worker exits (code {EXIT_RANK_LOST})", file=sys.stderr, flush=True)
    os._exit(EXIT_RANK_LOST)


def _resolve(future: asyncio.Future[Any], result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _reject(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
