"""Malformed input never crashes a worker: each bad line gets an error record."""

from __future__ import annotations


import pytest

MAX_LINE_BYTES = 16 * 1024 * 1024


def _err(w, raw: bytes):
    w.write_raw(raw)
    rec = w.record()
    assert rec["type"] == "error", rec
    return rec


@pytest.mark.parametrize(
    "raw,code,has_id",
    [
        (b"not json\n", "invalid_json", False),
        (b"{\"op\": \"ping\", \"id\": 1\n", "invalid_json", False),
        (b"\xff\xfe{}\n", "invalid_json", False),
        (b"[1, 2]\n", "invalid_request", False),
        (b"42\n", "invalid_request", False),
        (b"\"a string\"\n", "invalid_request", False),
        (b"{\"id\": 3}\n", "invalid_request", True),
        (b"{\"op\": 5, \"id\": 3}\n", "invalid_request", True),
        (b"{\"op\": \"frobnicate\", \"id\": 3}\n", "invalid_request", True),
        (b"{\"op\": \"ping\"}\n", "invalid_request", False),
        (b"{\"op\": \"ping\", \"id\": 0}\n", "invalid_request", False),
        (b"{\"op\": \"ping\", \"id\": -4}\n", "invalid_request", False),
        (b"{\"op\": \"ping\", \"id\": \"7\"}\n", "invalid_request", False),
    ],
)
def test_bad_lines(fake, raw, code, has_id):
    w = fake()
    rec = _err(w, raw)
    assert rec["code"] == code
    assert (rec["id"] is not None) == has_id
    assert w.request({"op": "ping", "id": 99}) == {"type": "pong", "id": 99}


@pytest.mark.parametrize(
    "fields,needle",
    [
        ({}, "prompt"),
        ({"prompt": "a", "prompt_segments": [{"text": "a"}]}, "prompt"),
        ({"prompt": 5}, "prompt"),
        ({"prompt_segments": "a"}, "prompt_segments"),
        ({"prompt_segments": [{"text": "a", "ids": [1]}]}, "prompt_segments"),
        ({"prompt_segments": [{"ids": ["a"]}]}, "ids"),
        ({"prompt_segments": [5]}, "prompt_segments"),
        ({"prompt_segments": [{"text": "a", "checkpoint": "yes"}]}, "checkpoint"),
        ({"prompt": "a", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": -2}, "max_new_tokens"),
        ({"prompt": "a", "max_new_tokens": 1.5}, "max_new_tokens"),
        ({"prompt": "a", "temperature": -1}, "temperature"),
        ({"prompt": "a", "temperature": "hot"}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "top_p": 1.5}, "top_p"),
        ({"prompt": "a", "top_k": -1}, "top_k"),
        ({"prompt": "a", "seed": -1}, "seed"),
        ({"prompt": "a", "seed": 2**32}, "seed"),
        ({"prompt": "a", "stop": "x"}, "stop"),
        ({"prompt": "a", "stop": [""]}, "stop"),
        ({"prompt": "a", "stop": [1]}, "stop"),
        ({"prompt": "a", "session_id": ""}, "session_id"),
        ({"prompt": "a", "session_id": 3}, "session_id"),
    ],
)
def test_bad_generate_fields(fake, fields, needle):
    w = fake()
    _, rec = w.generate(1, **fields)
    assert rec["type"] == "error" and rec["code"] == "invalid_request" and rec["id"] == 1
    assert needle in rec["message"]
    # The worker keeps serving, and the failed id counts as finished.
    texts, done = w.generate(2, prompt="ok")
    assert "".join(texts) == "ok"


def test_empty_prompt_and_invalid_token_id(fake):
    w = fake()
    _, rec = w.generate(1, prompt="")
    assert rec["code"] == "empty_prompt"
    _, rec = w.generate(2, prompt_segments=[])
    assert rec["code"] == "empty_prompt"
    _, rec = w.generate(3, prompt_segments=[{"text": "a"}, {"ids": [257]}])
    assert rec["code"] == "invalid_token_id"
    _, rec = w.generate(4, prompt_segments=[{"ids": [-1]}])
    assert rec["code"] == "invalid_token_id"
    texts, done = w.generate(5, prompt_segments=[{"text": "a"}, {"ids": [98]}, {"text": "c"}])
    assert "".join(texts) == "abc"


def test_session_op_field_errors(fake):
    w = fake()
    assert w.request({"op": "session_open", "id": 1})["code"] == "invalid_request"
    assert w.request({"op": "session_close", "id": 2, "session_id": ""})["code"] == "invalid_request"
    assert w.request({"op": "tokenize", "id": 3, "text": 5})["code"] == "invalid_request"


def test_line_too_long_is_discarded_not_buffered(fake):
    w = fake()
    limit = w.ready["max_line_bytes"]
    assert limit == MAX_LINE_BYTES
    big = b'{"op": "generate", "id": 1, "prompt": "' + b"a" * limit + b'"}\n'
    rec = _err(w, big)
    assert rec["code"] == "line_too_long" and rec["id"] is None
    # Exactly at the bound is accepted (unknown fields are ignored: padding).
    prefix = b'{"op": "ping", "id": 2, "pad": "'
    exact = prefix + b"b" * (limit - len(prefix) - 2) + b'"}'
    assert len(exact) == limit
    w.write_raw(exact + b"\n")
    assert w.record() == {"type": "pong", "id": 2}
    # Oversized lines in a row, then a normal one.
    for _ in range(2):
        assert _err(w, b"x" * (limit + (1 << 20)) + b"\n")["code"] == "line_too_long"
    assert w.request({"op": "ping", "id": 3}) == {"type": "pong", "id": 3}


def test_long_prompt_under_the_bound_is_accepted(fake):
    w = fake("--ctx", str(1 << 22))
    # 2 MiB: over the old 1 MiB bound of protocol 1.
    texts, done = w.generate(1, prompt="a" * (2 << 20), max_new_tokens=1)
    assert done["type"] == "done" and done["prompt_tokens"] == 2 << 20


def test_blank_lines_ignored(fake):
    w = fake()
    w.write_raw(b"\n   \n\t\n")
    assert w.request({"op": "ping", "id": 1}) == {"type": "pong", "id": 1}


def test_unknown_fields_ignored(fake):
    w = fake()
    texts, done = w.generate(1, prompt="ab", future_field={"x": 1})
    assert "".join(texts) == "ab"
