"""The prefill side of a co-located worker: ``tandem.v1.PrefillWorker`` over its decode
side's engine, for the requests that decode side reserved.

The router routes to a co-located worker as to any pair: D.Reserve, P.Prefill, D.Decode,
with the same ledger states. Only the KV channel differs. Here it is in-process
(``kv_transfer.in_place``): the engine computes the prompt straight into the blocks the
decode side reserved (``LLMEngine.prefill_reserved``), and the hand-over tells the decode
side's receiver that they are written. Nothing is pushed, copied or claimed: the blocks
are the decode side's from its Reserve on, and it alone frees them.

One Prefill: the hand-over opened (the reservation TRANSFERRING) -> the reserved request
joins the batch prefill-only -> first token (and drafts) sampled, blocks kept (PREFILLED)
-> the hand-over written -> reply. Ledger: PREFILLING -> TRANSFERRING (this worker) ->
DECODING (handed to the decode side: this worker again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.sequence import FinishReason
from kv_transfer import Handshake, InPlaceChannel, InPlaceHandOver, KvLayout
from ledger.membership import Membership
from prefill_worker.prefill_calls import PrefillCalls, collect, first_output, prefill_reply
from prefill_worker.transitions import PrefillTransitions
from serving.engine_commands import PrefillReserved
from serving.engine_loop import EngineLoop
from serving.metrics import ColocatedMetrics, PrefillMetrics
from serving.rpc import Overloaded, PreconditionFailed
from serving.sampling import params_from_proto
from tandem.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")


async def _unless_dropped(future: asyncio.Future[T], hand_over: InPlaceHandOver) -> T:
    """The engine's answer; a reservation that the decode side drops meanwhile (the
    request closed there: its lease lost, Redis restarted) ends the request in the engine,
    which then answers nothing: the Prefill fails at once, as a push would."""
    ended = asyncio.ensure_future(hand_over.until_ended())
    waits: set[asyncio.Future[Any]] = {future, ended}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        ended.cancel()
    if not future.done():
        hand_over.check_live()  # raises KvTransferError: dropped, or failed
    return await future


class InPlacePrefillService(PrefillCalls):
    """tandem.v1.PrefillWorker of a co-located worker (see the module's docstring): it
    shares the decode side's engine loop, membership and receiver."""

    def __init__(
        self,
        engine: LLMEngine,
        engine_loop: EngineLoop[Any],
        *,
        served_name: str,
        layout: KvLayout,
        draft: pb.DraftConfig | None,
        membership: Membership,
        channel: InPlaceChannel,
        max_queued: int = 256,
        metrics: ColocatedMetrics | PrefillMetrics | None = None,
    ) -> None:
        super().__init__(max_queued)
        self.engine = engine
        self.engine_loop = engine_loop
        self.served_name = served_name
        self.layout = layout
        self.draft = draft
        self.membership = membership
        self.transitions = PrefillTransitions(membership)
        self.channel = channel
        self.metrics: ColocatedMetrics | PrefillMetrics = metrics or PrefillMetrics()
        engine_loop.listen(collect, self._deliver, self._on_engine_error)

    async def Prefill(self, request: pb.PrefillRequest, context: Any) -> pb.PrefillReply:
        rid = request.request_id
        if request.decode_worker_id != self.membership.worker_id:
            raise PreconditionFailed(
                f"decode_worker_id: {request.decode_worker_id!r}; a co-located worker prefills "
                f"only for its own decode side ({self.membership.worker_id!r})"
            )
        self._admit(request)
        started = time.monotonic()
        try:
            hand_over = self.channel.open(
                Handshake(rid, self.layout, request.decode_epoch, request.lora, request.lora_digest)
            )
        except BaseException:
            self._done(rid)
            raise
        try:
            params = params_from_proto(request.sampling)
            future = self._first_token(rid)
            await self.engine_loop.call(PrefillReserved(rid, list(request.prompt_token_ids)))
            queued = time.monotonic()
            result = await _unless_dropped(future, hand_over)
            output, prefilled = first_output(request, params, result, self.engine.tokenizer)
            if output.finish_reason is FinishReason.PREEMPTED:  # the scheduler spares such
                raise Overloaded(  # rows while it has others: not expected
                    "kv cache: the engine handed the request back for lack of KV blocks "
                    "before its first token; retry later"
                )
            computed = time.monotonic()
            self.metrics.prefill_seconds.labels(self.metrics.role).observe(computed - queued)
            self.transitions.start_transfer(rid)
            hand_over.written()  # the decode side's Decode may take it on now
            self.transitions.hand_to_decode(rid, request.decode_worker_id, request.decode_epoch)
            timing = pb.PrefillTiming(
                queue_s=queued - started,
                compute_s=computed - queued,
                transfer_s=time.monotonic() - computed,
            )
            return prefill_reply(output, prefilled, params.logprobs, 0, timing)
        except BaseException as e:
            # The decode side's Decode, if it comes, fails; the router aborts the request
            # there, which drops it from the engine and frees its blocks.
            hand_over.fail(f"prefill failed or was cancelled: {type(e).__name__}: {e}")
            raise
        finally:
            self._done(rid)
