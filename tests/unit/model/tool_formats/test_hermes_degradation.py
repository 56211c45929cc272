"""tool_calls: Hermes-style parsing, whole and streamed, with graceful degradation."""

from __future__ import annotations

import json
import random

import pytest

from trioserve.model.tool_formats import HermesParser
from trioserve.model.tool_formats.base import make_tool_call


def parse_tool_calls(text, tool_names):
    """Whole-output parse with the Hermes parser, by tool names only."""
    return HermesParser(dict.fromkeys(tool_names)).parse(text)


class ToolCallStreamParser:
    """The Hermes stream parser, with every call collected until ``finish``."""

    def __init__(self, tool_names):
        self._parser = HermesParser(dict.fromkeys(tool_names))
        self._calls = []

    def feed(self, text):
        content, calls = self._parser.feed(text)
        self._calls.extend(calls)
        return content

    def finish(self):
        content, calls = self._parser.finish()
        self._calls.extend(calls)
        return content, self._calls

NAMES = {"get_weather", "search"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def summary(calls):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_plain_text_is_unchanged():
    for text in ["", "Hello", "  spaced  \n", "a < b and <tool> or <tool_call", "x <tool_"]:
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_single_call_with_leading_text():
    content, calls = parse_tool_calls("Let me check.\n" + CALL, NAMES)
    assert content == "Let me check."
    assert summary(calls) == [("get_weather", {"city": "Zürich"})]
    call = calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_") and len(call["id"]) == 29
    assert call["function"]["arguments"] == '{"city": "Zürich"}'  # non-ASCII kept


def test_call_only_output_has_empty_content():
    assert parse_tool_calls("\n" + CALL + "\n", NAMES)[0] == ""


def test_several_calls_and_array_blocks_keep_order_and_unique_ids():
    text = (CALL + '\n<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>'
            '<tool_call>[{"name": "search", "parameters": {"q": "b"}}, {"name": "get_weather"}]</tool_call>')
    content, calls = parse_tool_calls(text, NAMES)
    assert content == ""
    assert summary(calls) == [("get_weather", {"city": "Zürich"}), ("search", {"q": "a"}),
                              ("search", {"q": "b"}), ("get_weather", {})]
    assert len({c["id"] for c in calls}) == 4


def test_arguments_given_as_a_json_string_are_decoded():
    _, calls = parse_tool_calls('<tool_call>{"name": "search", "arguments": "{\\"q\\": 1}"}</tool_call>', NAMES)
    assert summary(calls) == [("search", {"q": 1})]


def test_closing_tag_inside_a_string_does_not_cut_the_block():
    text = '<tool_call>{"name": "search", "arguments": {"q": "</tool_call> is a tag"}}</tool_call>'
    assert summary(parse_tool_calls(text, NAMES)[1]) == [("search", {"q": "</tool_call> is a tag"})]


def test_unclosed_but_complete_block_at_the_end_counts():
    content, calls = parse_tool_calls('Sure. <tool_call>{"name": "search", "arguments": {}}', NAMES)
    assert content == "Sure." and summary(calls) == [("search", {})]


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',          # undeclared tool
    '<tool_call>{"name": "search", "arguments": [1]}</tool_call>',        # arguments not an object
    '<tool_call>{"name": "search", "arguments": "nope"}</tool_call>',     # string that is not JSON
    '<tool_call>{"arguments": {}}</tool_call>',                            # no name
    "<tool_call>[]</tool_call>",
    '<tool_call>{"name": "search"} trailing</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q": "unterminated</tool_call>',
    '<tool_call>{"name": "search", "arguments": {"q"',                     # truncated at the end
    "<tool_call>I will call a tool now.",                                  # mention, not a call
])
def test_invalid_blocks_stay_as_content_verbatim(block):
    text = "Before. " + block + " After."
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_a_bad_block_does_not_hide_a_good_one():
    bad = '<tool_call>{"name": "nope"}</tool_call>'
    content, calls = parse_tool_calls("A " + bad + "\n" + CALL, NAMES)
    assert content == "A " + bad
    assert summary(calls) == [("get_weather", {"city": "Zürich"})]


def test_text_after_a_call_is_kept():
    content, calls = parse_tool_calls("A\n" + CALL + "\nDone.", NAMES)
    assert content == "A\nDone." and len(calls) == 1


def test_no_declared_tools_means_no_calls():
    assert parse_tool_calls(CALL, set()) == (CALL, [])


def test_make_tool_call_shape():
    call = make_tool_call("f", {"x": "é"})
    assert call == {"id": call["id"], "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}}


# --- streaming ----------------------------------------------------------------------------


def stream(pieces, names=NAMES):
    parser = ToolCallStreamParser(names)
    sent = [parser.feed(p) for p in pieces]
    rest, calls = parser.finish()
    return sent, rest, calls


def test_stream_sends_plain_text_immediately():
    sent, rest, calls = stream(["Hel", "lo, ", "world"])
    assert sent == ["Hel", "lo,", " world"] and rest == "" and calls == []


def test_stream_holds_back_only_a_possible_tag_start():
    sent, rest, calls = stream(["a <", "b", " <tool", "_x>"])
    assert sent == ["a", " <b", "", " <tool_x>"]
    assert rest == "" and calls == []


def test_stream_holds_an_open_block_until_it_resolves():
    sent, rest, calls = stream(["Checking.\n<tool", '_call>\n{"name": "get_w', 'eather", "arguments": {}}',
                                "\n</tool_call>", "\n"])
    assert sent == ["Checking.", "", "", "", ""]
    assert rest == "" and summary(calls) == [("get_weather", {})]


def test_stream_releases_a_tag_mention_at_once():
    sent, _, _ = stream(["Use <tool_call> tags", " like this"])
    assert sent == ["Use <tool_call> tags", " like this"]


def test_stream_releases_an_invalid_block_when_its_closing_tag_arrives():
    sent, rest, calls = stream(['<tool_call>{"name": "nope"}', "</tool_call>", " next"])
    assert sent == ["", '<tool_call>{"name": "nope"}</tool_call>', " next"]
    assert calls == []


def test_stream_whitespace_is_sent_when_text_follows():
    sent, rest, _ = stream(["a ", " ", "b\n"])
    assert "".join(sent) + rest == "a  b\n" and rest == "\n"


def test_feed_after_finish_is_an_error():
    parser = ToolCallStreamParser(NAMES)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


CORPUS = [
    "Plain answer with no tools at all.\n",
    "Let me check.\n" + CALL,
    CALL + "\n" + CALL,
    "x <tool_call>{bad}</tool_call> y " + CALL + " tail",
    'pre <tool_call>{"name": "search", "arguments": {"q": "</tool_call>"}}</tool_call> post',
    "<tool_call>mention only",
    'end <tool_call>{"name": "search", "arguments": {}}',
    "<<tool_call<tool_call>" + CALL[len("<tool_call>"):],
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_whole_text_parsing_for_any_split(text):
    whole_content, whole_calls = parse_tool_calls(text, NAMES)
    rng = random.Random(text)
    for _ in range(30):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text), rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        sent, rest, calls = stream(pieces)
        assert "".join(sent) + rest == whole_content
        assert summary(calls) == summary(whole_calls)
    # and one character at a time
    sent, rest, calls = stream(list(text))
    assert "".join(sent) + rest == whole_content and summary(calls) == summary(whole_calls)
