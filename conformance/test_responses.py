"""responses: the OpenAI Responses API, ``POST /v1/responses`` (spec §20) — shapes, the stream
event sequence, endings, input items, hosted tools, the store, sessions and refusals.

Every check holds for any model output (real or scripted): shapes, orders and invariants.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from conformance._support import check_error, json_of

pytestmark = pytest.mark.responses

MAX = 16


def _body(cfg, input: Any = "Say hello.", **params: Any) -> dict[str, Any]:
    return {"model": cfg.model, "input": input, "max_output_tokens": MAX, "temperature": 0, **params}


def _post(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/responses", json=body)


def _stream(client: httpx.Client, body: dict[str, Any]) -> tuple[httpx.Response, list[dict[str, Any]], list[str]]:
    """The response, its decoded events and the ``event:`` names, in order."""
    r = client.post("/responses", json=dict(body, stream=True))
    events: list[dict[str, Any]] = []
    names: list[str] = []
    for block in r.text.split("\n\n"):
        if not block.strip():
            continue
        for line in block.split("\n"):
            if line.startswith("event: "):
                names.append(line[len("event: "):])
            elif line.startswith("data: "):
                events.append(json.loads(line[len("data: "):]))
    return r, events, names


def _check_response(data: Any, cfg) -> dict[str, Any]:
    assert isinstance(data, dict) and data.get("object") == "response", f"not a response object: {data!r:.300}"
    assert isinstance(data.get("id"), str) and data["id"], "no response id"
    assert data.get("model") == cfg.model, f"model {data.get('model')!r}"
    assert data.get("status") in ("completed", "incomplete"), f"status {data.get('status')!r}"
    assert isinstance(data.get("output"), list), "output is not a list"
    usage = data.get("usage")
    assert isinstance(usage, dict), f"usage {usage!r}"
    for key in ("input_tokens", "output_tokens", "total_tokens"):
        assert isinstance(usage.get(key), int), f"usage.{key} {usage.get(key)!r}"
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"], f"usage {usage!r}"
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    assert isinstance(cached, int) and 0 <= cached <= usage["input_tokens"], f"cached_tokens {cached!r}"
    return data


def _text(data: dict[str, Any]) -> str:
    return "".join(part.get("text", "") for item in data["output"] if item.get("type") == "message"
                   for part in item.get("content", []) if part.get("type") == "output_text")


@pytest.mark.spec("§20.1")
def test_responses_non_stream_shape(client, cfg):
    """A string input gives a response object: id, model, status, message output with output_text, usage with cached_tokens."""
    data = _check_response(json_of(_post(client, _body(cfg))), cfg)
    messages = [item for item in data["output"] if item.get("type") == "message"]
    assert messages, f"no message item: {data['output']!r:.300}"
    assert all(item.get("role") == "assistant" and isinstance(item.get("id"), str) for item in messages)
    assert data["usage"]["output_tokens"] <= MAX


@pytest.mark.spec("§20.3")
def test_responses_stream_event_sequence(client, cfg):
    """Stream: event:/data: pairs, sequence_number 0..n, created → in_progress → … → completed/incomplete, items added then done."""
    r, events, names = _stream(client, _body(cfg))
    assert r.status_code == 200, f"HTTP {r.status_code}: {r.text[:300]!r}"
    assert r.headers.get("content-type", "").startswith("text/event-stream")
    assert names == [e.get("type") for e in events], "event: names differ from data types"
    assert [e.get("sequence_number") for e in events] == list(range(len(events))), "sequence numbers"
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types[:3]
    assert types[-1] in ("response.completed", "response.incomplete"), types[-1]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(added))), f"items added {added}, done {done}"
    final = _check_response(events[-1]["response"], cfg)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert _text(final) == deltas, "final output text differs from the deltas"


@pytest.mark.spec("§20.3")
def test_responses_item_done_before_the_next_item(client, cfg):
    """Each output item's events (and its done) come before anything of a later item."""
    _, events, _ = _stream(client, _body(cfg, "Write two short sentences.", max_output_tokens=40))
    last_seen: dict[int, int] = {}
    done_at: dict[int, int] = {}
    for i, e in enumerate(events):
        if "output_index" in e:
            last_seen[e["output_index"]] = i
            if e["type"] == "response.output_item.done":
                done_at[e["output_index"]] = i
    for index, position in done_at.items():
        assert last_seen[index] == position, f"events of item {index} after its done"
        later = [i for i, e in enumerate(events) if e.get("output_index", -1) > index]
        assert all(i > position for i in later), f"item {index + 1} started before item {index} was done"


@pytest.mark.spec("§20.3")
def test_responses_sdk_stream_accumulates(sdk, cfg):
    """The official SDK's responses.stream parses every event and assembles the final response."""
    with sdk.responses.stream(model=cfg.model, input="Say hello.", max_output_tokens=MAX,
                              temperature=0) as stream:
        events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        # get_final_response() needs response.completed; a budget-ended response is incomplete.
        final = stream.get_final_response() if events[-1].type == "response.completed" else events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert final.output_text == deltas


@pytest.mark.spec("§20.4")
def test_responses_budget_is_incomplete(client, cfg):
    """max_output_tokens ending the turn: status incomplete, incomplete_details.reason max_output_tokens."""
    data = json_of(_post(client, _body(cfg, "Count from 1 to 100, separated by commas.",
                                       max_output_tokens=5)))
    assert data.get("status") == "incomplete", f"status {data.get('status')!r}"
    assert data.get("incomplete_details") == {"reason": "max_output_tokens"}, data.get("incomplete_details")
    assert data["usage"]["output_tokens"] <= 5


@pytest.mark.spec("§20.2")
def test_responses_input_items(client, cfg):
    """Item input: developer instructions, a function call and its output, then a user message."""
    items = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "4"},
        {"type": "message", "role": "user", "content": "Answer in words."},
    ]
    tools = [{"type": "function", "name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}]
    _check_response(json_of(_post(client, _body(cfg, items, tools=tools, instructions="Reply in English."))), cfg)


@pytest.mark.spec("§20.4")
def test_responses_hosted_tool_is_reported_not_fatal(client, cfg):
    """A hosted web_search tool is not a 400: the response names it in x-trioserve-ignored-tools."""
    r = _post(client, _body(cfg, tools=[{"type": "web_search"}]))
    _check_response(json_of(r), cfg)
    assert r.headers.get("x-trioserve-ignored-tools") == "web_search", dict(r.headers)


@pytest.mark.spec("§4.1")
def test_responses_unknown_item_keys_are_reported_not_fatal(client, cfg):
    """Unknown keys inside input items are named in x-trioserve-ignored-fields; top-level ones stay 400."""
    items = [{"type": "message", "role": "user", "x_harness_meta": {"turn": 1},
              "content": [{"type": "input_text", "text": "Say hello.", "x_part_meta": 1}]}]
    r = _post(client, _body(cfg, items))
    _check_response(json_of(r), cfg)
    assert r.headers.get("x-trioserve-ignored-fields") == \
        "input[0].x_harness_meta, input[0].content[0].x_part_meta", dict(r.headers)
    check_error(_post(client, _body(cfg, items, x_harness_meta=1)), 400, "unsupported_parameter",
                "x_harness_meta")


@pytest.mark.spec("§20.5")
def test_responses_previous_response_id(client, cfg):
    """A stored response continues with previous_response_id; store: false ones cannot be continued."""
    first = json_of(_post(client, _body(cfg, "Remember the word apple.")))
    second = _post(client, _body(cfg, "Which word?", previous_response_id=first["id"]))
    _check_response(json_of(second), cfg)
    assert json_of(second).get("previous_response_id") == first["id"]
    unstored = json_of(_post(client, _body(cfg, store=False)))
    check_error(_post(client, _body(cfg, previous_response_id=unstored["id"])), 400,
                "previous_response_not_found", "previous_response_id")


@pytest.mark.spec("§20.5")
def test_responses_prompt_cache_key_reuses_the_prefix(client, cfg):
    """A follow-up turn under the same prompt_cache_key reports the first turn's prompt as cached."""
    key = "conformance-responses-session"
    first = json_of(_post(client, _body(cfg, "Tell me about the sea.", prompt_cache_key=key, store=False)))
    items = [{"role": "user", "content": "Tell me about the sea."}] + [
        {k: v for k, v in item.items() if k != "status"} for item in first["output"]] + [
        {"role": "user", "content": "And the sky?"}]
    second = json_of(_post(client, _body(cfg, items, prompt_cache_key=key, store=False)))
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"], (
        f"cached {second['usage']} after {first['usage']}")


@pytest.mark.spec("§20.6")
@pytest.mark.parametrize("extra, param, code", [
    ({"frequency_penalty": 1}, "frequency_penalty", "unsupported_parameter"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "unsupported_parameter"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type", "unsupported_parameter"),
    ({"tools": [{"type": "local_shell"}]}, "tools[0].type", "unsupported_parameter"),
    ({"truncation": "auto"}, "truncation", "unsupported_parameter"),
    ({"input": None}, "input", "missing_required_parameter"),
    ({"max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type", "invalid_value"),
])
def test_responses_refusals_name_the_field(client, cfg, extra, param, code):
    """Unsupported fields and item types, and invalid values: 400 in OpenAI's shape naming the path."""
    check_error(_post(client, dict(_body(cfg), **extra)), 400, code, param)
