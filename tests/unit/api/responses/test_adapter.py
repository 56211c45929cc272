"""The Responses adapter (trioserve/api/responses/adapter.py) without processes: the stream
writer's event sequence over the core's events, the bounded store, and whole requests over a
scripted runtime (tests/fakes/core.py)."""

from __future__ import annotations

import json

import pytest

from trioserve import errors
from trioserve.api.responses.adapter import ResponseStore, ResponseWriter, ServingResponses
from trioserve.api.responses.request import parse_responses_body
from trioserve.core.events import (
    Finished,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallDone,
    ToolCallStarted,
    Usage,
)
from trioserve.core.request import Message

from tests.fakes.core import scripted_core


def parse(**body):
    return parse_responses_body({"model": "fake", **body}, served_model="fake")



def _writer(**body) -> ResponseWriter:
    return ResponseWriter("resp_1", "fake", parse(input="x", **body))


def _decode(raw: bytes) -> list[dict]:
    return [json.loads(b.split("\ndata: ", 1)[1]) for b in raw.decode().split("\n\n") if b.strip()]


def test_writer_sequence_text_reasoning_call_and_completion():
    writer = _writer(tools=[{"type": "function", "name": "f"}])
    raw = writer.start()
    raw += writer.encode([ReasoningDelta("hm"), TextDelta("Hi")])
    raw += writer.encode([ToolCallStarted(0, "call_1", "f"), ToolCallArgumentsDelta(0, '{"a":1}'),
                        ToolCallDone(0, "call_1", "f", '{"a":1}'),
                        Finished("tool_calls", Usage(10, 5, 4))])
    events = _decode(raw)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 4}
    assert final["output"][2]["call_id"] == "call_1" and final["status"] == "completed"
    turn = writer.assistant_message()
    assert (turn.text, turn.reasoning, turn.tool_calls[0].arguments) == ("Hi", "hm", {"a": 1})


def test_writer_length_is_incomplete_and_a_failure_is_failed():
    writer = _writer()
    events = _decode(writer.start() + writer.encode([TextDelta("cut"), Finished("length", Usage(1, 3, 0))]))
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["status"] == "incomplete"
    failing = _writer()
    events = _decode(failing.start() + failing.encode([TextDelta("so")])
                     + failing.fail(errors.internal_error("boom")))
    assert events[-1]["type"] == "response.failed"
    assert events[-1]["response"]["error"]["code"] == "internal_error"
    assert events[-2]["type"] == "response.output_item.done"


def test_store_is_bounded_by_count_and_size():
    # Every string counts: the id, each message's role and text (and ids, names, arguments).
    store = ResponseStore(max_responses=2, max_chars=20)
    store.put("a", (Message("user", "12345"),))  # 1 + 4 + 5 = 10
    store.put("b", (Message("user", "123"),))  # 8
    store.put("c", (Message("user", "1234"),))  # 9: 27 chars > 20, "a" goes
    assert store.get("a") is None and store.get("b") and store.get("c") and len(store) == 2
    assert store.chars == 17
    store.put("huge", (Message("user", "x" * 13),))  # 21 > 20 on its own: not kept
    assert store.get("huge") is None and store.chars == 17


async def test_whole_request_over_the_scripted_core_with_a_custom_tool_call():
    call = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch"}}\n</tool_call>'
    core, runtime = scripted_core([call])
    serving = ServingResponses(core)
    body = {"model": "fake", "input": "patch it", "tools": [{"type": "custom", "name": "apply_patch"},
                                                            {"type": "web_search"}]}
    result = await serving.create(json.dumps(body).encode())
    [item] = result.body["output"]
    assert (item["type"], item["input"]) == ("custom_tool_call", "*** Begin Patch")
    assert result.headers == {"x-trioserve-ignored-tools": "web_search"}
    assert "web_search" not in runtime.generations[0].params.prompt
    assert len(serving.store) == 1  # store defaults to true



async def test_reasoning_effort_on_a_template_without_a_switch_names_reasoning_effort():
    core, runtime = scripted_core(["x"])
    body = {"model": "fake", "input": "x", "reasoning": {"effort": "high"}}
    with pytest.raises(errors.APIError) as info:
        await ServingResponses(core).create(json.dumps(body).encode())
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "reasoning.effort")
    assert runtime.generations == []
