"""tool_formats.llama3_json: {"name": …, "parameters": …}, optionally after <|python_tag|>."""

from __future__ import annotations

import pytest

from trioserve.model.tool_formats import Llama3JsonParser

from .checks import assert_stream_matches_parse, parse, stream

P = Llama3JsonParser
CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
PARIS = [("get_weather", {"city": "Paris"})]
SEARCH = '{"name": "search", "arguments": {"q": "x"}}'
X = [("search", {"q": "x"})]


def test_a_bare_call_is_the_whole_reply():
    assert parse(P, CALL) == ("", PARIS)


def test_python_tag_is_dropped_with_its_call():
    assert parse(P, "<|python_tag|>" + CALL) == ("", PARIS)
    assert parse(P, "<|python_tag|>\n " + CALL + "\n") == ("", PARIS)


def test_arguments_key_type_function_and_string_arguments():
    assert parse(P, SEARCH) == ("", X)
    assert parse(P, '{"type": "function", "name": "search", "parameters": {"q": "x"}}') == ("", X)
    assert parse(P, '{ "type" : "function" , "name": "search", "arguments": "{\\"q\\": \\"x\\"}"}') == ("", X)
    assert parse(P, '{"name": "search"}') == ("", [("search", {})])


def test_several_calls_separated_by_semicolons_or_newlines():
    text = "<|python_tag|>" + CALL + "; " + SEARCH + ";\n" + CALL + "\n" + SEARCH + ";"
    assert parse(P, text) == ("", PARIS + X + PARIS + X)


def test_text_around_calls_is_content():
    assert parse(P, "Sure.\n" + CALL + "\nDone.") == ("Sure.\nDone.", PARIS)
    assert parse(P, CALL + "; then ; text") == (" then ; text", PARIS)


def test_nested_parameters_and_strings_with_braces_and_markers():
    text = ('{"name": "search", "parameters": {"q": "} ; {\\"name\\": \\"search\\"} <|python_tag|>", '
            '"opts": {"a": [1, {"b": null}], "é": "🎉"}}}')
    assert parse(P, text) == ("", [("search", {"q": '} ; {"name": "search"} <|python_tag|>',
                                               "opts": {"a": [1, {"b": None}], "é": "🎉"}})])


def test_json_that_is_not_a_call_streams_as_content():
    sent, calls, rest, _ = stream(P, ['Data: {"a": 1}', ' and {"name": "Alice", ', '"age": 3}', " end"])
    assert sent == ['Data: {"a": 1}', " and", ' {"name": "Alice", "age": 3}', " end"]
    assert calls == [[], [], [], []] and rest == ""


def test_only_a_possible_call_start_is_held_back():
    parser = P({"search": None})
    assert parser.feed('x {"na') == ("x", [])
    assert parser.feed('t": 1}') == (' {"nat": 1}', [])
    assert parser.feed(" { ") == ("", [])
    assert parser.feed("'") == (" { '", [])


@pytest.mark.parametrize("text", [
    '{"name": "rm_rf", "parameters": {}}',                                  # undeclared tool
    '{"name": "search", "parameters": [1]}',
    '{"name": "search", "parameters": {}, "extra": 1}',                     # unknown key: data
    '{"type": "object", "name": "search", "parameters": {}}',
    '{"name": "search", "parameters": {"q": NaN}}',
    '{"name": "search", "parameters": {"q": 1',                             # truncated
    '{"name": "search", "parameters": {"q": 1]}',                           # malformed
    '<|python_tag|>brave_search.call(query="x")',                           # built-in tool syntax
    '<|python_tag|>{"name": "rm_rf"}',
    "<|python_tag|>",
])
def test_invalid_calls_stay_content_verbatim(text):
    text = "Before. " + text + " After."
    assert parse(P, text) == (text, [])
    assert_stream_matches_parse(P, text)


def test_a_semicolon_is_dropped_only_right_after_a_call():
    assert parse(P, "a; b") == ("a; b", [])
    assert parse(P, CALL + ";;") == (";", PARIS)


CORPUS = [
    "Let me check.\n" + CALL + "\nDone.",
    "<|python_tag|>" + CALL + ";" + SEARCH,
    '{"x": {"name": "y"}} ' + CALL,
    '<|python_tag|>{"name": "rm_rf"} {"name": "search", "parameters": {"q": "}{"}}',
    '{"type": "function", "name": "search", "parameters": {"q": "\\"\\\\"}};\n',
    "<|python_|>{ }" + CALL,
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_every_split(text):
    assert_stream_matches_parse(P, text)
