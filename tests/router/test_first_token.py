"""The first token leaves the router with the prefill worker's reply, before the decode
worker is called (router/service.py): chunk 0 carries the token, its text, its logprob and
the prompt logprobs, and the decode worker is told to start after it. A first token that
ends the request, and a decode worker whose heartbeat does not say it streams after the
router's token (one from before, in a rolling update), get the decode worker's stream
whole. The router runs on a real Redis ledger; the workers are stand-ins for its hops."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from ledger.ledger import Ledger, WorkerRole
from ledger.membership import Membership, Timing
from router.route import Route
from router.routing import WorkerPicker
from router.service import GenerationService
from router.validation import ModelInfo, RequestValidator
from tandem.v1 import generation_pb2 as gen
from tandem.v1 import worker_pb2 as pb
from tests.router.test_retry_elsewhere import REFUSED

FIRST = 7
PROMPT_LOGPROBS = [gen.TokenLogprob(token_id=2, logprob=-1.5), gen.TokenLogprob(token_id=3)]


class _HeldStream:
    """A Decode call's stream: its chunks once ``release`` is set."""

    def __init__(self, chunks: list[gen.GenerateChunk], release: asyncio.Event) -> None:
        self.chunks, self.release = chunks, release

    def __aiter__(self) -> AsyncIterator[gen.GenerateChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[gen.GenerateChunk]:
        await self.release.wait()
        for chunk in self.chunks:
            yield chunk

    def cancel(self) -> None:
        pass


class _Router(GenerationService):
    """The router, its hops answered here: Reserve at once, Prefill with ``prefilled``,
    Decode with ``decoded`` held until ``release``."""

    def __init__(
        self, prefilled: pb.PrefillReply, decoded: list[gen.GenerateChunk], **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.prefilled, self.decoded = prefilled, decoded
        self.release = asyncio.Event()
        self.decode_requests: list[pb.DecodeRequest] = []

    async def _reserve(self, route: Route) -> pb.ReserveReply:
        return pb.ReserveReply(block_ids=[0], epoch=route.decode.epoch)

    async def _prefill(self, route: Route, reserve: pb.ReserveReply) -> pb.PrefillReply:
        return self.prefilled

    def _decoder(self, route: Route) -> Any:
        router = self

        class Stub:
            def Decode(self, request: pb.DecodeRequest, timeout: float) -> _HeldStream:
                router.decode_requests.append(request)
                return _HeldStream(router.decoded, router.release)

        return Stub()


class _Context:
    def time_remaining(self) -> float:
        return 30.0


def join(ledger: Ledger, worker_id: str, role: WorkerRole, **stats: int) -> None:
    epoch = ledger.register_worker(worker_id, role=role, address=REFUSED, capacity=1, ttl_ms=60_000)
    stats = {"model": "m", "draining": 0, "draft_fingerprint": "", "prefills_in_place": 0, **stats}
    ledger.heartbeat(worker_id, epoch=epoch, ttl_ms=60_000, load=0.1, stats=stats)


def make_router(
    ledger: Ledger,
    prefilled: pb.PrefillReply,
    decoded: list[gen.GenerateChunk],
    first_token_from_router: int = 1,
) -> _Router:
    join(ledger, "p0", WorkerRole.PREFILL)
    join(ledger, "d0", WorkerRole.DECODE, first_token_from_router=first_token_from_router)
    membership = Membership(
        ledger, "router-0", role=WorkerRole.ROUTER, address=REFUSED, capacity=0, timing=Timing()
    )
    membership.register()
    return _Router(
        prefilled,
        decoded,
        validator=RequestValidator(ModelInfo("m", vocab_size=64, max_model_len=64), None),
        picker=WorkerPicker(ledger, "m", refresh_s=0.0),
        membership=membership,
    )


def request(**sampling: Any) -> gen.GenerateRequest:
    return gen.GenerateRequest(
        request_id="mine",
        token_ids=gen.TokenIds(ids=[1, 2, 3]),
        sampling=gen.SamplingParams(max_tokens=3, **sampling),
    )


def chunk(index: int, tokens: list[int], text: str, **fields: Any) -> gen.GenerateChunk:
    return gen.GenerateChunk(request_id="mine", index=index, token_ids=tokens, text=text, **fields)


async def test_the_first_token_leaves_before_the_decode_worker_streams(ledger: Ledger) -> None:
    prefilled = pb.PrefillReply(
        first_token_id=FIRST,
        first_text=" seven",
        first_token_logprob=gen.TokenLogprob(token_id=FIRST, logprob=-0.25),
        prompt_logprobs=PROMPT_LOGPROBS,
        num_cached_tokens=2,
    )
    decoded = [
        chunk(1, [8], " eight", logprobs=[gen.TokenLogprob(token_id=8)]),
        chunk(
            2,
            [9],
            " nine",
            logprobs=[gen.TokenLogprob(token_id=9)],
            finish_reason=gen.FINISH_REASON_LENGTH,
        ),
    ]
    router = make_router(ledger, prefilled, decoded)
    stream = router.Generate(request(logprobs=0, prompt_logprobs=0), _Context())
    try:
        first = await asyncio.wait_for(anext(stream), 10)
        assert router.decode_requests == []  # D not called yet
        assert (first.index, list(first.token_ids), first.text) == (0, [FIRST], " seven")
        assert [(e.token_id, e.logprob) for e in first.logprobs] == [(FIRST, -0.25)]
        assert list(first.prompt_logprobs) == PROMPT_LOGPROBS
        assert first.finish_reason == gen.FINISH_REASON_UNSPECIFIED
        router.release.set()
        rest = [c async for c in stream]
        assert [(c.index, list(c.token_ids), c.text) for c in rest] == [
            (1, [8], " eight"),
            (2, [9], " nine"),
        ]
        assert not rest[0].prompt_logprobs  # on chunk 0 only
        assert rest[-1].usage.cached_tokens == 2
        (decode,) = router.decode_requests
        assert decode.is_first_token_sent and decode.first_token_id == FIRST
        assert decode.first_text == " seven"
    finally:
        await router.close()


@pytest.mark.parametrize("case", ["early", "finished_on_prefill", "older_decode_worker"])
async def test_who_streams_the_first_token(ledger: Ledger, case: str) -> None:
    """Without logprobs asked for, the router's chunk 0 carries none. A first token that
    ends the request, or a decode worker that does not announce it streams after the
    router's token, leave chunk 0 to the decode worker."""
    is_early = case == "early"
    is_finished = case == "finished_on_prefill"
    prefilled = pb.PrefillReply(first_token_id=FIRST, first_text=" seven", is_finished=is_finished)
    if is_early:
        decoded = [chunk(1, [8, 9], " eight nine", finish_reason=gen.FINISH_REASON_LENGTH)]
    elif is_finished:
        decoded = [chunk(0, [FIRST], " seven", finish_reason=gen.FINISH_REASON_STOP)]
    else:
        decoded = [chunk(0, [FIRST, 8, 9], " seven eight nine", finish_reason=2)]
    router = make_router(ledger, prefilled, decoded, int(case != "older_decode_worker"))
    router.release.set()
    try:
        got = [c async for c in router.Generate(request(), _Context())]
        (decode,) = router.decode_requests
        assert decode.is_first_token_sent is is_early
        assert [c.index for c in got] == ([0, 1] if is_early else [0])
        assert [t for c in got for t in c.token_ids] == ([FIRST] if is_finished else [FIRST, 8, 9])
        assert "".join(c.text for c in got) == (" seven" if is_finished else " seven eight nine")
        assert not any(c.logprobs for c in got)
    finally:
        await router.close()
