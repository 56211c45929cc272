"""Exact endings over real HTTP on the fake worker (spec §10, "Endings"): when the token
budget ends a turn inside a tool call, ``finish_reason`` is ``length``, the complete calls
before it are returned and the unfinished call's markup is never content."""

from __future__ import annotations

import json

import pytest

from ..conftest import chat_body, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL_1 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_2 = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
# The fake worker's tokens are bytes: the budget ends 20 bytes into the second call.
BUDGET = len(CALL_1.encode()) + 20


@pytest.mark.parametrize("stream", [False, True])
async def test_budget_inside_the_second_call_is_length_with_one_call_and_no_markup(tmp_path, stream):
    async with live_server(tmp_path, script=[CALL_1 + CALL_2]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            "weather?", tools=TOOLS, max_tokens=BUDGET, stream=stream))
        assert resp.status_code == 200
        if stream:
            events = parse_sse(resp.content)
            assert events[-1] == "[DONE]"
            deltas = [e["choices"][0]["delta"] for e in events[:-1] if e.get("choices")]
            finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e.get("choices")][-1]
            calls = [c for d in deltas for c in d.get("tool_calls") or []]
            content = "".join(d.get("content") or "" for d in deltas)
        else:
            choice = resp.json()["choices"][0]
            finish, calls = choice["finish_reason"], choice["message"].get("tool_calls") or []
            content = choice["message"]["content"] or ""
    assert finish == "length"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": "Paris"}]
    assert "<tool_call>" not in content and "get_weather" not in content
