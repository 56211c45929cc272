"""The Responses adapter (trioserve/api/responses*.py) without processes: request mapping onto
the core request, the stream writer's event sequence over the core's events, the bounded store,
and whole requests over a scripted runtime (tests/fakes/core.py)."""

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
from trioserve.core.request import ForcedTool, Message

from tests.fakes.core import scripted_core


def parse(**body):
    return parse_responses_body({"model": "fake", **body}, served_model="fake")


def test_items_map_to_messages_with_one_assistant_turn_per_run_of_output_items():
    req = parse(instructions="Be brief.", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me see."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "ok"}]},
    ], tools=[{"type": "function", "name": "f"}])
    core = req.core_request((), None)
    assert [m.role for m in core.messages] == ["system", "user", "assistant", "tool"]
    assert core.messages[0].text == "Be brief.\n\nrules"  # leading system messages joined
    assistant = core.messages[2]
    assert (assistant.text, assistant.reasoning) == ("Let me see.", "think")
    assert [(c.id, c.name) for c in assistant.tool_calls] == [("c1", "f")]
    assert core.messages[3] == Message("tool", "ok", tool_call_id="c1")
    assert core.param("response_format") == "text.format"


def test_namespace_custom_and_hosted_tools():
    req = parse(input="x", tools=[
        {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "text"}},
        {"type": "web_search", "external_web_access": False},
    ], tool_choice={"type": "function", "name": "spawn", "namespace": "agents"})
    assert [t.name for t in req.tools] == ["agents__spawn", "apply_patch"]
    assert req.tool_map["agents__spawn"].namespace == "agents"
    assert req.tool_map["apply_patch"].kind == "custom"
    assert req.tools[1].parameters["required"] == ["input"]
    assert req.ignored_tools == ["web_search"]
    assert req.tool_choice == ForcedTool("agents__spawn")
    # A call sent back under its namespace renders under the flattened name.
    back = parse(input=[{"type": "function_call", "call_id": "c", "name": "spawn", "namespace": "agents",
                         "arguments": "{}"}], tools=[
        {"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]}])
    assert back.messages[0].tool_calls[0].name == "agents__spawn"


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "tools": [{"type": "custom", "name": "apply_patch",
                               "format": {"type": "grammar", "syntax": "lark", "definition": "x"}}]},
     "tools[0].format"),
    ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
    ({"input": "x", "conversation": "c"}, "conversation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "unknown_key": 1}, "unknown_key"),
    ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice.type"),
])
def test_unsupported_is_a_400_naming_the_path(body, param):
    with pytest.raises(errors.APIError) as info:
        parse(**body)
    assert (info.value.status, info.value.code, info.value.param) == (400, "unsupported_parameter", param)


def test_an_invalid_value_names_its_path():
    with pytest.raises(errors.APIError) as info:
        parse(input=[{"role": "tool", "content": "x"}])
    assert (info.value.code, info.value.param) == ("invalid_value", "input[0].role")
    with pytest.raises(errors.APIError) as info:
        parse(input="x", metadata={"k": 1})
    assert info.value.param == "metadata.k"


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
    assert (turn.text, turn.reasoning, turn.tool_calls[0].arguments) == ("Hi", "hm", '{"a":1}')


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


def test_parallel_false_is_honoured_where_a_grammar_holds_the_calls():
    req = parse(input="x", tools=[{"type": "function", "name": "f"}], parallel_tool_calls=False,
                tool_choice="required")
    assert req.core_request((), None).parallel_tool_calls is False


async def test_reasoning_effort_on_a_template_without_a_switch_names_reasoning_effort():
    core, runtime = scripted_core(["x"])
    body = {"model": "fake", "input": "x", "reasoning": {"effort": "high"}}
    with pytest.raises(errors.APIError) as info:
        await ServingResponses(core).create(json.dumps(body).encode())
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "reasoning.effort")
    assert runtime.generations == []


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["type", "role", "content", "text", "name", "call_id", "arguments",
                         "output", "tools", "format", "input", "namespace", "parameters"]),
        inner, max_size=5),
    max_leaves=20)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["input", "tools", "tool_choice", "text", "reasoning",
                                        "include", "metadata", "max_output_tokens", "store",
                                        "instructions", "parallel_tool_calls", "temperature"]),
                       _json, max_size=6))
def test_any_body_is_parsed_or_refused_with_an_api_error(fields):
    try:
        req = parse(**fields)
    except errors.APIError as exc:
        assert exc.status in (400, 404) and exc.code
    else:
        req.core_request((), None).template_messages()
