"""The outputs of requests that ``start_decoding`` joined to an engine, assembled from
their deltas as a decode worker assembles them (``LLMEngine.step`` assembles only those
of requests it saw start: the caller of ``start_decoding`` holds their first delta)."""

from __future__ import annotations

from engine.llm_engine import LLMEngine
from engine.output_processor import OutputProcessor
from engine.outputs import RequestDelta, RequestOutput


def drain_joined(engine: LLMEngine, firsts: list[RequestDelta]) -> dict[str, RequestOutput]:
    """Steps ``engine`` until it is idle; the finished output of each request, by id,
    ``firsts`` (the deltas ``start_decoding`` returned) included."""
    outputs = OutputProcessor(engine.tokenizer)
    done = {out.request_id: out for out in outputs.process(firsts) if out.finished}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in outputs.process(engine.step_deltas()) if o.finished})
    return done
