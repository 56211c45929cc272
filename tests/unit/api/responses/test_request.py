"""A Responses request without processes (api/responses/request.py, tools.py, input.py):
items onto the core request's messages, tools and their name map, refusals that name the
path, the core's errors in this API's names, and any body parsed or refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trioserve import errors
from trioserve.api.responses.request import parse_responses_body
from trioserve.core.constraints import constraint_for
from trioserve.core.request import ForcedTool, Message


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
    assert core.params.output_format == "text.format" and core.params.messages == "input"


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

def test_parallel_false_is_honoured_where_a_grammar_holds_the_calls():
    req = parse(input="x", tools=[{"type": "function", "name": "f"}], parallel_tool_calls=False,
                tool_choice="required")
    assert req.core_request((), None).parallel_tool_calls is False



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


def test_core_errors_name_the_tool_where_the_body_declares_it():
    """A hosted tool before it and a namespace around it: the path of a function's schema is
    its place in the body, not in the core's flattened tool list."""
    bad = {"type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}
    req = parse(input="x", tool_choice="required", tools=[
        {"type": "web_search"},
        {"type": "namespace", "name": "ns", "tools": [
            {"type": "function", "name": "g", "parameters": bad}]}])
    with pytest.raises(errors.APIError) as info:
        constraint_for(req.core_request((), None))
    assert info.value.param == "tools[1].tools[0].parameters.properties.n.maximum"
    req = parse(input="x", tool_choice={"type": "function", "name": "f"}, tools=[
        {"type": "web_search"}, {"type": "function", "name": "f", "parameters": bad}])
    with pytest.raises(errors.APIError) as info:
        constraint_for(req.core_request((), None))
    assert info.value.param == "tools[1].parameters.properties.n.maximum"
