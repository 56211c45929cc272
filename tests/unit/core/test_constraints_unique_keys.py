"""Unique JSON keys (spec §5.6): which constraints ask the worker to keep keys
unique, the ``unique_keys`` field for each reasoning state, its wire form, and that the
grammars leave the worker's key stage a way out (a key that would repeat can always be
extended instead of closed, checked with llama.cpp's own grammar engine).

The stage itself is tested in C++ (cpp/tests/test_json_key_guard.cpp, test_worker_loop.cpp),
on the fake worker over HTTP (tests/http/tools/test_unique_keys.py) and on the real model
(tests/http/tools/test_unique_keys_real_model.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from trioserve.core import constraints as structured
from trioserve.core.request import CoreRequest

from trioserve.worker import protocol as worker_protocol
from trioserve.model.tool_formats import parser_class

from testkit.core_requests import constrained_request
from testkit.grammar_check import GrammarChecker
from testkit.json_keys import repeated_key

THINK = ("<think>", "</think>")
OPEN_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def _request(response_format: Any = None, tool_choice: Any = "auto", tools: Any = None) -> CoreRequest:
    return constrained_request(response_format, tools=tools, tool_choice=tool_choice)


@pytest.fixture(scope="module")
def checker():
    c = GrammarChecker()
    yield c
    c.close()


def test_json_answers_and_json_call_formats_ask_for_unique_keys():
    json_object = _request({"type": "json_object"})
    assert structured.constraint_for(json_object).json_keys
    schema = _request({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}})
    assert structured.constraint_for(schema).json_keys
    for fmt in ("hermes", "llama3_json", "mistral"):
        assert parser_class(fmt).constrained_calls_are_json
        assert structured.constraint_for(_request(None, "required", [OPEN_TOOL]), tool_format=fmt).json_keys
        assert structured.constraint_for(_request({"type": "json_object"}, "auto", [OPEN_TOOL]),
                                         tool_format=fmt).json_keys
    # Raw-text call syntaxes: a quote in a value is not JSON, so the stage stays off.
    for fmt in ("qwen_xml", "gemma4"):
        assert not parser_class(fmt).constrained_calls_are_json
        assert not structured.constraint_for(_request(None, "required", [OPEN_TOOL]), tool_format=fmt).json_keys
        assert not structured.constraint_for(_request({"type": "json_object"}, "auto", [OPEN_TOOL]),
                                             tool_format=fmt).json_keys


def test_unique_keys_field_follows_the_reasoning_state():
    assert structured.unique_keys_field(THINK, "none") == {}
    assert structured.unique_keys_field(None, "optional") == {}
    assert structured.unique_keys_field(THINK, "inside") == {"reasoning_end": "</think>"}
    assert structured.unique_keys_field(THINK, "optional") == {"reasoning_start": "<think>",
                                                               "reasoning_end": "</think>"}
    # An end marker with_reasoning cannot stop at admits no block: JSON from the first byte.
    assert structured.unique_keys_field(("<<", "<x<"), "optional") == {}
    assert structured.with_reasoning("root ::= \"a\"\n", ("<<", "<x<"), "optional") == "root ::= \"a\"\n"


def test_unique_keys_on_the_wire():
    gen = worker_protocol.Generate(worker_protocol.GenerateParams(
        prompt="p", grammar="root ::= \"a\"", unique_keys={"reasoning_end": "</think>"}))
    wire = worker_protocol.request_fields(gen)
    assert wire["unique_keys"] == {"reasoning_end": "</think>"}
    assert "unique_keys" not in worker_protocol.request_fields(
        worker_protocol.Generate(worker_protocol.GenerateParams(prompt="p")))


@pytest.mark.parametrize("schema, text", [
    ({"type": "object"}, '{"a": 1, "a_": 2}'),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, '{"a": 1, "a_": 2}'),
    ({"type": "object", "properties": {}, "additionalProperties": True}, '{"a": 1, "a_": 2}'),
    ({"type": "object", "properties": {"o": {"type": "object"}}}, '{"o": {"k": 1, "k_": 2}}'),
    ({"type": "array", "items": {"type": "object"}}, '[{"k": 1, "k_": 2}]'),
])
def test_a_key_that_would_repeat_can_be_extended(checker, schema, text):
    """Where a key that would repeat one of its object may end, the grammar also admits
    another character: the worker's key stage always has a candidate left (it yields to the
    grammar only for a grammar that forces a repeated key, which these never write). Objects
    with declared ``properties`` admit only those keys, each once, in order: no repeat there."""
    req = _request({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    grammar = structured.constraint_for(req).grammar
    assert checker.matches(grammar, text)
    assert checker.matches(grammar, text.replace("_", ""))  # the repeat itself is grammatical


def test_the_repeated_key_scanner():
    """The judge of the real-model test and the bench."""
    assert repeated_key('{"a": 1, "b": {"a": 2}, "a"') == "a"
    assert repeated_key('{"a": "a", "b": ["a", {"a": 1}], "c": "x\\"a') is None
    assert repeated_key('{"\\u0061": 1, "a": 2}') == "a"
    assert repeated_key('<tool_call>\n{"name": "f", "arguments": {"name": 1, "x": 2}}') is None
    assert repeated_key('[{"k": 1}, {"k": 2, "k"') == "k"
