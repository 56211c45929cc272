"""errors.py: every constructor gives the status/type/code/param of its row in spec/README.md."""

import json

import pytest

from trioserve import errors

ROWS = [
    (errors.invalid_json("x"), 400, "invalid_request_error", "invalid_json", None),
    (errors.invalid_value("bad", "temperature"), 400, "invalid_request_error", "invalid_value", "temperature"),
    (errors.missing_required_parameter("messages"), 400, "invalid_request_error", "missing_required_parameter", "messages"),
    (errors.unsupported_parameters([("n", "only n=1")]), 400, "invalid_request_error", "unsupported_parameter", "n"),
    (errors.template_error("no"), 400, "invalid_request_error", "invalid_value", "messages"),
    (errors.context_length_exceeded(10, 8), 400, "invalid_request_error", "context_length_exceeded", "messages"),
    (errors.model_not_found("gpt-4"), 404, "invalid_request_error", "model_not_found", "model"),
    (errors.not_found("/v2/x"), 404, "invalid_request_error", "not_found", None),
    (errors.method_not_allowed("GET"), 405, "invalid_request_error", "method_not_allowed", None),
    (errors.request_too_large(4 << 20), 413, "invalid_request_error", "request_too_large", None),
    (errors.internal_error("boom"), 500, "server_error", "internal_error", None),
    (errors.server_busy(2), 503, "server_error", "server_busy", None),
    (errors.worker_unavailable("loading", 5), 503, "server_error", "worker_unavailable", None),
    (errors.model_busy("m", 1, 0), 409, "invalid_request_error", "model_busy", "model"),
    (errors.model_pinned("m"), 409, "invalid_request_error", "model_pinned", "model"),
    (errors.model_loading("m", 30), 503, "server_error", "model_loading", None),
    (errors.model_load_failed("m", "exit 1"), 503, "server_error", "model_load_failed", None),
    (errors.model_cannot_load("m", "no chat template", 60), 500, "server_error", "model_load_failed", None),
    (errors.model_memory_busy("m", ["a"], 30), 503, "server_error", "model_memory_busy", None),
    (errors.model_too_large("m", 2 << 30, 1 << 30), 507, "server_error", "model_too_large", "model"),
]


@pytest.mark.parametrize("err, status, type_, code, param", ROWS, ids=lambda v: str(v)[:30])
def test_each_row_has_its_status_type_code_param(err, status, type_, code, param):
    assert isinstance(err, errors.APIError)
    assert (err.status, err.type, err.code, err.param) == (status, type_, code, param)
    env = err.envelope()
    assert env == {"error": {"message": err.message, "type": type_, "param": param, "code": code}}
    json.dumps(env)  # serializable as is
    assert err.message


def test_503s_carry_retry_after():
    assert errors.server_busy(3).headers == {"Retry-After": "3"}
    assert errors.worker_unavailable("crashed", 7).headers == {"Retry-After": "7"}
    for error in (errors.model_loading("m", 1), errors.model_load_failed("m", "x"),
                  errors.model_memory_busy("m", [], 1)):
        assert int(error.headers["Retry-After"]) >= 1
    # spec §3: Retry-After is at least 1
    assert errors.worker_unavailable("crashed", 0).headers == {"Retry-After": "1"}
    assert "crashed" in errors.worker_unavailable("crashed").message
    assert errors.invalid_value("x", None).headers == {}

def test_a_model_that_cannot_load_is_not_to_be_retried():
    error = errors.model_cannot_load("m", "the model has no chat template", 60)
    assert error.headers == {"x-should-retry": "false"}  # no Retry-After: nothing to wait for
    assert "the model has no chat template" in error.message and "60 s" in error.message


def test_unsupported_message_names_every_offender_and_what_is_supported():
    err = errors.unsupported_parameters(
        [("n", "only n=1 is supported"), ("logprobs", "not supported")], ["temperature", "top_p"]
    )
    assert err.param == "n"
    assert "'n' (only n=1 is supported)" in err.message
    assert "'logprobs' (not supported)" in err.message
    assert "temperature, top_p" in err.message
    with pytest.raises(ValueError):
        errors.unsupported_parameters([])


def test_context_length_message_gives_the_numbers():
    assert "4096" in errors.context_length_exceeded(5000, 4096).message
    msg = errors.context_length_exceeded(4000, 4096, max_tokens=200).message
    assert "4200" in msg and "4000 in the messages" in msg and "200 in the completion" in msg


def test_method_not_allowed_sets_allow_header():
    assert errors.method_not_allowed("GET", ["POST"]).headers == {"Allow": "POST"}


def test_api_error_is_an_exception_with_the_message():
    err = errors.model_not_found("m", "served")
    assert str(err) == err.message and "served" in err.message
    with pytest.raises(errors.APIError):
        raise err
