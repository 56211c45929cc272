"""structured: response_format json_object / json_schema and forced tool_choice (§5.6).

A server either enforces the constraint — 200, and the output parses and matches — or refuses it
with 400 unsupported_parameter (a model worker that cannot constrain decoding). It never answers
200 with output that does not match. Schema features outside §5.6 are 400 invalid_value naming
the keyword, whether or not the worker could constrain decoding.

The checks are written out by hand (no JSON Schema library) for one small bounded schema.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from conformance._support import (
    check_completion,
    check_error,
    check_stream,
    chat_body,
    json_of,
    post_chat,
    stream_chat,
)

pytestmark = pytest.mark.structured

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "status", "schema": SCHEMA, "strict": True}}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PROMPT = "Reply in JSON: your name and whether you are ok."


def _body(cfg, **kw: Any) -> dict[str, Any]:
    return chat_body(cfg, PROMPT, temperature=0, max_tokens=200, **kw)


def _enforced(r, cfg, param: str) -> dict[str, Any] | None:
    """The completion when the server enforced the constraint; None when it refused it with
    400 unsupported_parameter (any other answer fails)."""
    if r.status_code == 400:
        check_error(r, 400, "unsupported_parameter", param)
        return None
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)  # the §6 shape; returns choices[0], the callers want the body
    return data


def _check_status(text: str) -> None:
    value = json.loads(text)
    assert isinstance(value, dict) and set(value) == {"name", "ok"}, f"keys of {value!r}"
    assert isinstance(value["name"], str) and len(value["name"]) <= 20, f"name in {value!r}"
    assert isinstance(value["ok"], bool), f"ok in {value!r}"


@pytest.mark.spec("§5.6")
def test_json_schema_output_matches(client, cfg):
    """json_schema: the content parses and matches the schema (or the constraint is refused)."""
    data = _enforced(post_chat(client, _body(cfg, response_format=JSON_SCHEMA)), cfg, "response_format")
    if data is None:
        pytest.skip("the server's model worker cannot enforce structured outputs (400 unsupported_parameter)")
    choice = data["choices"][0]
    assert choice["finish_reason"] == "stop", f"finish_reason {choice['finish_reason']!r}"
    _check_status(choice["message"]["content"])


@pytest.mark.spec("§5.6")
def test_json_schema_stream_matches(client, cfg):
    """json_schema streamed: the concatenated content matches; refusals are plain JSON 400s."""
    st = stream_chat(client, _body(cfg, response_format=JSON_SCHEMA, stream=True))
    if st.status == 400:
        check_error(st, 400, "unsupported_parameter", "response_format")
        pytest.skip("the server's model worker cannot enforce structured outputs")
    check_stream(st, cfg, identity=False, usage_nulls=False)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in st.chunks if c.get("choices"))
    _check_status(text)


@pytest.mark.spec("§5.6")
def test_json_object_output_is_an_object(client, cfg):
    """json_object: the content is one JSON object."""
    prompt = "Give the capital of France as a JSON object."
    r = post_chat(client, chat_body(cfg, prompt, temperature=0, max_tokens=200,
                                    response_format={"type": "json_object"}))
    data = _enforced(r, cfg, "response_format")
    if data is None:
        pytest.skip("the server's model worker cannot enforce structured outputs")
    content = data["choices"][0]["message"]["content"]
    assert isinstance(json.loads(content), dict), f"not a JSON object: {content!r}"


@pytest.mark.spec("§5.6")
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_forced_tool_choice_calls_the_tool(client, cfg, choice):
    """tool_choice required / named: exactly one valid call with parallel_tool_calls false."""
    body = chat_body(cfg, "What is the weather in Paris?", temperature=0, max_tokens=200,
                     tools=[TOOL], tool_choice=choice, parallel_tool_calls=False)
    data = _enforced(post_chat(client, body), cfg, "tool_choice")
    if data is None:
        pytest.skip("the server's model worker cannot enforce structured outputs")
    result = data["choices"][0]
    calls = result["message"].get("tool_calls")
    assert result["finish_reason"] == "tool_calls" and isinstance(calls, list) and len(calls) == 1, result
    fn = calls[0]["function"]
    assert fn["name"] == "get_weather", fn
    args = json.loads(fn["arguments"])
    assert isinstance(args, dict) and set(args) == {"city"} and isinstance(args["city"], str), args


UNENFORCEABLE = [
    ({"not": {"type": "string"}}, "response_format.json_schema.schema.not"),
    ({"type": "object", "properties": {"p": {"type": "number", "minimum": 0}}},
     "response_format.json_schema.schema.properties.p.minimum"),
    ({"type": "string", "format": "email"}, "response_format.json_schema.schema.format"),
]


@pytest.mark.spec("§5.6")
@pytest.mark.parametrize("schema, param", UNENFORCEABLE, ids=[p.rsplit(".", 1)[-1] for _, p in UNENFORCEABLE])
def test_unenforceable_schema_feature_is_invalid_value(client, cfg, schema, param):
    """A schema feature the server cannot enforce is 400 invalid_value naming it, never ignored."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    check_error(post_chat(client, _body(cfg, response_format=fmt)), 400, "invalid_value", param)


@pytest.mark.spec("§5.6")
def test_malformed_structured_parameters(client, cfg):
    """json_schema without a name, and a named tool_choice for an undeclared tool."""
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    check_error(post_chat(client, _body(cfg, response_format=fmt)), 400,
                "missing_required_parameter", "response_format.json_schema.name")
    choice = {"type": "function", "function": {"name": "nope"}}
    check_error(post_chat(client, _body(cfg, tools=[TOOL], tool_choice=choice)), 400,
                "invalid_value", "tool_choice.function.name")
