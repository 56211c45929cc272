"""``logit_bias`` (trioserve/core/logit_bias.py): the body's shape (OpenAI's rules), the ready
worker's support and vocabulary, the chat and legacy-completions parsers that use them, and the
generate record field (spec/worker-protocol.md §4)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve.api.chat.validation import parse_chat_request
from trioserve.api.completions.adapter import parse_completion_request
from trioserve.core.logit_bias import BiasSupport, MAX_ENTRIES, parse_logit_bias
from trioserve.errors import APIError
from trioserve.worker.protocol import Generate, GenerateParams, request_fields

LIMIT = 4 << 20


def _error(value: Any) -> APIError:
    with pytest.raises(APIError) as info:
        parse_logit_bias(value)
    return info.value


def test_valid_object_becomes_sorted_pairs():
    assert parse_logit_bias({"50256": -100, "7": 2.5, "0": 0, "0012": 100}) == (
        (0, 0.0), (7, 2.5), (12, 100.0), (50256, -100.0))
    assert parse_logit_bias(None) == ()
    assert parse_logit_bias({}) == ()
    assert parse_logit_bias({str(i): 1 for i in range(MAX_ENTRIES)})[-1] == (MAX_ENTRIES - 1, 1.0)


BAD = [
    ({"abc": 1}, "decimal digits"),
    ({"-1": 1}, "decimal digits"),
    ({" 1": 1}, "decimal digits"),
    ({"1.0": 1}, "decimal digits"),
    ({"": 1}, "decimal digits"),
    ({"\u0663": 1}, "decimal digits"),  # an Arabic-Indic digit: isdigit(), not an id
    ({"\ud800": 1}, "decimal digits"),  # a lone surrogate
    ({"1": 101}, "[-100, 100]"),
    ({"1": -101}, "[-100, 100]"),
    ({"1": 100.0001}, "[-100, 100]"),
    ({"1": "5"}, "number"),
    ({"1": None}, "number"),
    ({"1": True}, "number"),
    ({"1": {"2": 3}}, "number"),
    ({"1": [1]}, "number"),
    ({"1": float("nan")}, "[-100, 100]"),
    ({"1": float("inf")}, "[-100, 100]"),
    ({"1": 1, "01": 2}, "more than once"),
    ({str(i): 1 for i in range(MAX_ENTRIES + 1)}, "at most 300"),
    ([["1", 1]], "object"),
    ("x", "object"),
    (5, "object"),
]


@pytest.mark.parametrize("value,says", BAD)
def test_bad_values_are_invalid_value_on_logit_bias(value, says):
    err = _error(value)
    assert (err.status, err.code, err.param, err.type) == (400, "invalid_value", "logit_bias",
                                                           "invalid_request_error")
    assert says in err.message


def test_worker_support_and_vocabulary():
    llama = BiasSupport(engine="llama", supported=True, n_vocab=100)
    llama.check(((0, 1.0), (99, -100.0)))
    err = pytest.raises(APIError, llama.check, ((5, 1.0), (100, 1.0))).value
    assert (err.code, err.param) == ("invalid_value", "logit_bias")
    assert "token id 100" in err.message and "[0, 100)" in err.message
    fake = BiasSupport(engine="fake", supported=False, n_vocab=256)
    fake.check(())  # no bias: nothing to refuse
    err = pytest.raises(APIError, fake.check, ((1, 1.0),)).value
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "logit_bias")
    assert "(fake)" in err.message


def _chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}).encode()


def test_chat_parser_accepts_and_refuses():
    req = parse_chat_request(_chat(logit_bias={"3": -100, "1": 5}), served_model="m", max_body_bytes=LIMIT)
    assert req.logit_bias == ((1, 5.0), (3, -100.0))
    assert parse_chat_request(_chat(), served_model="m", max_body_bytes=LIMIT).logit_bias == ()
    # A lone surrogate as a raw JSON escape (json.dumps would write the same escape).
    raw = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "logit_bias": {"\\ud800": 1}}'
    for body in (_chat(logit_bias={"1": 101}), _chat(logit_bias={"x": 1}), raw):
        with pytest.raises(APIError) as info:
            parse_chat_request(body, served_model="m", max_body_bytes=LIMIT)
        assert (info.value.status, info.value.param) == (400, "logit_bias")


def test_completions_parser_accepts_and_refuses():
    ok = json.dumps({"model": "m", "prompt": "hi", "logit_bias": {"9": 1}}).encode()
    assert parse_completion_request(ok, served_model="m", max_body_bytes=LIMIT).logit_bias == ((9, 1.0),)
    bad = json.dumps({"model": "m", "prompt": "hi", "logit_bias": {"9": -101}}).encode()
    with pytest.raises(APIError) as info:
        parse_completion_request(bad, served_model="m", max_body_bytes=LIMIT)
    assert (info.value.status, info.value.param) == (400, "logit_bias")


def test_generate_record_carries_pairs_only_when_set():
    fields = request_fields(Generate(GenerateParams(prompt="x", logit_bias=((2, -100.0), (7, 1.5)))))
    assert fields["logit_bias"] == [[2, -100.0], [7, 1.5]]
    assert "logit_bias" not in request_fields(Generate(GenerateParams(prompt="x")))
