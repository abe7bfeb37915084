"""tandem.v1.SamplingParams -> engine SamplingParams, and engine logprobs -> the wire, on
the worker side only.

Unset optional fields take the engine's defaults; validation is the engine's own
(SamplingParamsError, a ValueError whose message starts with the field name). The router
checks the same limits without the engine (router/validation.py, tandem_client.wire).
"""

from __future__ import annotations

from engine.sampling_params import GrammarError, SamplingParams, StructuredOutput
from engine.sequence import FinishReason, TokenLogprobs
from tandem.v1 import generation_pb2 as gen


def params_from_proto(message: gen.SamplingParams) -> SamplingParams:
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=message.max_tokens if message.HasField("max_tokens") else defaults.max_tokens,
        temperature=(
            message.temperature if message.HasField("temperature") else defaults.temperature
        ),
        top_k=message.top_k,
        top_p=message.top_p if message.HasField("top_p") else defaults.top_p,
        min_p=message.min_p,
        seed=message.seed if message.HasField("seed") else None,
        stop=tuple(message.stop),
        stop_token_ids=tuple(message.stop_token_ids),
        ignore_eos=message.ignore_eos,
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=(message.prompt_logprobs if message.HasField("prompt_logprobs") else None),
        frequency_penalty=message.frequency_penalty,
        presence_penalty=message.presence_penalty,
        repetition_penalty=(
            message.repetition_penalty
            if message.HasField("repetition_penalty")
            else defaults.repetition_penalty
        ),
        logit_bias=dict(message.logit_bias),
        structured_output=structured_from_proto(message),
        speculative=message.speculative if message.HasField("speculative") else True,
    )


def structured_from_proto(message: gen.SamplingParams) -> StructuredOutput | None:
    """The constraint, checked here (JSON text) and compiled by the engine."""
    if not message.HasField("structured_output"):
        return None
    constraint = message.structured_output
    kind = constraint.WhichOneof("kind")
    if kind is None:
        raise GrammarError("structured_output: set one of json_object, json_schema, regex, grammar")
    if kind == "json_object":
        return StructuredOutput("json", thinking_end=constraint.thinking_end)
    return StructuredOutput(kind, getattr(constraint, kind), constraint.thinking_end)


def token_logprob_to_proto(lp: TokenLogprobs) -> gen.TokenLogprob:
    """One token's log-probability and its alternatives, most likely first."""
    top = sorted(lp.top.items(), key=lambda kv: -kv[1])
    return gen.TokenLogprob(
        token_id=lp.token_id,
        logprob=lp.logprob,
        top=[gen.TopLogprob(token_id=t, logprob=v) for t, v in top],
    )


# FinishReason.ERROR has no wire name: the request fails with INTERNAL (RequestFailed).
FINISH_REASONS: dict[FinishReason, gen.FinishReason.ValueType] = {
    FinishReason.STOP: gen.FINISH_REASON_STOP,
    FinishReason.LENGTH: gen.FINISH_REASON_LENGTH,
    FinishReason.ABORT: gen.FINISH_REASON_ABORT,
    FinishReason.PREEMPTED: gen.FINISH_REASON_PREEMPTED,
}


def finish_reason_to_proto(reason: FinishReason | None) -> gen.FinishReason.ValueType:
    """The wire's name of why an output ended: the one place the engine's FinishReason is
    mapped. A finished output without a reason, or with ERROR, is a bug here."""
    if reason is None or reason not in FINISH_REASONS:
        raise ValueError(f"finish_reason: {reason!r} is not sent as a chunk's reason")
    return FINISH_REASONS[reason]
