"""The Anthropic Messages answer side without processes (api/messages/wire.py): the response
object, stop reasons, the SSE encoder (checked by the ``anthropic`` SDK's own stream
accumulator) and the error envelope."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2  # the anthropic SDK's HTTP client package

from trioserve import errors
from trioserve.api.messages.wire import StreamEncoder, error_envelope, message_object, stop_reason
from trioserve.core.events import (
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    TurnResult,
    Usage,
)


def test_error_types_by_status():
    assert error_envelope(errors.server_busy())["error"]["type"] == "overloaded_error"
    assert error_envelope(errors.internal_error("x"))["error"]["type"] == "api_error"
    assert error_envelope(errors.APIError(401, "x", "no"))["error"]["type"] == "authentication_error"


USAGE = Usage(prompt_tokens=50, completion_tokens=7, cached_tokens=30)
EVENTS = [ReasoningDelta("think"), ReasoningDelta("ing"), TextDelta("Hello"), TextDelta(" you"),
          ToolCallStarted(0, "call_1", "Bash"), ToolCallArgumentsDelta(0, '{"command":'),
          ToolCallArgumentsDelta(0, ' "ls"}'), ToolCallDone(0, "call_1", "Bash", '{"command": "ls"}'),
          ToolCallStarted(1, "call_2", "Read"), ToolCallDone(1, "call_2", "Read", '{"path": "a"}'),
          Finished("tool_calls", USAGE)]


def test_message_object_blocks_and_usage():
    result = TurnResult("Hello you", "thinking", [e for e in EVENTS if isinstance(e, ToolCallDone)],
                        EVENTS[-1])
    msg = message_object("msg_1", "m", result)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg["content"][2]["input"] == {"command": "ls"}
    assert msg["stop_reason"] == "tool_use"
    assert msg["usage"] == {"input_tokens": 20, "output_tokens": 7, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 30}


def test_stop_reasons():
    assert stop_reason(Finished("length", USAGE)) == "max_tokens"
    assert stop_reason(Finished("stop", USAGE, stop_sequence="END")) == "stop_sequence"
    assert stop_reason(Finished("stop", USAGE)) == "end_turn"


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[7:], json.loads(data[6:])))
    return out


def encode_all(batches: list[list[Any]]) -> bytes:
    encoder = StreamEncoder("msg_1", "m")
    return encoder.start() + b"".join(encoder.encode(batch) for batch in batches)


def test_stream_event_order():
    raw = encode_all([EVENTS[:3], EVENTS[3:7], EVENTS[7:]])
    names = [name for name, _ in sse_events(raw)]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    starts = [d for n, d in sse_events(raw) if n == "content_block_start"]
    assert [s["index"] for s in starts] == [0, 1, 2, 3]
    assert [s["content_block"]["type"] for s in starts] == ["thinking", "text", "tool_use", "tool_use"]
    # A call with no argument deltas still sends its arguments once.
    deltas = [d["delta"] for n, d in sse_events(raw) if n == "content_block_delta" and d["index"] == 3]
    assert deltas == [{"type": "input_json_delta", "partial_json": '{"path": "a"}'}]


async def sdk_stream(raw: bytes):
    """Run the bytes through the anthropic SDK's ``messages.stream`` accumulator."""
    def handler(request: httpx2.Request) -> httpx2.Response:
        return httpx2.Response(200, headers={"content-type": "text/event-stream"}, content=raw)

    client = anthropic.AsyncAnthropic(api_key="x", base_url="http://test",
                                      http_client=httpx2.AsyncClient(transport=httpx2.MockTransport(handler)))
    async with client.messages.stream(model="m", max_tokens=10,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        async for _ in stream:
            pass
        return await stream.get_final_message()


async def test_sdk_accumulator_accepts_the_stream():
    final = await sdk_stream(encode_all([EVENTS[:3], EVENTS[3:7], EVENTS[7:]]))
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[0].thinking == "thinking" and final.content[1].text == "Hello you"
    assert final.content[2].input == {"command": "ls"} and final.content[3].input == {"path": "a"}
    assert final.stop_reason == "tool_use"
    assert final.usage.output_tokens == 7 and final.usage.cache_read_input_tokens == 30
    assert final.usage.input_tokens == 20


async def test_sdk_accepts_an_empty_answer_and_a_stop_sequence():
    final = await sdk_stream(encode_all([[Finished("stop", USAGE, stop_sequence="END")]]))
    assert final.content == [] and final.stop_reason == "stop_sequence"
    assert final.stop_sequence == "END"


def test_error_event_shape():
    encoder = StreamEncoder("msg_1", "m")
    [(name, data)] = sse_events(encoder.fail(errors.worker_unavailable("gone")))
    assert name == "error" and data["error"]["type"] == "overloaded_error"
