"""The Anthropic Messages wire layer without processes: request validation and its mapping to
the core request, the billing-line rule, the response object, the SSE encoder (checked by the
``anthropic`` SDK's own stream accumulator) and the error envelope."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx2  # the anthropic SDK's HTTP client package
import pytest

from trioserve import errors
from trioserve.api.messages.wire import (
    StreamEncoder,
    error_envelope,
    message_object,
    parse_messages_request,
    stop_reason,
)
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
from trioserve.core.request import ForcedTool

BILLING = "x-anthropic-billing-header: cc_version=2.1.332.abc; cc_entrypoint=cli;"


def parse(body: dict[str, Any], headers: dict[str, str] | None = None, **kw: Any):
    body = {"model": "m", "max_tokens": 100, **body}
    return parse_messages_request(json.dumps(body).encode(), served_model="m",
                                  max_body_bytes=1 << 20, headers=headers, **kw)


def user(text: str = "hi") -> dict[str, Any]:
    return {"role": "user", "content": text}


def test_claude_code_shaped_request_maps_to_the_core_request():
    req = parse({
        "system": [{"type": "text", "text": BILLING},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "Be terse."}],
        "messages": [
            user("list files"),
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "use Bash", "signature": ""},
                {"type": "text", "text": "Listing."},
                {"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                 "content": [{"type": "text", "text": "denied"}]},
                {"type": "text", "text": "continue"}]},
            {"role": "system", "content": [{"type": "text", "text": "reminder"}]},
            user("go on")],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END", "END", ""], "temperature": 0.5, "top_k": 5, "stream": True,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "high"}, "context_management": {"edits": []},
        "metadata": {"user_id": "{\"session\": 1}"}, "cache_control": {"type": "ephemeral"},
        "inference_geo": "us", "speed": "fast", "workspace_id": "w", "user_profile_id": "u",
    }, headers={"x-claude-code-session-id": "sess-1", "anthropic-beta": "whatever-2099"})
    core = req.core
    roles = [m.role for m in core.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool", "user", "system", "user"]
    assert core.messages[0].text == "You are an agent.\nBe terse."  # billing line dropped
    assert req.dropped_billing_line
    assistant = core.messages[2]
    assert assistant.reasoning == "use Bash" and assistant.text == "Listing."
    assert assistant.tool_calls[0].name == "Bash" and json.loads(assistant.tool_calls[0].arguments) == {"command": "ls"}
    assert core.messages[3].tool_call_id == "toolu_1" and core.messages[3].text == "a.txt"
    assert core.messages[4].text == "Error: denied"
    assert core.tool_choice == "required" and core.parallel_tool_calls is False
    assert core.tools[0].parameters == {"type": "object"}
    assert core.stops == ("END",) and core.max_tokens == 100
    assert core.sampling.temperature == 0.5 and core.sampling.top_k == 5
    assert core.session is not None and core.session.key == "sess-1"
    assert core.reasoning_effort is None  # the template reads no effort (default arguments)
    assert req.stream and req.thinking == "adaptive"


def test_billing_line_changes_do_not_change_the_core_request():
    a = parse({"system": [{"type": "text", "text": BILLING}, {"type": "text", "text": "S"}],
               "messages": [user()]})
    b = parse({"system": [{"type": "text", "text": BILLING.replace("abc", "def")},
                          {"type": "text", "text": "S"}], "messages": [user()]})
    assert a.core.messages == b.core.messages
    c = parse({"system": BILLING + "\nS", "messages": [user()]})
    assert c.core.messages == a.core.messages


def test_session_header_precedence_generic_headers_first():
    req = parse({"messages": [user()]}, headers={"x-session-id": "generic",
                                                 "x-claude-code-session-id": "cc"})
    assert req.core.session.key == "generic"
    with pytest.raises(errors.APIError) as exc:
        parse({"messages": [user()]}, headers={"x-claude-code-session-id": ""})
    assert exc.value.param == "x-claude-code-session-id"


def test_tool_choice_variants():
    tools = [{"name": "a", "input_schema": {"type": "object"}}]
    assert parse({"messages": [user()], "tools": tools,
                  "tool_choice": {"type": "tool", "name": "a"}}).core.tool_choice == ForcedTool("a")
    assert parse({"messages": [user()], "tools": tools,
                  "tool_choice": {"type": "none"}}).core.tool_choice == "none"
    assert parse({"messages": [user()], "tools": tools}).core.tool_choice == "auto"


def test_thinking_mapping():
    on = parse({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 2000},
                "max_tokens": 4000}, reasoning_effort_supported=True, can_reason=True)
    assert on.core.reasoning_effort == "high"
    off = parse({"messages": [user()], "thinking": {"type": "disabled"}},
                reasoning_effort_supported=True, can_reason=True)
    assert off.core.reasoning_effort == "none"
    effort = parse({"messages": [user()], "output_config": {"effort": "low"}},
                   reasoning_effort_supported=True, can_reason=True)
    assert effort.core.reasoning_effort == "low"


@pytest.mark.parametrize("body, param", [
    ({"messages": [user()], "max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "bogus"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [user(), {"role": "assistant", "content": "prefill"}]}, "messages[1]"),
    ({"messages": [user()], "tools": [{"type": "web_search_20250305", "name": "web_search",
                                       "input_schema": {}}]}, "tools[0].type"),
    ({"messages": [user()], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"messages": [user()], "temperature": 1.5}, "temperature"),
    ({"messages": [user()], "thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 100}}, "thinking.budget_tokens"),
    ({"messages": [user()], "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking.budget_tokens"),
    ({"messages": [user()], "max_tokens": 5000, "thinking": {"type": "enabled", "budget_tokens": 2000}}, "thinking"),
    ({"messages": [user()], "mcp_servers": [{}]}, "mcp_servers"),
    ({"messages": [user()], "diagnostics": {"previous_message_id": "msg_1"}}, "diagnostics"),
    ({"messages": [user()], "speed": "warp"}, "speed"),
    ({"messages": [user()], "frobnicate": 1}, "frobnicate"),
    ({"model": "other", "messages": [user()]}, "model"),
])
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(errors.APIError) as exc:
        parse(body)
    assert exc.value.param == param, exc.value
    envelope = error_envelope(exc.value)
    assert envelope["type"] == "error" and envelope["error"]["type"] in (
        "invalid_request_error", "not_found_error")
    assert param in envelope["error"]["message"]


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
