"""tool_formats.mistral: [TOOL_CALLS][{json}, …] and [TOOL_CALLS]NAME[ARGS]{json}."""

from __future__ import annotations

import pytest

from trioserve.model.tool_formats import MistralParser

from .checks import assert_stream_matches_parse, parse, stream

P = MistralParser
LIST = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1B2c3D4e"}]'
NAMED = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
PARIS = [("get_weather", {"city": "Paris"})]


def test_list_form():
    assert parse(P, LIST) == ("", PARIS)
    assert parse(P, "[TOOL_CALLS] \n" + LIST[len("[TOOL_CALLS]"):]) == ("", PARIS)


def test_list_with_several_calls_and_variants():
    text = ('[TOOL_CALLS][{"name": "search", "arguments": "{\\"q\\": 1}"}, {"name": "search", '
            '"parameters": {"q": 2}}, {"name": "search"}]')
    assert parse(P, text) == ("", [("search", {"q": 1}), ("search", {"q": 2}), ("search", {})])
    assert parse(P, '[TOOL_CALLS]{"name": "search", "arguments": {}}') == ("", [("search", {})])


def test_named_form_with_and_without_call_id():
    assert parse(P, NAMED) == ("", PARIS)
    assert parse(P, '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS] {"city": "Paris"}') == ("", PARIS)
    text = NAMED + '[TOOL_CALLS]search[ARGS]{"q": "x"}'
    assert parse(P, text) == ("", PARIS + [("search", {"q": "x"})])


def test_text_before_and_after_is_content():
    assert parse(P, "Let me check.\n" + NAMED + "\nDone.") == ("Let me check.\nDone.", PARIS)


def test_nested_json_and_strings_with_markers_and_brackets():
    args = '{"q": "[TOOL_CALLS]x[ARGS]{]} \\" é 🎉", "f": {"a": [[1], {"b": [null]}]}}'
    expected = [("search", {"q": '[TOOL_CALLS]x[ARGS]{]} " é 🎉', "f": {"a": [[1], {"b": [None]}]}})]
    assert parse(P, "[TOOL_CALLS]search[ARGS]" + args) == ("", expected)
    assert parse(P, '[TOOL_CALLS][{"name": "search", "arguments": ' + args + "}]") == ("", expected)


def test_each_call_is_reported_when_its_json_closes():
    sent, calls, rest, _ = stream(P, ["[TOOL_CALLS]search[AR", 'GS]{"q": ', '"x"}', "[TOOL_CALLS]search[ARGS]{}"])
    assert calls == [[], [], [("search", {"q": "x"})], [("search", {})]] and "".join(sent) + rest == ""


def test_prose_after_the_marker_streams_at_once():
    sent, _, _, _ = stream(P, ["[TOOL_CALLS] is a token", " here"])
    assert sent == ["[TOOL_CALLS] is a token", " here"]


@pytest.mark.parametrize("block", [
    "[TOOL_CALLS][]",
    '[TOOL_CALLS][{"name": "rm_rf", "arguments": {}}]',
    '[TOOL_CALLS][{"name": "search", "arguments": {}}, {"name": "rm_rf"}]',
    '[TOOL_CALLS][{"name": "search", "arguments": [1]}]',
    '[TOOL_CALLS][{"name": "search" "arguments": {}}]',                     # malformed
    '[TOOL_CALLS][{"name": "search", "arguments": {"q": Infinity}}]',
    '[TOOL_CALLS][{"name": "search", "arguments": {"q": 1}',                 # truncated
    '[TOOL_CALLS]rm_rf[ARGS]{"q": 1}',
    "[TOOL_CALLS]search[ARGS][1]",
    '[TOOL_CALLS]search[ARGS]{"q": 1',
    '[TOOL_CALLS]search[ARG]{"q": 1}',
    '[TOOL_CALLS]search[CALL_ID]x y[ARGS]{"q": 1}',
    "[TOOL_CALLS]search",
    "[TOOL_CALLS]",
])
def test_invalid_blocks_stay_content_verbatim(block):
    text = "Before. " + block + " After."
    assert parse(P, text) == (text, [])
    assert_stream_matches_parse(P, text)


CORPUS = [
    "Let me check.\n" + LIST + "\nDone.",
    NAMED + NAMED + " tail",
    '[TOOL_CALLS]get_weather[CALL_ID]abc123XYZ[ARGS]{"city": "[TOOL_CALLS]\\"]"}',
    "x [TOOL_CALLS]nope y " + NAMED,
    "[TOOL_[TOOL_CALLS][TOOL_CALLS]" + LIST[len("[TOOL_CALLS]"):],
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_every_split(text):
    assert_stream_matches_parse(P, text)
