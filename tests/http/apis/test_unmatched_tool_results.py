"""A tool result must answer a tool call made earlier in the conversation (spec §3): a Chat
``tool`` message, a Messages ``tool_result`` block or a Responses ``function_call_output``
whose call id names no earlier call is a 400 naming the client's own field, as OpenAI and
Anthropic answer; the same result after its call, including a call stored under
``previous_response_id``, is served. Fake worker over real HTTP."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ..conftest import live_server

pytestmark = pytest.mark.usefixtures("no_leaks")

CHAT_TOOL = {"type": "function", "function": {"name": "get_weather",
                                              "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def chat(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "fake", "tools": [CHAT_TOOL], "messages": [
        {"role": "user", "content": "Weather?"}, *messages]}


def assistant_call(call_id: str) -> dict[str, Any]:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function",
         "function": {"name": "get_weather", "arguments": "{}"}}]}


def anthropic(*messages: dict[str, Any], count: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake", "messages": [
        {"role": "user", "content": "Weather?"}, *messages]}
    return body if count else {**body, "max_tokens": 20}


def tool_result(call_id: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id,
                                         "content": "sunny"}]}


async def test_chat_tool_message_without_its_call_is_a_400(tmp_path):
    async with live_server(tmp_path, script=["ok", "ok"]) as srv, srv.client() as client:
        orphan = await client.post("/v1/chat/completions", json=chat(
            assistant_call("call_a"), {"role": "tool", "tool_call_id": "call_b", "content": "x"}))
        matched = await client.post("/v1/chat/completions", json=chat(
            assistant_call("call_a"), {"role": "tool", "tool_call_id": "call_a", "content": "x"}))
    error = orphan.json()["error"]
    assert orphan.status_code == 400
    assert (error["code"], error["param"]) == ("invalid_value", "messages[2].tool_call_id")
    assert '"call_b"' in error["message"] and "messages[2].tool_call_id" in error["message"]
    assert matched.status_code == 200, matched.text


async def test_messages_tool_result_without_its_tool_use_is_a_400_in_anthropics_envelope(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        created = await client.post("/v1/messages", json=anthropic(tool_result("toolu_x")))
        counted = await client.post("/v1/messages/count_tokens", json=anthropic(tool_result("toolu_x"),
                                                                              count=True))
        matched = await client.post("/v1/messages", json=anthropic(
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_x",
                                               "name": "get_weather", "input": {}}]},
            tool_result("toolu_x")))
    for resp in (created, counted):
        body = resp.json()
        assert resp.status_code == 400 and body["type"] == "error", resp.text
        assert body["error"]["type"] == "invalid_request_error"
        assert "messages[1].content[0].tool_use_id" in body["error"]["message"]
    assert matched.status_code == 200, matched.text


async def test_responses_output_without_its_call_is_a_400_and_a_stored_call_counts(tmp_path):
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    async with live_server(tmp_path, script=[CALL, "It is sunny."]) as srv, srv.client() as client:
        orphan = await client.post("/v1/responses", json={"model": "fake", "tools": [tool], "input": [
            {"type": "message", "role": "user", "content": "Weather?"},
            {"type": "function_call_output", "call_id": "call_x", "output": "sunny"}]})
        first = (await client.post("/v1/responses", json={
            "model": "fake", "tools": [tool], "input": "Weather?"})).json()
        [call] = [item for item in first["output"] if item["type"] == "function_call"]
        follow_up = await client.post("/v1/responses", json={
            "model": "fake", "tools": [tool], "previous_response_id": first["id"],
            "input": [{"type": "function_call_output", "call_id": call["call_id"],
                       "output": json.dumps({"sky": "clear"})}]})
    error = orphan.json()["error"]
    assert orphan.status_code == 400
    assert (error["code"], error["param"]) == ("invalid_value", "input[1].call_id")
    assert follow_up.status_code == 200, follow_up.text
