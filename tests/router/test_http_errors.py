"""How the HTTP API turns the router's refusals into OpenAI-shaped errors (no cluster:
tests/services/test_http_api.py covers them end to end)."""

from __future__ import annotations

import grpc

from router.http_api.errors import body_error, http_error
from router.validation import ValidationError
from serving.rpc import Overloaded, Unavailable


def test_a_refusal_naming_a_field_names_it_as_openai_does() -> None:
    error = http_error(ValidationError("token_ids: token id 70000 is outside the vocabulary"))
    assert (error.status, error.param, error.type) == (400, "prompt", "invalid_request_error")
    assert error.message == "prompt: token id 70000 is outside the vocabulary"
    assert error.body()["error"]["code"] == "invalid_argument"


def test_a_refusal_without_a_field_keeps_its_message() -> None:
    for message in ("bad", "two words: here"):  # "bad" once raised IndexError here
        error = http_error(ValueError(message))
        assert error.status == 400 and error.param is None and error.message == message
    assert http_error(ValueError("")).message == "ValueError"  # status_of's stand-in


def test_statuses() -> None:
    assert http_error(Overloaded("queue: full; retry later")).status == 429
    assert http_error(Unavailable("draining")).status == 503
    assert http_error(TimeoutError("deadline")).status == 504
    internal = http_error(RuntimeError("secret"))
    assert internal.status == 500 and "secret" not in internal.message
    assert grpc.StatusCode.INTERNAL.name.lower() == internal.code


def test_a_body_error_names_the_field_path() -> None:
    error = body_error([{"loc": ("body", "messages", 0, "role"), "msg": "too short"}])
    assert (error.param, error.message) == ("messages.0.role", "messages.0.role: too short")
    invalid_json = body_error([{"loc": ("body", 5), "type": "json_invalid", "msg": "x"}])
    assert invalid_json.param is None and invalid_json.message.startswith("body: not valid JSON")


def test_speculative_false_reaches_the_sampling_params_and_a_non_bool_is_refused() -> None:
    """Tandem's extra body field: false reaches the worker (the proto's optional field set);
    left out, the field stays unset (the worker's default, true); strict types refuse "no"."""
    import pydantic

    from router.http_api.convert import sampling
    from router.http_api.protocol import CompletionRequest

    off = CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": False})
    params = sampling(off, 0, 4)
    assert params.HasField("speculative") and params.speculative is False
    assert not sampling(
        CompletionRequest.model_validate({"model": "m", "prompt": "x"}), 0, 4
    ).HasField("speculative")
    try:
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": "no"})
    except pydantic.ValidationError as e:
        assert body_error(e.errors()).param == "speculative"
    else:
        raise AssertionError("a string for speculative was accepted")
