"""tool_formats.hermes: <tool_call>{json}</tool_call>."""

from __future__ import annotations

import random

import pytest

from trioserve.model.tool_formats import HermesParser

from .checks import TOOLS, assert_stream_matches_parse, parse, stream, streamed

P = HermesParser
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
ZURICH = [("get_weather", {"city": "Zürich"})]


def test_text_without_a_call_is_unchanged():
    for text in ["", "Hello", "  spaced  \n", "a < b and <tool> or <tool_call", "x <tool_"]:
        assert parse(P, text) == (text, [])


def test_one_call_after_text():
    assert parse(P, "Let me check.\n" + CALL) == ("Let me check.", ZURICH)


def test_a_call_alone_leaves_empty_content_and_text_after_a_call_is_kept():
    assert parse(P, "\n" + CALL + "\n") == ("", ZURICH)
    assert parse(P, "A\n" + CALL + "\nDone.") == ("A\nDone.", ZURICH)


def test_non_ascii_arguments_are_passed_on_as_written():
    _, calls = P(TOOLS).parse(CALL)
    assert calls[0]["function"]["arguments"] == '{"city": "Zürich"}'


def test_no_declared_tools_means_no_calls():
    assert parse(P, CALL, tools={}) == (CALL, [])


def test_several_calls_and_array_blocks_keep_order():
    text = (CALL + '\n<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>'
            '<tool_call>[{"name": "search", "parameters": {"q": "b"}}, {"name": "get_weather"}]</tool_call>')
    assert parse(P, text) == ("", ZURICH + [("search", {"q": "a"}), ("search", {"q": "b"}), ("get_weather", {})])


def test_nested_arguments_and_unicode():
    args = '{"filter": {"tags": ["ä", "🎉"], "range": [1, 2.5, null, true]}, "q": "line1\\nline2"}'
    text = '<tool_call>{"name": "search", "arguments": ' + args + "}</tool_call>"
    assert parse(P, text) == ("", [("search", {"filter": {"tags": ["ä", "🎉"], "range": [1, 2.5, None, True]},
                                              "q": "line1\nline2"})])


def test_arguments_given_as_a_json_string_are_decoded():
    text = '<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>'
    assert parse(P, text) == ("", [("search", {"q": 1})])


def test_closing_tag_inside_a_string_does_not_end_the_block():
    text = '<tool_call>{"name": "search", "arguments": {"q": "</tool_call> and </tool_call>"}}</tool_call> after'
    assert parse(P, text) == (" after", [("search", {"q": "</tool_call> and </tool_call>"})])


def test_unclosed_but_complete_block_at_the_end_counts():
    assert parse(P, 'Sure. <tool_call>{"name": "search", "arguments": {}}\n') == ("Sure.", [("search", {})])


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',          # undeclared tool
    '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',        # arguments not an object
    '<tool_call>{"name": "search", "arguments": "nope"}</tool_call>',     # string that is not JSON
    '<tool_call>{"name": "search", "arguments": {"x": NaN}}</tool_call>',  # not strict JSON
    '<tool_call>{"name": "search", "arguments": {"x": 1e999}}</tool_call>',  # not finite
    '<tool_call>{"arguments": {}}</tool_call>',                            # no name
    "<tool_call>[]</tool_call>",
    '<tool_call>[{"name": "search"}, {"name": "nope"}]</tool_call>',      # one bad call spoils the block
    '<tool_call>{"name": "search"} trailing</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q": "unterminated</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q"',                     # truncated at the end
    '<tool_call>{"name": "search", "arguments": {}}</tool_c',              # closing tag cut short
    "<tool_call>I will call a tool now.",                                  # mention, not a call
])
def test_invalid_blocks_stay_content_verbatim(block):
    text = "Before. " + block + " After."
    assert parse(P, text) == (text, [])
    assert_stream_matches_parse(P, text)


def test_a_bad_block_does_not_hide_a_good_one():
    bad = '<tool_call>{"name": "nope"}</tool_call>'
    assert parse(P, "A " + bad + "\n" + CALL) == ("A " + bad, ZURICH)


def test_plain_text_streams_at_once():
    sent, calls, rest, more = stream(P, ["Hel", "lo, ", "world"])
    assert sent == ["Hel", "lo,", " world"] and rest == "" and more == []


def test_only_a_possible_tag_start_is_held_back():
    sent, calls, rest, more = stream(P, ["a <", "b", " <tool", "_x>"])
    assert sent == ["a", " <b", "", " <tool_x>"] and rest == "" and more == []


def test_an_open_block_is_held_until_it_resolves():
    sent, calls, rest, more = stream(P, ["Checking.\n<tool", '_call>\n{"name": "get_w', 'eather", "arguments": {}}',
                                         "\n</tool_call>", "\n"])
    assert sent == ["Checking.", "", "", "", ""] and rest == ""
    assert [c for fed in calls for c in fed] + more == [("get_weather", {})]


def test_whitespace_is_sent_when_text_follows():
    sent, _, rest, _ = stream(P, ["a ", " ", "b\n"])
    assert "".join(sent) + rest == "a  b\n" and rest == "\n"


def test_a_mention_is_released_at_once_and_a_later_block_still_counts():
    sent, calls, rest, more = stream(P, ["Use <tool_call> tags", " like this: ", CALL])
    assert sent == ["Use <tool_call> tags", " like this:", ""] and calls == [[], [], ZURICH]
    assert rest == "" and more == []


def test_an_invalid_block_is_released_when_its_closing_tag_arrives():
    sent, calls, rest, _ = stream(P, ['<tool_call>{"name": "nope"}', "</tool_call>", " next"])
    assert sent == ["", '<tool_call>{"name": "nope"}</tool_call>', " next"]


CORPUS = [
    "Plain answer with no tools at all.\n",
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL + " tail",
    "x <tool_call>{bad}</tool_call> y " + CALL,
    'pre <tool_call>{"name": "search", "arguments": {"q": "</tool_call>"}}</tool_call> post',
    '<tool_call>[{"name": "search", "arguments": {"q": "é\\"}"}}, {"name": "get_weather"}]</tool_call>',
    "<tool_call>mention only",
    'end <tool_call>{"name": "search", "arguments": {}}',
    "<<tool_call<tool_call>" + CALL[len("<tool_call>"):],
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_every_split(text):
    assert_stream_matches_parse(P, text)


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_random_splits_into_many_pieces(text):
    whole = parse(P, text)
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert streamed(P, pieces) == whole, pieces
