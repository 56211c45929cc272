"""sse: event framing and the chunk shapes of spec §7, fast path equal to the generic one."""

from __future__ import annotations

import json

import pytest

from trioserve.errors import worker_unavailable
from trioserve.api.chat.sse import ChunkFactory
from trioserve.api.streaming import DONE, chunk_bytes
from trioserve.model.tool_formats.base import make_tool_call

BASE = {"id": "chatcmpl-abc", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}


def event(raw: bytes) -> dict:
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    line = raw[len(b"data: "):-2]
    assert b"\n" not in line  # one line per event
    return json.loads(line.decode("utf-8"))


def events(raw: bytes) -> list[dict]:
    parts = raw.split(b"\n\n")
    assert parts[-1] == b""
    return [event(p + b"\n\n") for p in parts[:-1]]


def choice(delta, finish_reason=None):
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


@pytest.fixture(params=[False, True], ids=["no-usage", "include-usage"])
def factory(request) -> ChunkFactory:
    return ChunkFactory("chatcmpl-abc", 1700000000, "m", request.param)


def expected(factory, choices, usage=None):
    obj = {**BASE, "choices": choices}
    if factory.include_usage:
        obj["usage"] = usage
    return obj


def test_done_and_generic_encoding_are_compact_utf8():
    assert DONE == b"data: [DONE]\n\n"
    assert chunk_bytes({"a": "é", "b": [1, 2]}) == 'data: {"a":"é","b":[1,2]}\n\n'.encode()


def test_role_chunk(factory):
    assert event(factory.role_chunk()) == expected(factory, [choice({"role": "assistant", "content": ""})])


@pytest.mark.parametrize("text", ["Hello", "", " ", "é€😀", 'quote " back \\ slash', "line\nbreak\ttab",
                                  "\x00\x1f ctrl", "</script>", "\u2028"])
def test_content_chunk_fast_path_equals_generic_encoding(factory, text):
    raw = factory.content_chunk(text)
    assert event(raw) == expected(factory, [choice({"content": text})])
    generic = chunk_bytes(expected(factory, [choice({"content": text})]))
    assert raw == generic


def test_reasoning_chunk(factory):
    raw = factory.reasoning_chunk("think é")
    assert raw == chunk_bytes(expected(factory, [choice({"reasoning_content": "think é"})]))


def test_non_ascii_is_sent_as_utf8_not_escaped(factory):
    assert "é€😀".encode() in factory.content_chunk("é€😀")


def test_lone_surrogate_becomes_replacement_character(factory):
    assert event(factory.content_chunk("a\ud800b"))["choices"][0]["delta"]["content"] == "a\ufffdb"


def test_odd_ids_and_model_names_are_escaped():
    f = ChunkFactory('id"x', 1, 'mo"del/é', True)
    obj = event(f.content_chunk("t"))
    assert (obj["id"], obj["model"]) == ('id"x', 'mo"del/é')


def test_tool_calls_chunk_one_event_per_call_with_index_and_id(factory):
    calls = [make_tool_call("a", {"x": 1}), make_tool_call("b", {})]
    evs = events(factory.tool_calls_chunk(calls, first_index=0))
    assert len(evs) == 2
    for k, (ev, call) in enumerate(zip(evs, calls)):
        assert ev == expected(factory, [choice({"tool_calls": [{
            "index": k, "id": call["id"], "type": "function",
            "function": {"name": call["function"]["name"], "arguments": call["function"]["arguments"]}}]})])
    assert events(factory.tool_calls_chunk(calls[:1], first_index=3))[0]["choices"][0]["delta"]["tool_calls"][0]["index"] == 3
    assert factory.tool_calls_chunk([]) == b""


@pytest.mark.parametrize("reason", ["stop", "length", "tool_calls"])
def test_finish_chunk_has_empty_delta(factory, reason):
    assert event(factory.finish_chunk(reason)) == expected(factory, [choice({}, reason)])


def test_usage_chunk_has_no_choices_and_the_usage():
    f = ChunkFactory("chatcmpl-abc", 1700000000, "m", True)
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    assert event(f.usage_chunk(usage)) == {**BASE, "choices": [], "usage": usage}


def test_usage_key_absent_without_include_usage():
    f = ChunkFactory("chatcmpl-abc", 1700000000, "m", False)
    for raw in (f.role_chunk(), f.content_chunk("x"), f.reasoning_chunk("y"), f.finish_chunk("stop"),
                f.tool_calls_chunk([make_tool_call("a", {})])):
        assert "usage" not in event(raw)


def test_error_event_is_the_bare_envelope():
    env = worker_unavailable("crashed").envelope()
    assert event(ChunkFactory.error_event(env)) == env


def test_whole_stream_parses_in_order():
    f = ChunkFactory("chatcmpl-abc", 1700000000, "m", True)
    raw = (f.role_chunk() + f.content_chunk("Hi") + f.content_chunk(" there") + f.finish_chunk("stop")
           + f.usage_chunk({"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}))
    evs = events(raw)
    assert [e["choices"][0]["delta"] if e["choices"] else None for e in evs] == [
        {"role": "assistant", "content": ""}, {"content": "Hi"}, {"content": " there"}, {}, None]
    assert [e["usage"] for e in evs[:-1]] == [None] * 4 and evs[-1]["usage"]["total_tokens"] == 3
    assert len({(e["id"], e["created"], e["model"]) for e in evs}) == 1
