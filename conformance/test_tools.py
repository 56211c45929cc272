"""tools: tool definitions are accepted and rendered, tool_choice none, tool-call shapes (§10).

Grows with the server: today it checks that tools are accepted, that tool_choice "none" never
yields tool calls, and that any tool call a server returns has the §10 shape.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conformance._support import (
    check_completion,
    check_stream,
    diff,
    expected_multiset,
    json_of,
    post_chat,
    stream_chat,
)

pytestmark = pytest.mark.tools

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = "What is the weather in Paris? Use the get_weather tool."


def _body(cfg, **kw):
    body = {"model": cfg.model, "messages": [{"role": "user", "content": ASK}], "tools": [TOOL], "temperature": 0}
    body["max_tokens"] = 200 if cfg.scripted else 48
    body.update(kw)
    return body


def _check_calls(calls, finish):
    assert isinstance(calls, list) and calls, f"tool_calls = {calls!r}"
    for c in calls:
        assert isinstance(c.get("id"), str) and c["id"], f"tool call id = {c.get('id')!r}"
        assert c.get("type") == "function", f"type = {c.get('type')!r}"
        fn = c.get("function") or {}
        assert fn.get("name") == "get_weather", f"name {fn.get('name')!r} is not a declared tool"
        args = fn.get("arguments")
        assert isinstance(args, str), f"arguments must be a JSON string, got {args!r}"
        assert isinstance(json.loads(args), dict), f"arguments not a JSON object: {args!r}"
    assert finish == "tool_calls", f"finish_reason {finish!r} with tool calls"


@pytest.mark.spec("§10")
def test_tools_accepted_auto(client, cfg):
    """tools with tool_choice auto: 200; any tool_calls have the §10 shape and finish_reason tool_calls."""
    n = len(cfg.script) if cfg.scripted else 1
    for _ in range(n):
        r = post_chat(client, _body(cfg, tool_choice="auto"))
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        ch = check_completion(data, cfg)
        calls = ch["message"].get("tool_calls")
        if calls:
            _check_calls(calls, ch["finish_reason"])
            if cfg.scripted:
                assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        else:
            assert ch["finish_reason"] != "tool_calls", "finish_reason tool_calls without tool_calls"


@pytest.mark.spec("§10")
def test_tool_choice_none_no_tool_calls(client, cfg):
    """tool_choice none: never tool_calls, never finish_reason tool_calls (scripted: markup stays text)."""
    n = len(cfg.script) if cfg.scripted else 1
    got = Counter()
    for _ in range(n):
        r = post_chat(client, _body(cfg, tool_choice="none"))
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        ch = check_completion(data, cfg)
        assert not ch["message"].get("tool_calls"), f"tool_calls with tool_choice none: {ch['message']!r}"
        assert ch["finish_reason"] != "tool_calls", "finish_reason tool_calls with tool_choice none"
        got[(ch["message"]["content"], ch["finish_reason"])] += 1
    if cfg.scripted:
        want = expected_multiset(cfg.script, max_tokens=200)
        assert got == want, diff(got, want)


@pytest.mark.spec("§10")
def test_tools_stream(client, cfg):
    """Streamed with tools: a valid §7 sequence; any tool_calls deltas carry index, id, type, name, arguments."""
    st = stream_chat(client, _body(cfg, tool_choice="auto"))
    check_stream(st, cfg, identity=False, usage_nulls=False)
    calls = [tc for c in st.chunks for ch in (c.get("choices") or []) for tc in ((ch.get("delta") or {}).get("tool_calls") or [])]
    if calls:
        for tc in calls:
            assert isinstance(tc.get("index"), int), f"tool call delta without index: {tc!r}"
        _check_calls(calls, st.finish_reasons[0])


@pytest.mark.spec("§5.5")
def test_tool_history_accepted(client, cfg):
    """A transcript with an assistant tool call (content null) and a tool result is accepted."""
    body = _body(cfg, max_tokens=8)
    body["messages"] = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp_c\": 21, \"sky\": \"clear\"}"},
    ]
    r = post_chat(client, body)
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)
