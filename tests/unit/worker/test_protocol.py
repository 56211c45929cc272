"""The sans-IO worker protocol codec: bytes in → records out, requests → bytes, no I/O."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve.worker.protocol import (
    CLOSED,
    DEFAULT_MAX_LINE_BYTES,
    MAX_REQUEST_ID,
    NEED_DATA,
    Ack,
    Done,
    Error,
    Generate,
    GenerateParams,
    IdsSegment,
    Ping,
    Pong,
    ProtocolViolation,
    Ready,
    RecordDecoder,
    RequestRejected,
    SessionClose,
    SessionOpen,
    SessionReset,
    Shutdown,
    TextSegment,
    Token,
    Tokenize,
    Tokens,
    encode_cancel,
    prepare,
)

READY = {"type": "ready", "protocol": 2, "engine": "fake", "model": {"name": "m", "path": ""},
         "n_ctx": 4096, "n_vocab": 257, "capacity": 4, "max_line_bytes": 1 << 20,
         "max_batch_tokens": 512, "capabilities": {"supports_cancel": True, "multiplexed": True},
         "special_tokens": {"eos": "<|im_end|>"}, "chat_template": "{{ x }}"}


def line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


def records(decoder: RecordDecoder) -> list:
    out = []
    while (rec := decoder.next_record()) is not NEED_DATA and rec is not CLOSED:
        out.append(rec)
    return out


def serving_decoder(max_record_bytes: int | None = None) -> RecordDecoder:
    """A decoder past the handshake; ``max_record_bytes`` applies from then on."""
    d = RecordDecoder()
    d.receive_data(line(READY))
    assert isinstance(d.next_record(), Ready)
    if max_record_bytes is not None:
        d.max_record_bytes = max_record_bytes
    return d


# -- decoding: the ready handshake ----------------------------------------------------


def test_ready_record_is_typed():
    d = RecordDecoder()
    d.receive_data(line(READY))
    ready = d.next_record()
    assert ready == Ready(protocol=2, engine="fake", model_name="m", n_ctx=4096, n_vocab=257,
                          capacity=4, max_line_bytes=1 << 20, max_batch_tokens=512,
                          capabilities=READY["capabilities"], special_tokens=READY["special_tokens"],
                          chat_template="{{ x }}", raw=READY)
    assert ready.supports_cancel and ready.multiplexed
    assert d.next_record() is NEED_DATA


def test_ready_defaults_for_absent_optional_fields():
    d = RecordDecoder()
    d.receive_data(line({"type": "ready", "protocol": 2, "chat_template": None}))
    ready = d.next_record()
    assert (ready.capacity, ready.max_line_bytes, ready.model_name, ready.chat_template) == (
        1, DEFAULT_MAX_LINE_BYTES, "model", None)
    assert not ready.supports_cancel


@pytest.mark.parametrize("first", [
    {"type": "token", "id": 1, "text": "x"},
    dict(READY, protocol=1),
    dict(READY, protocol="2"),
    dict(READY, capacity=0),
])
def test_first_record_must_be_a_v2_ready(first):
    d = RecordDecoder()
    d.receive_data(line(first))
    with pytest.raises(ProtocolViolation):
        d.next_record()


def test_protocol_version_mismatch_names_both_versions():
    d = RecordDecoder()
    d.receive_data(line(dict(READY, protocol=1)))
    with pytest.raises(ProtocolViolation, match="protocol 1; this server speaks 2"):
        d.next_record()


def test_second_ready_is_a_violation():
    d = serving_decoder()
    d.receive_data(line(READY))
    with pytest.raises(ProtocolViolation, match="second ready"):
        d.next_record()


# -- decoding: framing ----------------------------------------------------------------


def test_partial_lines_wait_for_their_newline():
    d = serving_decoder()
    data = line({"type": "token", "id": 3, "text": "héllo"})
    for i in range(len(data) - 1):
        d.receive_data(data[i:i + 1])
        assert d.next_record() is NEED_DATA
    d.receive_data(data[-1:])
    assert d.next_record() == Token(id=3, text="héllo")


def test_several_records_in_one_chunk_come_out_in_order():
    d = serving_decoder()
    d.receive_data(line({"type": "token", "id": 1, "text": "a"}) + line({"type": "token", "id": 2, "text": "b"})
                   + line({"type": "pong", "id": 3}) + b'{"type": "tok')
    assert records(d) == [Token(1, "a"), Token(2, "b"), Pong(3)]
    d.receive_data(b'en", "id": 1, "text": "c"}\n')
    assert records(d) == [Token(1, "c")]


def test_crlf_line_endings_are_whitespace():
    d = serving_decoder()
    d.receive_data(b'{"type":"pong","id":9}\r\n')
    assert d.next_record() == Pong(9)


@st.composite
def chunked(draw):
    objs = [{"type": "token", "id": i + 1, "text": draw(st.text(min_size=1, max_size=5))}
            for i in range(draw(st.integers(0, 6)))]
    data = b"".join(line(o) for o in objs)
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=10)))
    chunks = [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
    return objs, [c for c in chunks if c]


@given(chunked())
@settings(max_examples=200, deadline=None)
def test_any_chunking_yields_the_same_records(case):
    objs, chunks = case
    d = serving_decoder()
    got = []
    for chunk in chunks:
        d.receive_data(chunk)
        got += records(d)
    d.receive_data(b"")
    assert d.next_record() is CLOSED
    assert got == [Token(o["id"], o["text"]) for o in objs]


def test_eof_between_records_is_closed():
    d = serving_decoder()
    d.receive_data(line({"type": "pong", "id": 1}))
    d.receive_data(b"")
    assert d.next_record() == Pong(1)
    assert d.next_record() is CLOSED
    assert d.next_record() is CLOSED
    with pytest.raises(RuntimeError):
        d.receive_data(b"more")


def test_eof_inside_a_record_is_a_violation():
    d = serving_decoder()
    d.receive_data(b'{"type":"token","id":1,"te')
    d.receive_data(b"")
    with pytest.raises(ProtocolViolation, match="inside a record"):
        d.next_record()


def test_overlong_line_fails_as_soon_as_the_bound_is_passed():
    d = serving_decoder(max_record_bytes=100)
    d.receive_data(b"x" * 100)
    assert d.next_record() is NEED_DATA  # exactly the bound: may still end here
    d.receive_data(b"x")
    with pytest.raises(ProtocolViolation, match="longer than 100 bytes"):
        d.next_record()


def test_overlong_line_with_its_newline_in_the_same_chunk():
    d = serving_decoder(max_record_bytes=30)
    d.receive_data(line({"type": "token", "id": 1, "text": "y" * 40}))
    with pytest.raises(ProtocolViolation, match="longer than 30"):
        d.next_record()


def test_line_of_exactly_the_bound_is_accepted():
    rec = b'{"type":"pong","id":1}'
    d = serving_decoder(max_record_bytes=len(rec))
    d.receive_data(rec + b"\n")
    assert d.next_record() == Pong(1)


def test_a_failed_decoder_stays_failed():
    d = serving_decoder()
    d.receive_data(b"garbage\n" + line({"type": "pong", "id": 1}))
    with pytest.raises(ProtocolViolation, match="not JSON"):
        d.next_record()
    with pytest.raises(ProtocolViolation, match="already failed"):
        d.next_record()


@pytest.mark.parametrize("raw, match", [
    (b"not json", "not JSON"),
    (b"\xff\xfe{}", "not JSON"),
    (b"", "not JSON"),
    (b"[1, 2]", "without a type"),
    (b'{"id": 1}', "without a type"),
    (b'{"type": 5, "id": 1}', "without a type"),
    (b'{"type": "telemetry", "id": 1}', "unknown type 'telemetry'"),
    (b'{"type": "token", "id": 1}', "missing 'text'"),
    (b'{"type": "token", "id": 1, "text": 5}', "'text' has type int"),
    (b'{"type": "token", "id": true, "text": "x"}', "'id' is a boolean"),
    (b'{"type": "token", "id": 0, "text": "x"}', "out of range"),
    (b'{"type": "token", "id": "1", "text": "x"}', "'id' has type str"),
    (b'{"type": "token", "text": "x"}', "missing 'id'"),
    (b'{"type": "done", "id": 1}', "missing 'finish_reason'"),
    (b'{"type": "done", "id": 1, "finish_reason": "stop", "cancelled": 1}', "'cancelled' has type int"),
    (b'{"type": "error", "id": 1}', "missing 'code'"),
    (b'{"type": "pong", "id": null}', "'id' has type NoneType"),
    (b'{"type": "tokens", "id": 1, "ids": [1, "2"]}', "non-integer"),
])
def test_garbage_is_a_protocol_violation(raw, match):
    d = serving_decoder()
    d.receive_data(raw + b"\n")
    with pytest.raises(ProtocolViolation, match=match):
        d.next_record()


# -- decoding: record types -------------------------------------------------------------


def test_done_record():
    raw = {"type": "done", "id": 7, "finish_reason": "length", "cancelled": False, "stop_string": None,
           "prompt_tokens": 21, "completion_tokens": 12, "queue_ms": 1, "ttft_ms": 2.5, "extra": [1]}
    d = serving_decoder()
    d.receive_data(line(raw))
    done = d.next_record()
    assert done == Done(id=7, finish_reason="length", cancelled=False, stop_string=None,
                        prompt_tokens=21, completion_tokens=12, queue_ms=1.0, ttft_ms=2.5, raw=raw)
    assert done.record["extra"] == [1]


def test_error_records_with_and_without_id():
    d = serving_decoder()
    d.receive_data(line({"type": "error", "id": 4, "code": "context_length_exceeded", "message": "m",
                         "prompt_tokens": 5000, "n_ctx": 4096})
                   + line({"type": "error", "id": None, "code": "invalid_json", "message": "bad"}))
    assert records(d) == [
        Error(id=4, code="context_length_exceeded", message="m", details={"prompt_tokens": 5000, "n_ctx": 4096}),
        Error(id=None, code="invalid_json", message="bad", details={}),
    ]


def test_ack_and_tokens_records():
    d = serving_decoder()
    d.receive_data(line({"type": "ack", "id": 2, "op": "session_open", "session_id": "s"})
                   + line({"type": "tokens", "id": 3, "ids": [1, 2, 3]}))
    assert records(d) == [Ack(2, "session_open", "s"), Tokens(3, (1, 2, 3))]


def test_unknown_fields_are_ignored():
    d = serving_decoder()
    d.receive_data(line({"type": "token", "id": 1, "text": "x", "logprob": -0.1}))
    assert d.next_record() == Token(1, "x")


# -- encoding -----------------------------------------------------------------------------


def decoded(request, rid: int = 5, max_line_bytes: int = 1 << 20) -> dict:
    data = prepare(request, max_line_bytes=max_line_bytes).line(rid)
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    return json.loads(data)


def test_generate_fields():
    params = GenerateParams(prompt="p", max_new_tokens=8, temperature=0.5, top_p=0.9, top_k=4, seed=3,
                            stop=("\n\n",), session_id="s", grammar='root ::= "a"')
    assert decoded(Generate(params), rid=12) == {
        "id": 12, "op": "generate", "prompt": "p", "max_new_tokens": 8, "temperature": 0.5, "top_p": 0.9,
        "top_k": 4, "stop": ["\n\n"], "seed": 3, "session_id": "s", "grammar": 'root ::= "a"'}


def test_generate_optional_fields_are_omitted():
    assert set(decoded(Generate(GenerateParams(prompt="p")))) == {
        "id", "op", "prompt", "max_new_tokens", "temperature", "top_p", "top_k", "stop"}


def test_prompt_segments_replace_the_prompt():
    params = GenerateParams(prompt_segments=(TextSegment("<|im_start|>"), TextSegment("hi", special=False),
                                             IdsSegment((1, 2))))
    wire = decoded(Generate(params))
    assert "prompt" not in wire
    assert wire["prompt_segments"] == [{"text": "<|im_start|>", "special": True},
                                       {"text": "hi", "special": False}, {"ids": [1, 2]}]


@pytest.mark.parametrize("request_, expected", [
    (Ping(), {"op": "ping"}),
    (Tokenize(text="abc"), {"op": "tokenize", "text": "abc"}),
    (Tokenize(prompt_segments=(TextSegment("a", special=False),)),
     {"op": "tokenize", "prompt_segments": [{"text": "a", "special": False}]}),
    (SessionOpen("s"), {"op": "session_open", "session_id": "s"}),
    (SessionClose("s"), {"op": "session_close", "session_id": "s"}),
    (SessionReset("s"), {"op": "session_reset", "session_id": "s"}),
    (Shutdown(), {"op": "shutdown"}),
])
def test_other_requests(request_, expected):
    assert decoded(request_, rid=MAX_REQUEST_ID) == {"id": MAX_REQUEST_ID, **expected}


def test_unicode_is_written_as_utf8_not_escapes():
    data = prepare(Generate(GenerateParams(prompt="日本 🎉")), max_line_bytes=1000).line(1)
    assert "日本 🎉".encode() in data


@pytest.mark.parametrize("params, field", [
    (GenerateParams(prompt="a\ud800b"), "prompt"),
    (GenerateParams(prompt="ok", stop=("fine", "\udfff")), "stop[1]"),
    (GenerateParams(prompt_segments=(IdsSegment((1,)), TextSegment("\udc00"))), "prompt_segments[1].text"),
    (GenerateParams(prompt="ok", session_id="\ud83d"), "session_id"),
    (GenerateParams(prompt="ok", grammar="root ::= \"\ud800\""), "grammar"),
])
def test_lone_surrogates_reject_only_the_request(params, field):
    with pytest.raises(RequestRejected) as info:
        prepare(Generate(params), max_line_bytes=1 << 20)
    assert info.value.code == "invalid_unicode"
    assert info.value.field == field
    assert field in info.value.message and "surrogate" in info.value.message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_numbers_reject_only_the_request(value):
    with pytest.raises(RequestRejected) as info:
        prepare(Generate(GenerateParams(prompt="p", top_p=value)), max_line_bytes=1 << 20)
    assert (info.value.code, info.value.field) == ("invalid_request", "top_p")


def test_line_bound_counts_the_widest_id():
    request = Generate(GenerateParams(prompt="p" * 100))
    widest = len(prepare(request, max_line_bytes=1 << 20).line(MAX_REQUEST_ID)) - 1  # without "\n"
    prepared = prepare(request, max_line_bytes=widest)
    assert len(prepared.line(MAX_REQUEST_ID)) - 1 == widest
    with pytest.raises(RequestRejected) as info:
        prepare(request, max_line_bytes=widest - 1)
    assert info.value.code == "line_too_long" and info.value.field is None


@pytest.mark.parametrize("rid", [0, -1, MAX_REQUEST_ID + 1])
def test_ids_out_of_range_are_our_bug(rid):
    with pytest.raises(ValueError):
        prepare(Ping(), max_line_bytes=100).line(rid)
    with pytest.raises(ValueError):
        encode_cancel(rid)


def test_cancel_frame_is_8_bytes_little_endian():
    assert encode_cancel(1) == b"\x01" + b"\x00" * 7
    assert struct.unpack("<Q", encode_cancel(MAX_REQUEST_ID))[0] == MAX_REQUEST_ID


@given(st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()),
               max_size=40))
@settings(max_examples=300, deadline=None)
def test_any_text_round_trips_or_is_rejected_for_surrogates(text):
    has_surrogate = any(0xD800 <= ord(c) <= 0xDFFF for c in text)
    try:
        wire = decoded(Generate(GenerateParams(prompt=text, stop=(text or "x",))))
    except RequestRejected as exc:
        assert has_surrogate and exc.code == "invalid_unicode"
    else:
        assert not has_surrogate
        assert wire["prompt"] == text and wire["stop"] == [text or "x"]


# -- decoding in batches: every complete record of a read ---------------------------------


def test_several_records_in_one_read_come_out_as_one_batch_in_order():
    d = serving_decoder()
    d.receive_data(line({"type": "token", "id": 1, "text": "a"}) + line({"type": "token", "id": 2, "text": "é"})
                   + line({"type": "done", "id": 1, "finish_reason": "stop", "prompt_tokens": 1,
                           "completion_tokens": 1}))
    batch = d.next_records()
    assert batch[:2] == [Token(1, "a"), Token(2, "é")] and isinstance(batch[2], Done) and len(batch) == 3
    assert d.next_records() is NEED_DATA


def test_a_record_split_across_reads_is_held_until_its_end_arrives():
    d = serving_decoder()
    whole = line({"type": "token", "id": 1, "text": "a"}) + line({"type": "token", "id": 1, "text": "bc"})
    cut = len(whole) - 7  # inside the second record
    d.receive_data(whole[:cut])
    assert d.next_records() == [Token(1, "a")]
    assert d.next_records() is NEED_DATA
    d.receive_data(whole[cut:])
    assert d.next_records() == [Token(1, "bc")]
    d.receive_data(b"")
    assert d.next_records() is CLOSED


def test_garbage_after_good_records_is_raised_after_they_are_delivered():
    d = serving_decoder()
    d.receive_data(line({"type": "token", "id": 1, "text": "a"}) + b"not json\n"
                   + line({"type": "token", "id": 1, "text": "b"}))
    assert d.next_records() == [Token(1, "a")]
    with pytest.raises(ProtocolViolation, match="not JSON"):
        d.next_records()
    with pytest.raises(ProtocolViolation):
        d.next_records()  # failed for good


def test_a_too_long_line_in_a_batch_is_a_violation():
    d = serving_decoder(max_record_bytes=64)
    d.receive_data(line({"type": "token", "id": 1, "text": "x" * 100}))
    with pytest.raises(ProtocolViolation, match="longer than 64"):
        d.next_records()


@pytest.mark.parametrize("bad", [{"id": True, "text": "a"}, {"id": 0, "text": "a"},
                                 {"id": MAX_REQUEST_ID + 1, "text": "a"}, {"id": 1, "text": 5},
                                 {"id": 1}, {"text": "a"}, {"id": 1.0, "text": "a"}])
def test_the_token_fast_path_refuses_what_the_field_rules_refuse(bad):
    d = serving_decoder()
    d.receive_data(line({"type": "token", **bad}))
    with pytest.raises(ProtocolViolation, match="malformed 'token' record"):
        d.next_records()


# -- decoding: the token record's fast path -----------------------------------------------


def _general(raw: bytes):
    """What the general path makes of a line: a Token, or "violation"."""
    try:
        obj = json.loads(raw)
    except ValueError:
        return "violation"
    if (type(obj) is dict and obj.get("type") == "token" and type(obj.get("id")) is int
            and 1 <= obj["id"] <= MAX_REQUEST_ID and type(obj.get("text")) is str):
        return Token(obj["id"], obj["text"])
    return "violation"


def _decoded(raw: bytes):
    d = serving_decoder()
    d.receive_data(raw + b"\n")
    try:
        return d.next_records()[0]
    except ProtocolViolation:
        return "violation"


# Lines in the worker's exact token shape (cpp/records.h write_token) around a text that is
# anything: escapes, quotes, backslashes, control bytes, invalid and surrogate UTF-8.
_TEXT_BYTES = st.lists(st.sampled_from([b"a", b"\\", b'"', b"\\u00e9", b"\\ud83d", b"\\ude00", b"\\n",
                                        b"\x01", b"\xc3\xa9", b"\xff", b"\xed\xa0\x80", b"}", b",",
                                        b"\\x", b"\\u12", b" "]), max_size=8).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(rid=st.one_of(st.integers(0, 2**64 + 1), st.just(-1)), text=_TEXT_BYTES,
       tail=st.sampled_from([b'"}', b'"}}', b'","x":1}', b'"', b"}"]))
def test_token_lines_decode_as_json_would(rid, text, tail):
    raw = b'{"type":"token","id":' + str(rid).encode() + b',"text":"' + text + tail
    assert _decoded(raw) == _general(raw)


def test_a_token_line_with_leading_zeros_or_other_spacing_is_decoded_generally():
    assert _decoded(b'{"type":"token","id":01,"text":"a"}') == "violation"
    assert _decoded(b'{"type": "token", "id": 3, "text": "a"}') == Token(3, "a")
    assert _decoded(b'{"type":"token","id":3,"text":"\\ud800"}') == Token(3, "\ud800")
