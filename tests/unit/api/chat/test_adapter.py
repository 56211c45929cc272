"""The Chat Completions adapter (trioserve/api/chat/adapter.py) over the serving core and a scripted
runtime (tests/fakes/core.py): wire shapes of the core's events, no processes."""

from __future__ import annotations

import json

import pytest

from trioserve.api.chat.adapter import ServingChat
from trioserve.worker.runtime import GenerationError

from tests.fakes.core import scripted_core

CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2_CUT = '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


def body(**extra) -> bytes:
    return json.dumps({"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                       **extra}).encode()


async def sse(stream) -> list:
    events = []
    try:
        async for chunk in stream.body:
            for line in chunk.decode().split("\n\n"):
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append(data if data == "[DONE]" else json.loads(data))
    finally:
        stream.cancel()
    return events


async def test_budget_in_the_second_call_is_length_with_one_call_non_stream():
    core, _ = scripted_core(([CALL_1, CALL_2_CUT], {"finish_reason": "length"}))
    answer = await ServingChat(core).create(body(tools=TOOLS, max_tokens=120))
    assert answer.headers == {}  # nothing was ignored
    choice = answer.body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["message"]["content"] is None


async def test_budget_in_the_second_call_is_length_with_one_call_stream():
    core, _ = scripted_core(([CALL_1, CALL_2_CUT], {"finish_reason": "length"}))
    stream = await ServingChat(core).create(body(tools=TOOLS, max_tokens=120, stream=True))
    events = await sse(stream)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [c["index"] for c in calls] == [0]
    assert "".join(d.get("content") or "" for d in deltas) == ""
    assert events[-2]["choices"][0]["finish_reason"] == "length"


async def test_stream_shapes_role_content_finish_usage_done():
    core, _ = scripted_core((["Hel", "lo"], {"reused_prompt_tokens": 2}))
    stream = await ServingChat(core).create(body(stream=True, stream_options={"include_usage": True}))
    events = await sse(stream)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"].get("content") for e in events[1:3]] == ["Hel", "lo"]
    assert events[3]["choices"][0]["finish_reason"] == "stop"
    assert events[4]["choices"] == [] and events[4]["usage"]["prompt_tokens_details"]["cached_tokens"] == 2
    assert events[5] == "[DONE]"


async def test_a_worker_failure_mid_stream_is_an_error_event_then_done():
    core, runtime = scripted_core((["partial"], {"fail_after": GenerationError("engine_error", "boom")}))
    stream = await ServingChat(core).create(body(stream=True))
    events = await sse(stream)
    assert events[-2]["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
    assert runtime.generations[0].cancel_requested


async def test_a_worker_failure_without_stream_is_an_api_error():
    from trioserve.errors import APIError
    core, _ = scripted_core((["partial"], {"fail_after": GenerationError("worker_unavailable", "gone")}))
    with pytest.raises(APIError) as info:
        await ServingChat(core).create(body())
    assert info.value.status == 503
