"""What the two prefill services share (``service.py``, which pushes the KV to a decode
worker, and ``in_place.py``, a co-located worker's, which computes it into its decode
side's blocks): the Prefill calls in flight (``PrefillCalls``: admission, Abort, Stats,
drain), the first token's delta taken on the engine thread (``collect``), assembled into
the request's first output on the event loop (``first_output``), and the reply to the
router (``prefill_reply``)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from engine.llm_engine import LLMEngine
from engine.output_processor import OutputBuilder
from engine.outputs import (
    NON_FINITE_LOGITS,
    PrefilledRequest,
    RequestDelta,
    RequestFailed,
    RequestOutput,
    RequestStart,
)
from engine.sampling_params import SamplingParams
from engine.sequence import FinishReason
from ledger.membership import Membership
from serving.engine_loop import EngineLoop
from serving.lora_calls import LoraCalls
from serving.rpc import Overloaded, PreconditionFailed, Unavailable
from serving.sampling import token_logprob_to_proto
from tandem.v1 import worker_pb2 as pb
from tandem.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class Prefilled:
    delta: RequestDelta  # the first token (finished: the engine ended the request with it)
    prefilled: PrefilledRequest | None  # None when finished: no KV to hand on


def collect(engine: LLMEngine, deltas: list[RequestDelta]) -> list[Prefilled]:
    """Engine thread: each delta of a prefill-only request is its first token."""
    done = []
    for delta in deltas:
        if delta.finished:
            done.append(Prefilled(delta, None))
        elif (prefilled := engine.take_prefilled(delta.request_id)) is not None:
            done.append(Prefilled(delta, prefilled))
    return done


def first_output(
    request: pb.PrefillRequest, params: SamplingParams, result: Prefilled, tokenizer: Any
) -> tuple[RequestOutput, PrefilledRequest | None]:
    """The request's output with its first token, and what to hand on (None when that
    token ended it, by the engine's checks or by a stop string in its text). Raises
    RequestFailed when the engine ended it with FinishReason.ERROR."""
    prompt = list(request.prompt_token_ids)
    num_prompt = len(prompt) - request.num_output_tokens_sent
    start = RequestStart(prompt[:num_prompt], params, prompt[num_prompt:])
    builder = OutputBuilder(request.request_id, start, tokenizer)
    builder.take(result.delta)  # its first: always taken
    output = builder.output()
    if output.finish_reason is FinishReason.ERROR:
        raise RequestFailed(NON_FINITE_LOGITS)
    return output, None if output.finished else result.prefilled


def prefill_reply(
    output: RequestOutput,
    prefilled: PrefilledRequest | None,
    logprobs: int | None,
    num_bytes: int,
    timing: pb.PrefillTiming,
) -> pb.PrefillReply:
    reply = pb.PrefillReply(
        first_token_id=output.token_ids[-1] if output.token_ids else 0,  # 0: max_tokens 0
        # A resumed request's output holds its earlier tokens too: its text is not sent.
        first_text=output.text if len(output.token_ids) == 1 else "",
        draft_tokens=prefilled.draft_token_ids if prefilled else [],
        num_cached_tokens=output.num_cached_tokens,
        num_bytes_pushed=num_bytes,
        timing=timing,
        is_finished=output.finished,
    )
    if logprobs is not None and output.logprobs:
        reply.first_token_logprob.CopyFrom(token_logprob_to_proto(output.logprobs[-1]))
    for entry in output.prompt_logprobs or ():
        reply.prompt_logprobs.append(token_logprob_to_proto(entry))
    return reply


class PrefillCalls(LoraCalls, pb_grpc.PrefillWorkerServicer):
    """The Prefill calls a prefill service has in flight, each waiting for its first
    token from the engine loop: what both prefill services do alike."""

    engine: LLMEngine
    engine_loop: EngineLoop[Any]
    membership: Membership
    served_name: str
    draft: pb.DraftConfig | None

    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.is_draining = False
        self._waiting: dict[str, asyncio.Future[Prefilled]] = {}
        self._tasks: dict[str, asyncio.Task[Any]] = {}

    def _admit(self, request: pb.PrefillRequest) -> None:
        """Raises unless a Prefill of ``request`` may start now; else it is in flight
        (``_tasks``) until ``_done``."""
        rid = request.request_id
        if self.is_draining:
            raise Unavailable("prefill worker: draining")
        if request.model and request.model != self.served_name:
            raise PreconditionFailed(f"model: this worker serves {self.served_name!r}")
        if rid in self._tasks:
            raise ValueError(f"request_id: {rid!r} is already being prefilled here")
        if len(self._tasks) >= self.max_queued:
            raise Overloaded(f"prefill queue: {self.max_queued} requests in flight; retry later")
        task = asyncio.current_task()
        assert task is not None
        self._tasks[rid] = task

    def _first_token(self, request_id: str) -> asyncio.Future[Prefilled]:
        """What the engine loop delivers once the request's first token is sampled."""
        future = self._waiting[request_id] = asyncio.get_running_loop().create_future()
        return future

    def _done(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)
        self._tasks.pop(request_id, None)

    async def Abort(self, request: pb.AbortRequest, context: Any) -> pb.AbortReply:
        task = self._tasks.get(request.request_id)
        if task is None:
            return pb.AbortReply(was_known=False)
        log.info("abort %s: %s", request.request_id, request.reason or "no reason given")
        task.cancel()  # Prefill's cleanup drops it
        return pb.AbortReply(was_known=True)

    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsReply:
        stats = self.engine_loop.stats
        reply = pb.StatsReply(
            role=pb.WORKER_ROLE_PREFILL,
            worker_id=self.membership.worker_id,
            epoch=self.membership.epoch,
            model=self.served_name,
            num_kv_blocks_used=stats.num_used_blocks,
            num_kv_blocks_free=stats.num_free_blocks,
            num_running=len(self._tasks),
            num_waiting=stats.num_waiting,
            load=self._load(),
            block_size=self.engine.config.block_size,
        )
        if self.draft is not None:
            reply.draft.CopyFrom(self.draft)
        if request.include_block_ids:
            await self.engine_loop.report_block_ids(reply)
        return reply

    def add_to(self, server: Any) -> None:
        pb_grpc.add_PrefillWorkerServicer_to_server(self, server)

    def _load(self) -> float:
        """The engine's load, or the share of the queue in use if higher."""
        return min(1.0, max(self.engine_loop.stats.load, len(self._tasks) / self.max_queued))

    async def drain(self, timeout_s: float) -> None:
        """Refuses new prefills, waits for those in flight."""
        self.is_draining = True
        deadline = time.monotonic() + timeout_s
        while self._tasks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _deliver(self, results: list[Prefilled]) -> None:
        for result in results:
            future = self._waiting.get(result.delta.request_id)
            if future is not None and not future.done():
                future.set_result(result)

    def _on_engine_error(self, error: BaseException) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RuntimeError(f"engine step failed: {error}"))
