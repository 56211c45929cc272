"""messages: the Anthropic Messages API (§18) — response and stream shapes, count_tokens,
x-api-key auth, the request Claude Code sends, and Anthropic's error envelope.

Shape and invariant checks only (they hold for a scripted and a real model alike).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.messages

STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use"}
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}


def client(cfg, **headers: str) -> httpx.Client:
    base = {"x-api-key": cfg.api_key, "anthropic-version": "2023-06-01"}
    base.update(headers)
    return httpx.Client(base_url=cfg.root_url, timeout=httpx.Timeout(cfg.timeout, connect=5.0),
                        headers=base, limits=httpx.Limits(max_keepalive_connections=0))


def body(cfg, content: str = "Say hello.", **extra: Any) -> dict[str, Any]:
    return {"model": cfg.model, "max_tokens": 16, "messages": [{"role": "user", "content": content}], **extra}


def check_message(data: Any) -> dict[str, Any]:
    assert isinstance(data, dict), data
    assert data.get("type") == "message" and data.get("role") == "assistant", data
    assert isinstance(data.get("id"), str) and data["id"], data
    assert isinstance(data.get("content"), list), data
    for block in data["content"]:
        assert block.get("type") in ("text", "thinking", "tool_use"), block
    assert data.get("stop_reason") in STOP_REASONS, data
    usage = data.get("usage")
    assert isinstance(usage, dict), data
    for key in ("input_tokens", "output_tokens"):
        assert isinstance(usage.get(key), int) and usage[key] >= 0, usage
    return data


def check_anthropic_error(r: httpx.Response, status: int, error_type: str) -> str:
    assert r.status_code == status, f"expected HTTP {status}, got {r.status_code}: {r.text[:300]!r}"
    data = r.json()
    assert data.get("type") == "error" and isinstance(data.get("error"), dict), data
    assert data["error"].get("type") == error_type, data
    assert isinstance(data["error"].get("message"), str) and data["error"]["message"], data
    return data["error"]["message"]


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.decode("utf-8").split("\n\n"):
        if not block.strip():
            continue
        fields = dict(line.split(": ", 1) for line in block.split("\n") if ": " in line)
        assert "data" in fields, f"event without data: {block!r}"
        data = json.loads(fields["data"])
        name = fields.get("event", data.get("type"))
        assert name == data.get("type"), f"event name {name!r} != data.type {data.get('type')!r}"
        events.append((name, data))
    return events


@pytest.mark.spec("§18.2")
def test_non_streamed_message_shape(cfg):
    """POST /v1/messages answers a message object: content blocks, stop_reason, usage"""
    with client(cfg) as c:
        r = c.post("/v1/messages", json=body(cfg))
    assert r.status_code == 200, r.text[:300]
    check_message(r.json())


@pytest.mark.spec("§18.3")
def test_stream_event_sequence(cfg):
    """stream: message_start, blocks (start, deltas, stop with consistent indexes), message_delta, message_stop"""
    with client(cfg) as c:
        r = c.post("/v1/messages", json=body(cfg, stream=True, max_tokens=24))
    assert r.status_code == 200, r.text[:300]
    assert r.headers.get("content-type", "").startswith("text/event-stream")
    events = [e for e in sse_events(r.content) if e[0] != "ping"]
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-1] == "message_stop" and names[-2] == "message_delta", names
    open_index, next_index = None, 0
    for name, data in events[1:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index, (names, data)
            open_index = data["index"]
        elif name == "content_block_delta":
            assert data["index"] == open_index, (names, data)
            assert data["delta"]["type"] in ("text_delta", "thinking_delta", "input_json_delta",
                                             "signature_delta"), data
        elif name == "content_block_stop":
            assert data["index"] == open_index, (names, data)
            open_index, next_index = None, next_index + 1
        else:
            pytest.fail(f"unexpected event {name!r} inside the message: {names}")
    assert open_index is None, "a content block was never stopped"
    delta = events[-2][1]
    assert delta["delta"]["stop_reason"] in STOP_REASONS, delta
    assert isinstance(delta["usage"]["output_tokens"], int), delta


@pytest.mark.spec("§18.1")
def test_count_tokens_matches_the_prompt(cfg):
    """count_tokens counts exactly the prompt a /v1/messages request with that body uses"""
    conversation = {"model": cfg.model, "system": "You are terse.",
                    "messages": [{"role": "user", "content": "Name a colour."}]}
    with client(cfg) as c:
        counted = c.post("/v1/messages/count_tokens", json=conversation)
        assert counted.status_code == 200, counted.text[:300]
        n = counted.json()["input_tokens"]
        r = c.post("/v1/messages", json={**conversation, "max_tokens": 4})
    usage = check_message(r.json())["usage"]
    used = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0) + usage.get("cache_creation_input_tokens", 0)
    assert isinstance(n, int) and n == used, (n, usage)


@pytest.mark.spec("§18.2")
def test_max_tokens_stop_reason(cfg):
    """max_tokens 1: stop_reason max_tokens (or end_turn for an empty answer), one output token at most"""
    with client(cfg) as c:
        r = c.post("/v1/messages", json=body(cfg, max_tokens=1))
    data = check_message(r.json())
    assert data["usage"]["output_tokens"] <= 1, data
    assert data["stop_reason"] in ("max_tokens", "end_turn"), data


@pytest.mark.spec("§18.1")
def test_claude_code_request_is_accepted(cfg):
    """Claude Code's request: ?beta=true, unknown anthropic-beta, billing line, adaptive thinking, extras"""
    request = {
        "model": cfg.model, "max_tokens": 16, "stream": False,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9; cc_entrypoint=cli;"},
                   {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]},
                     {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}],
        "tools": [WEATHER], "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"}, "context_management": {"edits": []},
        "metadata": {"user_id": "conformance"}}
    with client(cfg, **{"anthropic-beta": "claude-code-20250219,made-up-beta-2099-01-01",
                        "x-claude-code-session-id": "conformance-session", "x-app": "cli"}) as c:
        r = c.post("/v1/messages?beta=true", json=request)
    assert r.status_code == 200, r.text[:300]
    check_message(r.json())


@pytest.mark.spec("§18.1")
def test_tool_use_and_tool_result_turns_are_accepted(cfg):
    """a conversation with an assistant tool_use and a user tool_result (string and blocks, is_error)"""
    request = body(cfg, tools=[WEATHER])
    request["messages"] += [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    with client(cfg) as c:
        r = c.post("/v1/messages", json=request)
    assert r.status_code == 200, r.text[:300]
    check_message(r.json())


@pytest.mark.spec("§18.1")
def test_bearer_auth_is_accepted_too(cfg):
    """Authorization: Bearer works like x-api-key"""
    with httpx.Client(base_url=cfg.root_url, timeout=cfg.timeout,
                      headers={"authorization": f"Bearer {cfg.api_key}"}) as c:
        r = c.post("/v1/messages", json=body(cfg))
    assert r.status_code == 200, r.text[:300]


@pytest.mark.spec("§18.4")
@pytest.mark.parametrize("case, request_body", [
    ("max_tokens missing", {"messages": [{"role": "user", "content": "x"}]}),
    ("empty messages", {"max_tokens": 8, "messages": []}),
    ("unknown block type", {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "bogus"}]}]}),
    ("bad role", {"max_tokens": 8, "messages": [{"role": "tool", "content": "x"}]}),
])
def test_bad_requests_get_anthropics_error_envelope(cfg, case, request_body):
    """invalid requests: 400 with {"type": "error", "error": {"type": "invalid_request_error", "message"}}"""
    with client(cfg) as c:
        r = c.post("/v1/messages", json={"model": cfg.model, **request_body})
    check_anthropic_error(r, 400, "invalid_request_error")


@pytest.mark.spec("§18.4")
def test_unsupported_content_is_refused_not_dropped(cfg):
    """an image block (which a text model cannot see) is a 400 naming it, not silently dropped"""
    request = body(cfg)
    request["messages"][0]["content"] = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "iVBORw0KGgo="}},
                                         {"type": "text", "text": "What is this?"}]
    with client(cfg) as c:
        r = c.post("/v1/messages", json=request)
    message = check_anthropic_error(r, 400, "invalid_request_error")
    assert "messages[0].content[0]" in message or "image" in message, message
