"""tool_formats.qwen_xml: <tool_call><function=NAME><parameter=KEY>value</parameter></function></tool_call>."""

from __future__ import annotations

import pytest

from trioserve.model.tool_formats import QwenXmlParser
from trioserve.model.tool_formats.qwen_xml import coerce_value

from .checks import assert_stream_matches_parse, parse, stream

P = QwenXmlParser
SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "count": {"type": "integer"},
        "ratio": {"type": "number"},
        "flag": {"type": "boolean"},
        "nothing": {"type": "null"},
        "opts": {"type": "object"},
        "items": {"type": "array"},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "unit": {"enum": ["c", "f"]},
        "level": {"enum": [1, 2, 3]},
        "free": {},
    },
}
TOOLS = {"write": SCHEMA, "get_weather": {"type": "object", "properties": {"city": {"type": "string"}}},
         "ping": None}


def call(name, *params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def args_of(text):
    content, calls = parse(P, text, TOOLS)
    assert len(calls) == 1, (content, calls)
    return calls[0][1]


def test_one_call_after_text():
    text = "Checking.\n" + call("get_weather", ("city", "Paris"))
    assert parse(P, text, TOOLS) == ("Checking.", [("get_weather", {"city": "Paris"})])


def test_strings_are_verbatim_but_for_one_framing_newline_each_side():
    value = "\n  line one\n\n  line two  \n"
    assert args_of(call("write", ("text", value))) == {"text": value}
    tight = "<tool_call><function=write><parameter=text>x</parameter></function></tool_call>"
    assert args_of(tight) == {"text": "x"}


@pytest.mark.parametrize(("key", "raw", "expected"), [
    ("count", "42", 42),
    ("count", " 7 ", 7),
    ("count", "4.5", "4.5"),          # not an integer: kept as text
    ("count", "many", "many"),
    ("ratio", "2.5e-1", 0.25),
    ("ratio", "3", 3),                 # an integer is a number
    ("ratio", "NaN", "NaN"),           # not strict JSON
    ("ratio", "1e999", "1e999"),       # not finite
    ("flag", "true", True),
    ("flag", "False", False),          # Python spelling accepted
    ("flag", "yes", "yes"),
    ("nothing", "null", None),
    ("opts", '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ("opts", "{broken", "{broken"),
    ("items", '["x", 2]', ["x", 2]),
    ("items", '{"a": 1}', '{"a": 1}'),  # an object where an array is declared
    ("maybe", "null", None),
    ("maybe", "5", 5),
    ("either", "5", 5),
    ("either", "five", "five"),
    ("unit", "c", "c"),
    ("level", "2", 2),
    ("free", "42", "42"),              # no type given: text
    ("undeclared", "42", "42"),        # not in the schema: text
    ("text", "42", "42"),
    ("text", '{"a": 1}', '{"a": 1}'),
])
def test_values_are_typed_by_the_schema(key, raw, expected):
    assert args_of(call("write", (key, raw))) == {key: expected}


def test_a_tool_without_schema_gets_text_values():
    assert args_of(call("ping", ("n", "1"), ("host", "a.b"))) == {"n": "1", "host": "a.b"}


def test_coerce_value_directly():
    assert coerce_value("\n5\n", {"type": "integer"}) == 5
    assert coerce_value("\n\n5\n\n", {"type": "string"}) == "\n5\n"
    assert coerce_value("x", None) == "x"
    assert coerce_value("true", {"type": "boolean", "anyOf": "junk"}) is True


def test_several_parameters_several_functions_several_blocks():
    block = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n"
             "<function=ping>\n</function>\n</tool_call>")
    text = block + "\n" + call("write", ("count", "1"), ("text", "hi"))
    assert parse(P, text, TOOLS) == ("", [("get_weather", {"city": "A"}), ("ping", {}),
                                          ("write", {"count": 1, "text": "hi"})])


def test_values_may_contain_the_other_tags():
    value = "a </tool_call> b </function> c </parameter> d <function=x>"
    assert args_of(call("write", ("text", value))) == {"text": value}


def test_a_value_ends_at_the_end_tag_followed_by_the_next_tag():
    text = ("<tool_call><function=write><parameter=text>x</parameter> y</parameter>"
            "<parameter=count>2</parameter></function></tool_call>")
    assert args_of(text) == {"text": "x</parameter> y", "count": 2}


def test_unicode_names_and_values():
    assert args_of(call("write", ("text", "Zürich 🎉 日本"))) == {"text": "Zürich 🎉 日本"}


def test_unclosed_block_with_complete_functions_counts_at_the_end():
    text = "Ok.\n<tool_call>\n<function=ping>\n</function>\n"
    assert parse(P, text, TOOLS) == ("Ok.", [("ping", {})])


def test_deeply_nested_value_is_kept_as_text():
    deep = "[" * 100_000 + "]" * 100_000
    assert args_of(call("write", ("items", deep))) == {"items": deep}


@pytest.mark.parametrize("block", [
    "<tool_call>I will use a tool.</tool_call>",                            # no function
    "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",             # undeclared tool
    "<tool_call>\n<function=get weather>\n</function>\n</tool_call>",       # not a name
    "<tool_call><function=ping><parameter=a>1</parameter><parameter=a>2</parameter></function></tool_call>",
    "<tool_call><function=ping><parameter=>1</parameter></function></tool_call>",  # empty key
    "<tool_call><function=ping>junk</function></tool_call>",
    "<tool_call><function=ping></function> junk </tool_call>",
    "<tool_call><function=ping><parameter=a>1</function></tool_call>",       # value never ends
    "<tool_call><function=ping><parameter=a>1</parameter>",                  # truncated
    "<tool_call><function=ping>",
    "<tool_call><function=pi",
    "<tool_call><function=ping></function></tool_c",                        # closing tag cut short
])
def test_invalid_blocks_stay_content_verbatim(block):
    text = "Before. " + block + " After."
    assert parse(P, text, TOOLS) == (text, [])
    assert_stream_matches_parse(P, text, TOOLS)


def test_a_mention_streams_at_once():
    sent, calls, _, _ = stream(P, ["Use <tool_call> tags", " for calls."], TOOLS)
    assert sent == ["Use <tool_call> tags", " for calls."]


def test_the_call_is_reported_when_its_block_closes():
    pieces = ["<tool_call>\n<function=ping>\n", "</function>\n", "</tool_call>", " after"]
    sent, calls, rest, _ = stream(P, pieces, TOOLS)
    assert calls == [[], [], [("ping", {})], []] and "".join(sent) + rest == " after"


CORPUS = [
    "Let me look.\n" + call("get_weather", ("city", "Zürich")) + "\nDone.",
    call("write", ("text", "a\n</parameter>\nb"), ("count", "3"), ("flag", "true")) + call("ping"),
    "x <tool_call>nope</tool_call> y " + call("ping"),
    "<tool_call><tool_call><function=ping></function></tool_call>",
    call("write", ("opts", '{"k": "</tool_call>"}')),
]


@pytest.mark.parametrize("text", CORPUS)
def test_streaming_matches_parse_for_every_split(text):
    assert_stream_matches_parse(P, text, TOOLS)
