"""tool_formats.gemma4: <|tool_call>call:NAME{key:value,…}<tool_call|>."""

from __future__ import annotations

import json

import pytest

from trioserve.model.tool_formats import Gemma4Parser
from trioserve.model.tool_formats.gemma4 import gemma_to_json

from .checks import assert_stream_matches_parse, parse, stream

P = Gemma4Parser
Q = '<|"|>'
CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q}}}<tool_call|>"
PARIS = [("get_weather", {"city": "Paris"})]


def s(text):
    return Q + text + Q


def test_one_call_after_text():
    assert parse(P, "Let me check.\n" + CALL) == ("Let me check.", PARIS)


def test_values_of_every_kind_and_nesting():
    body = (f"{{city:{s('Zürich 🎉')},days:3,ratio:-2.5e-1,metric:true,alt:false,none:null,"
            f"opts:{{units:[{s('c')},{s('f')}],nested:{{deep:[[1],[{{x:{s('y')}}}]]}}}},empty:{{}},list:[]}}")
    text = "<|tool_call>call:get_weather" + body + "<tool_call|>"
    assert parse(P, text) == ("", [("get_weather", {
        "city": "Zürich 🎉", "days": 3, "ratio": -0.25, "metric": True, "alt": False, "none": None,
        "opts": {"units": ["c", "f"], "nested": {"deep": [[1], [{"x": "y"}]]}}, "empty": {}, "list": []})])


def test_strings_may_hold_the_closing_tag_brackets_and_newlines():
    value = "a <tool_call|> b } ] , : { [ \n c \" \\ <|tool_call>"
    text = f"<|tool_call>call:search{{q:{s(value)}}}<tool_call|> after"
    assert parse(P, text) == (" after", [("search", {"q": value})])


def test_whitespace_and_delimited_keys():
    text = f"<|tool_call>call:search{{ q : {s('x')} ,\n {s('odd key')}: [ 1 , 2 ] }}<tool_call|>"
    assert parse(P, text) == ("", [("search", {"q": "x", "odd key": [1, 2]})])


def test_no_arguments():
    assert parse(P, "<|tool_call>call:search{}<tool_call|>") == ("", [("search", {})])


def test_several_calls():
    text = CALL + f"<|tool_call>call:search{{q:{s('a')}}}<tool_call|>\n" + CALL
    assert parse(P, text) == ("", PARIS + [("search", {"q": "a"})] + PARIS)


def test_missing_closing_tag_is_tolerated():
    assert parse(P, "Ok " + CALL[: -len("<tool_call|>")]) == ("Ok", PARIS)
    assert parse(P, CALL[: -len("<tool_call|>")] + " then text") == (" then text", PARIS)


def test_only_one_closing_tag_is_dropped_after_a_call():
    assert parse(P, CALL + "<tool_call|>") == ("<tool_call|>", PARIS)
    assert parse(P, "<tool_call|> alone") == ("<tool_call|> alone", [])


def test_the_call_is_reported_at_its_closing_brace():
    sent, calls, rest, more = stream(P, ["<|tool_call>call:search{q:", s("x"), "}", "<tool_call|>", " ok"])
    assert calls == [[], [], [("search", {"q": "x"})], [], []] and more == []
    assert "".join(sent) + rest == " ok"


def test_gemma_to_json():
    assert json.loads(gemma_to_json(f"{{a:{s('x')},b:[1,true]}}")) == {"a": "x", "b": [1, True]}
    assert gemma_to_json("{a:1 2}") is not None and json.loads(gemma_to_json("{a:[1]}")) == {"a": [1]}
    assert gemma_to_json("{a:word}") is None
    assert gemma_to_json("{a:" + Q + "open}") is None


@pytest.mark.parametrize("block", [
    "<|tool_call>call:rm_rf{}<tool_call|>",                                # undeclared tool
    "<|tool_call>get_weather{}<tool_call|>",                               # no "call:"
    "<|tool_call>call:get weather{}<tool_call|>",                          # not a name
    "<|tool_call>call:search{q:word}<tool_call|>",                         # bare word value
    "<|tool_call>call:search{q:1 2}<tool_call|>",
    "<|tool_call>call:search{q:NaN}<tool_call|>",
    "<|tool_call>call:search{q:1,}<tool_call|>",                           # trailing comma
    "<|tool_call>call:search{q:[1}]<tool_call|>",                          # mismatched brackets
    "<|tool_call>call:search{:1}<tool_call|>",
    "<|tool_call>call:search[1]<tool_call|>",
    f"<|tool_call>call:search{{q:{Q}open}}<tool_call|>",                  # string never closed
    "<|tool_call>call:search{q:{a:1}",                                     # truncated
    "<|tool_call>call:sea",
    "<|tool_call>I am thinking about tools.",
])
def test_invalid_calls_stay_content_verbatim(block):
    text = "Before. " + block + " After."
    assert parse(P, text) == (text, [])
    assert_stream_matches_parse(P, text)


def test_a_mention_streams_at_once():
    sent, _, _, _ = stream(P, ["Use <|tool_call> for calls", "."])
    assert sent == ["Use <|tool_call> for calls", "."]


CORPUS = [
    "Let me check.\n" + CALL + "\nDone.",
    CALL + CALL + " tail",
    "<|tool_call>call:search{q:" + s("<tool_call|>") + ",n:[1,{k:" + s('<|"|') + "}]}<tool_call|>",
    "x <|tool_call>call:search{q:bad}<tool_call|> y " + CALL,
    "<|tool_call><|tool_call>call:search{}",
    "<|tool_call>call:search{q:" + s("日本語 ") + "}\n<tool_call|>\n",
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_every_split(text):
    assert_stream_matches_parse(P, text)
