"""``POST /v1/responses`` over real HTTP on the fake worker (spec §20): the official ``openai``
SDK's ``responses.create`` and ``responses.stream`` (its typed event parser and accumulator),
the stream order (each item's done event when the item ends), tools (function, namespace,
freeform custom, hosted), endings, errors, the response store, session reuse over 8 turns and
disconnects.

The fake worker's tokens are bytes and its template is ChatML, with tools injected in the
Hermes format: a scripted ``<tool_call>{...}</tool_call>`` is a call.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from openai import AsyncOpenAI, BadRequestError

from ..conftest import live_server
from ..connections.test_cancellation import cancelled_ids, read_until, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def call(name: str, **arguments: Any) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def sdk(srv) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def parse_events(raw: bytes) -> list[dict[str, Any]]:
    events = []
    for block in raw.decode().split("\n\n"):
        if not block.strip() or block.startswith(":"):  # SSE comments (keep-alives)
            continue
        event_line, data_line = block.split("\n")
        assert event_line.startswith("event: ") and data_line.startswith("data: ")
        event = json.loads(data_line[len("data: "):])
        assert event["type"] == event_line[len("event: "):]
        events.append(event)
    return events


# --- the SDK ------------------------------------------------------------------------------------


async def test_sdk_create_returns_the_text_and_usage(tmp_path):
    async with live_server(tmp_path, script=["Hello from trioserve."]) as srv, sdk(srv) as client:
        response = await client.responses.create(model="fake", input="Say hello.",
                                                 instructions="Be brief.")
    assert response.status == "completed" and response.output_text == "Hello from trioserve."
    assert response.usage.output_tokens == len("Hello from trioserve.")
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.instructions == "Be brief." and response.id.startswith("resp_")


async def test_sdk_stream_typed_events_and_final_response(tmp_path):
    script = "Let me check." + call("get_weather", city="Paris")
    async with live_server(tmp_path, script=[script]) as srv, sdk(srv) as client:
        async with client.responses.stream(model="fake", input="Weather in Paris?",
                                           tools=[WEATHER]) as stream:
            types = [event.type async for event in stream]
            final = await stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    message, fc = final.output
    assert message.type == "message" and message.content[0].text == "Let me check."
    assert fc.type == "function_call" and fc.name == "get_weather"
    assert json.loads(fc.arguments) == {"city": "Paris"} and fc.call_id.startswith("call_")
    assert final.status == "completed"


# --- stream order -------------------------------------------------------------------------------


async def test_each_item_is_done_when_it_ends_and_sequence_numbers_count(tmp_path):
    # text, a call, more text: the message's done must come before the call starts, the
    # call's done before the next text; one byte per token, a few ms each.
    script = "First." + call("get_weather", city="Oslo") + "Then."
    async with live_server(tmp_path, script=[script], worker_args="--token-delay-ms 2") as srv, \
            srv.client() as client:
        resp = await client.post("/v1/responses", json={
            "model": "fake", "input": "go", "tools": [WEATHER], "stream": True})
    events = parse_events(resp.content)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    order = [(e["type"], e.get("output_index")) for e in events
             if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert order == [("response.output_item.added", 0), ("response.output_item.done", 0),
                     ("response.output_item.added", 1), ("response.output_item.done", 1),
                     ("response.output_item.added", 2), ("response.output_item.done", 2)]
    # Nothing of an item comes after its done event.
    done_at = {e["output_index"]: i for i, e in enumerate(events) if e["type"] == "response.output_item.done"}
    for i, event in enumerate(events):
        if "output_index" in event and event["type"] != "response.output_item.done":
            assert i < done_at[event["output_index"]]
    item_ids = {e["output_index"]: e["item"]["id"] for e in events if e["type"] == "response.output_item.added"}
    assert all(e["item_id"] == item_ids[e["output_index"]] for e in events if "item_id" in e)
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call", "message"]


async def test_item_done_arrives_while_the_generation_is_still_running(tmp_path):
    # Measured against the generation: the first message's done event is read while the worker
    # is still producing the call (the response is not over yet).
    script = "Short." + call("get_weather", city="x" * 300)
    async with live_server(tmp_path, script=[script], worker_args="--token-delay-ms 5") as srv:
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        payload = json.dumps({"model": "fake", "input": "go", "tools": [WEATHER], "stream": True}).encode()
        await stream.send_all(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                              b"application/json\r\n" + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                              + payload)
        data = await read_until(stream, b"response.output_item.done")
        assert srv.pool.busy  # the call is still being generated
        assert b"response.completed" not in data
        await read_until(stream, b"response.completed", timeout=20)
        await stream.aclose()


# --- tools --------------------------------------------------------------------------------------


async def test_namespace_tools_are_flattened_and_calls_mapped_back(tmp_path):
    namespace = {"type": "namespace", "name": "agents", "description": "sub-agents",
                 "tools": [{"type": "function", "name": "spawn", "parameters": {
                     "type": "object", "properties": {"task": {"type": "string"}}}}]}
    async with live_server(tmp_path, script=[call("agents__spawn", task="t")]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={"model": "fake", "input": "go",
                                                         "tools": [namespace]})
    [item] = resp.json()["output"]
    assert (item["type"], item["name"], item["namespace"]) == ("function_call", "spawn", "agents")


async def test_hosted_tools_are_not_offered_and_the_response_says_so(tmp_path, caplog):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={
            "model": "fake", "input": "go", "stream": True,
            "tools": [WEATHER, {"type": "web_search", "external_web_access": False}]})
    assert resp.status_code == 200
    assert resp.headers["x-trioserve-ignored-tools"] == "web_search"
    assert parse_events(resp.content)[-1]["type"] == "response.completed"


async def test_freeform_custom_tool_round_trips_and_a_grammar_is_refused_by_name(tmp_path):
    patch = "*** Begin Patch\n*** End Patch"
    custom = {"type": "custom", "name": "apply_patch", "description": "edit files"}
    async with live_server(tmp_path, script=[call("apply_patch", input=patch)]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={"model": "fake", "input": "go", "tools": [custom]})
        [item] = resp.json()["output"]
        assert (item["type"], item["name"], item["input"]) == ("custom_tool_call", "apply_patch", patch)
        lark = dict(custom, format={"type": "grammar", "syntax": "lark", "definition": "start: /.+/"})
        refused = await client.post("/v1/responses", json={"model": "fake", "input": "go", "tools": [lark]})
    err = refused.json()["error"]
    assert refused.status_code == 400 and err["code"] == "unsupported_parameter"
    assert err["param"] == "tools[0].format" and "apply_patch" in err["message"]


# --- endings ------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_budget_inside_the_second_call_is_incomplete_with_one_call(tmp_path, stream):
    first, second = call("get_weather", city="Paris"), "\n" + call("get_weather", city="Rome")
    async with live_server(tmp_path, script=[first + second]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={
            "model": "fake", "input": "go", "tools": [WEATHER], "stream": stream,
            "max_output_tokens": len(first) + 20})
    body = parse_events(resp.content)[-1]["response"] if stream else resp.json()
    if stream:
        assert parse_events(resp.content)[-1]["type"] == "response.incomplete"
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [o["type"] for o in body["output"]] == ["function_call"]
    assert json.loads(body["output"][0]["arguments"]) == {"city": "Paris"}


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": "x", "seed": 1}, 400, "unsupported_parameter", "seed"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "unsupported_parameter", "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, 400,
     "unsupported_parameter", "input[0].content[0].type"),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, 400, "unsupported_parameter", "include[0]"),
    ({"input": "x", "tools": [{"type": "local_shell"}]}, 400, "unsupported_parameter", "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "missing_required_parameter", "text.format.schema"),
    ({"input": "x", "max_output_tokens": 0}, 400, "invalid_value", "max_output_tokens"),
    ({}, 400, "missing_required_parameter", "input"),
    ({"input": "x", "model": "other"}, 404, "model_not_found", None),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 400, "previous_response_not_found",
     "previous_response_id"),
])
async def test_refusals_name_the_field_in_openais_shape(tmp_path, body, status, code, param):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={"model": "fake", **body})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["code"] == code and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param


async def test_sdk_raises_the_typed_error(tmp_path):
    async with live_server(tmp_path, script=["x"]) as srv, sdk(srv) as client:
        with pytest.raises(BadRequestError) as info:
            await client.responses.create(model="fake", input="x", truncation="auto")
    assert info.value.body["param"] == "truncation"


async def test_sdk_gets_the_early_context_refusal_for_many_input_items(tmp_path):
    """20,000 user input items through the official SDK: the turn bound's typed 400, naming
    ``input``, and the same server answers next."""
    async with live_server(tmp_path, script=["x"], max_body_bytes=8 << 20) as srv, sdk(srv) as client:
        with pytest.raises(BadRequestError) as info:
            await client.responses.create(model="fake", max_output_tokens=4,
                                          input=[{"role": "user", "content": ""}] * 20_000)
        assert (info.value.body["code"], info.value.body["param"]) == ("context_length_exceeded", "input")
        assert "take at least" in info.value.body["message"]
        answer = await client.responses.create(model="fake", input="hi")
        assert answer.output_text == "x"


async def test_json_schema_format_is_refused_without_grammar_support_naming_text_format(tmp_path):
    async with live_server(tmp_path, script=["{}"]) as srv, srv.client() as client:
        resp = await client.post("/v1/responses", json={"model": "fake", "input": "x", "text": {
            "format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format"


# --- store and previous_response_id ---------------------------------------------------------------


async def test_previous_response_id_continues_the_stored_conversation(tmp_path):
    async with live_server(tmp_path, script=["First answer.", "Second answer."]) as srv, srv.client() as client:
        first = (await client.post("/v1/responses", json={
            "model": "fake", "input": "Question one?", "prompt_cache_key": "c1"})).json()
        second = (await client.post("/v1/responses", json={
            "model": "fake", "input": "Question two?", "prompt_cache_key": "c1",
            "previous_response_id": first["id"]})).json()
        unstored = (await client.post("/v1/responses", json={
            "model": "fake", "input": "x", "store": False})).json()
        missing = await client.post("/v1/responses", json={
            "model": "fake", "input": "y", "previous_response_id": unstored["id"]})
    # The stored conversation was rendered exactly: the whole first turn is reused.
    usage1 = first["usage"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] == \
        usage1["input_tokens"] + usage1["output_tokens"]
    assert second["previous_response_id"] == first["id"] and unstored["store"] is False
    assert missing.status_code == 400 and missing.json()["error"]["code"] == "previous_response_not_found"


# --- session reuse ------------------------------------------------------------------------------


async def test_eight_turn_agent_conversation_reuses_the_reusable_tokens(tmp_path):
    """An agent loop as Codex runs it: developer instructions, then per turn the whole input
    sent back (assistant messages, function calls and their outputs), keyed by
    prompt_cache_key. Reusable = the previous turn's prompt + output."""
    replies = []
    for k in range(8):
        replies.append(f"Step {k}: " + call("get_weather", city=f"City{k}") if k % 2 == 0 else f"Done step {k}.")
    async with live_server(tmp_path, script=replies) as srv, srv.client() as client:
        items: list[dict[str, Any]] = [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are an agent. " * 20}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Start the task."}]}]
        fractions = []
        previous = None
        for k in range(8):
            body = {"model": "fake", "input": items, "tools": [WEATHER], "store": False,
                    "prompt_cache_key": "conversation-1", "stream": k % 2 == 1}
            resp = await client.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text
            response = parse_events(resp.content)[-1]["response"] if body["stream"] else resp.json()
            usage = response["usage"]
            if previous is not None:
                reusable = previous["input_tokens"] + previous["output_tokens"]
                fractions.append(usage["input_tokens_details"]["cached_tokens"] / reusable)
            previous = usage
            for item in response["output"]:
                items.append({k2: v for k2, v in item.items() if k2 != "status"})
                if item["type"] == "function_call":
                    items.append({"type": "function_call_output", "call_id": item["call_id"],
                                  "output": "sunny"})
            items.append({"type": "message", "role": "user", "content": f"Continue {k}."})
    assert len(fractions) == 7
    print("reuse per turn:", [round(f, 3) for f in fractions])
    assert sum(fractions) / len(fractions) >= 0.9, fractions


# --- disconnect ---------------------------------------------------------------------------------


async def test_disconnect_mid_stream_frees_the_slot(tmp_path):
    async with live_server(tmp_path, script=["x" * 2000, "next"], worker_args="--token-delay-ms 5") as srv:
        pid = srv.pool.worker_pid
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        payload = json.dumps({"model": "fake", "input": "go", "stream": True}).encode()
        await stream.send_all(b"POST /v1/responses HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                              b"application/json\r\n" + f"Content-Length: {len(payload)}\r\n\r\n".encode()
                              + payload)
        await read_until(stream, b'"delta":"x')
        await stream.aclose()
        await wait_for(lambda: not srv.pool.busy)
        assert cancelled_ids(srv) == [1]
        async with httpx.AsyncClient(base_url=srv.url, timeout=20) as client:
            resp = await client.post("/v1/responses", json={"model": "fake", "input": "again"})
            assert resp.json()["output"][0]["content"][0]["text"] == "next"
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
