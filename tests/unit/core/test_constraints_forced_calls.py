"""Forced tool calls in every tool-call format: each format's grammar admits exactly
the call syntax its own parser reads back.

Grammars are checked with llama.cpp's own grammar engine (``testkit/grammar_check.py``, the
embedded model's vocabulary): the exact text a model would write under the constraint must be
accepted token by token, and the format's parser must turn it into the expected calls; wrong
tools, missing required arguments, undeclared keys and a second call without
``parallel_tool_calls`` must be refused.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve.core import constraints as structured
from trioserve.core.request import CoreRequest
from trioserve.errors import APIError
from trioserve.model.tool_formats import parser_class, tool_schemas

from testkit.core_requests import constrained_request
from testkit.grammar_check import GrammarChecker

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
                                     "days": {"type": "integer"}},
    "required": ["city"]}}}
NOOP = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, NOOP]


def _request(tool_choice: Any, parallel: bool) -> CoreRequest:
    return constrained_request(tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=parallel)


def _args(arguments: dict[str, Any]) -> str:
    return json.dumps(arguments, ensure_ascii=False)


# What a model writes for each call, per format: exactly the syntax the grammar spells out.
def hermes(name: str, arguments: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {_args(arguments)}}}\n</tool_call>'


def llama3(name: str, arguments: dict[str, Any]) -> str:
    return f'{{"name": "{name}", "parameters": {_args(arguments)}}}'


def mistral_one(name: str, arguments: dict[str, Any]) -> str:
    return f'{{"name": "{name}", "arguments": {_args(arguments)}}}'


def qwen(name: str, arguments: dict[str, Any]) -> str:
    params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                     for k, v in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def gemma(name: str, arguments: dict[str, Any]) -> str:
    members = ",".join(f'{k}:<|"|>{v}<|"|>' if isinstance(v, str) else f"{k}:{json.dumps(v)}"
                       for k, v in arguments.items())
    return f"<|tool_call>call:{name}{{{members}}}<tool_call|>"


def join(fmt: str, calls: list[str]) -> str:
    if fmt == "mistral":
        return "[TOOL_CALLS][" + ", ".join(calls) + "]"
    return {"hermes": "\n", "qwen_xml": "\n", "llama3_json": "; ", "gemma4": ""}[fmt].join(calls)


WRITERS = {"hermes": hermes, "llama3_json": llama3, "mistral": mistral_one, "qwen_xml": qwen,
           "gemma4": gemma}
FORMATS = sorted(WRITERS)

GOOD = [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo", "unit": "c", "days": 3}),
        ("noop", {})]


@pytest.fixture(scope="module")
def checker():
    c = GrammarChecker()
    yield c
    c.close()


def _grammar(fmt: str, tool_choice: Any, parallel: bool) -> str:
    constraint = structured.constraint_for(_request(tool_choice, parallel), tool_format=fmt)
    assert constraint is not None and constraint.param == "tool_choice"
    return constraint.grammar


def _parsed(fmt: str, text: str) -> list[tuple[str, dict[str, Any]]]:
    content, calls = parser_class(fmt)(tool_schemas(TOOLS)).parse(text)
    assert content == "", (fmt, text, content)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_required_admits_each_tool_and_the_parser_reads_it_back(checker, fmt, parallel):
    g = _grammar(fmt, "required", parallel)
    write = WRITERS[fmt]
    for name, arguments in GOOD:
        text = join(fmt, [write(name, arguments)])
        assert checker.matches(g, text), (fmt, text)
        assert _parsed(fmt, text) == [(name, arguments)]
    two = join(fmt, [write(*GOOD[0]), write(*GOOD[2])])
    assert checker.matches(g, two) == parallel, (fmt, two)
    if parallel:
        assert _parsed(fmt, two) == [GOOD[0], GOOD[2]]
    for bad in (join(fmt, [write("get_weather", {})]),                 # required key missing
                join(fmt, [write("get_weather", {"city": "a", "x": "y"})]),  # undeclared key
                join(fmt, [write("noop", {"x": "y"})]),                  # parameterless takes none
                join(fmt, [write("other", {})]),                         # undeclared tool
                "Sure, calling it now."):
        assert not checker.matches(g, bad), (fmt, bad)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [False, True])
def test_named_admits_only_that_tool(checker, fmt, parallel):
    g = _grammar(fmt, {"type": "function", "function": {"name": "noop"}}, parallel)
    write = WRITERS[fmt]
    assert checker.matches(g, join(fmt, [write("noop", {})]))
    assert not checker.matches(g, join(fmt, [write("get_weather", {"city": "Rome"})]))
    assert checker.matches(g, join(fmt, [write("noop", {}), write("noop", {})])) == parallel


def test_a_schema_the_raw_text_formats_cannot_enforce_is_a_400_naming_it():
    pattern = {"type": "function", "function": {"name": "p", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
        "required": ["code"]}}}
    for fmt in ("qwen_xml", "gemma4"):
        req = constrained_request(tools=[pattern], tool_choice="required",
                                  parallel_tool_calls=False)
        with pytest.raises(APIError) as info:
            structured.constraint_for(req, tool_format=fmt)
        assert info.value.param == "tools[0].function.parameters.properties.code"
    # JSON formats enforce it.
    assert structured.constraint_for(req, tool_format="llama3_json") is not None


# --- reasoning before the constrained part (spec §5.6) ---------------------------------------

THINK = ("<think>", "</think>")


def test_reasoning_state_per_prompt():
    assert structured.reasoning_state(None, "x<think>\n", True) == "none"
    assert structured.reasoning_state(THINK, "<|im_start|>assistant\n<think>\n", False) == "inside"
    assert structured.reasoning_state(THINK, "assistant\n<think>\n\n</think>\n\n", True) == "none"
    assert structured.reasoning_state(THINK, "<|im_start|>assistant\n", True) == "optional"
    assert structured.reasoning_state(THINK, "<|im_start|>assistant\n", False) == "none"


def test_grammar_admits_the_reasoning_block_first(checker):
    req = constrained_request({"type": "json_object"})
    g = structured.constraint_for(req).grammar
    optional = structured.with_reasoning(g, THINK, "optional")
    assert checker.matches(optional, '{"a": 1}')
    assert checker.matches(optional, '<think>Plan: answer with an object.</think>\n\n{"a": 1}')
    assert not checker.matches(optional, "<think>never closed")
    assert not checker.matches(optional, 'Sure! {"a": 1}')
    inside = structured.with_reasoning(g, THINK, "inside")
    assert checker.matches(inside, 'Plan.</think>\n{"a": 1}')
    assert not checker.matches(inside, '{"a": 1}')  # the opened block must be closed first
    assert structured.with_reasoning(g, THINK, "none") == g
    # Forced calls get the same prefix.
    calls = structured.constraint_for(_request("required", False), tool_format="hermes").grammar
    assert checker.matches(structured.with_reasoning(calls, THINK, "optional"),
                           "<think>Weather it is.</think>\n" + hermes("get_weather", {"city": "Rome"}))
