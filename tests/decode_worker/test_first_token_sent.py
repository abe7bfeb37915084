"""A decode worker's stream after a first token the router already sent
(DecodeRequest.is_first_token_sent): its chunks start at index 1, with the text the router
did not send; a router text this worker would not make of the token is refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from decode_worker.chunk_stream import ChunkStream
from engine.outputs import RequestOutput
from engine.sequence import FinishReason
from tandem.v1 import worker_pb2 as pb


def stream(**request: Any) -> ChunkStream:
    handle = SimpleNamespace(
        request_id="r",
        num_output_tokens_sent=0,
        num_output_chars_sent=0,
        logprobs=None,
        num_prompt_tokens=3,
    )
    return ChunkStream(handle, pb.DecodeRequest(request_id="r", **request))  # type: ignore[arg-type]


def output(tokens: list[int], text: str, finished: bool = False) -> RequestOutput:
    reason = FinishReason.LENGTH if finished else None
    return RequestOutput("r", [1, 2, 3], tokens, text, finished, finish_reason=reason)


@pytest.mark.parametrize(
    ("router_text", "next_text"),
    [(" Par", "is is"), ("", " Paris is")],
    ids=["router_sent_the_text", "prefill_had_no_tokenizer"],
)
def test_chunks_start_after_the_routers_first_token(router_text: str, next_text: str) -> None:
    chunks = stream(is_first_token_sent=True, first_text=router_text)
    chunks.sent_by_router(output([7], " Par"), router_text)
    first = chunks.chunk(output([7], " Par"))
    assert (first.index, list(first.token_ids), first.text) == (
        1,
        [],
        "" if router_text else " Par",
    )
    last = chunks.chunk(output([7, 8, 9], " Paris is", finished=True))
    assert (last.index, list(last.token_ids)) == (1, [8, 9])
    assert first.text + last.text == next_text
    assert last.usage.completion_tokens == 3


def test_a_text_this_worker_would_not_make_is_refused() -> None:
    chunks = stream(is_first_token_sent=True, first_text=" London")
    with pytest.raises(RuntimeError, match="first_text: the router sent ' London'"):
        chunks.sent_by_router(output([7], " Par"), " London")
