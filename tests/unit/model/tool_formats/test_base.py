"""tool_formats: the shared interface and engine, checked on every format alike."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trioserve.model.tool_formats import (
    PARSERS,
    Gemma4Parser,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    QwenXmlParser,
    ToolCallParser,
    make_tool_call,
    parser_class,
    tool_schemas,
)

from .checks import TOOLS, assert_stream_matches_parse, parse, stream, streamed

# One valid call to get_weather(city="Paris") per format.
SAMPLES: dict[type[ToolCallParser], str] = {
    HermesParser: '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    QwenXmlParser: "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                   "</function>\n</tool_call>",
    Gemma4Parser: '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>',
    Llama3JsonParser: '{"name": "get_weather", "parameters": {"city": "Paris"}}',
    MistralParser: '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
}
PARIS = [("get_weather", {"city": "Paris"})]
ALL = list(SAMPLES)
ids = [cls.format_name for cls in ALL]


def test_registry_names_every_format_once():
    assert set(PARSERS) == {"hermes", "qwen_xml", "gemma4", "llama3_json", "mistral"}
    assert set(PARSERS.values()) == set(ALL)
    for name, cls in PARSERS.items():
        assert parser_class(name) is cls and cls.format_name == name
    with pytest.raises(ValueError, match="known: gemma4, hermes"):
        parser_class("hermes3")


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_marker_constants_are_literal_strings_the_sample_uses(cls):
    sample = SAMPLES[cls]
    assert cls.call_start_markers and all(isinstance(m, str) and m for m in cls.call_start_markers)
    assert any(sample.startswith(m) for m in cls.call_start_markers)
    assert all(isinstance(m, str) and m for m in cls.markers + cls.call_suffixes)


def test_tool_schemas_reads_a_normalized_tools_list():
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "b"}}]
    assert tool_schemas(tools) == {"a": {"type": "object"}, "b": None}
    assert tool_schemas(None) == {}


def test_make_tool_call_shape():
    call = make_tool_call("f", {"x": "é"})
    assert call == {"id": call["id"], "type": "function", "function": {"name": "f", "arguments": '{"x": "é"}'}}


@pytest.mark.parametrize("cls", ALL, ids=ids)
@pytest.mark.parametrize("text", ["", "Hello", "  spaced  \n", "naïve ünïcödé 🎉 text\n\n", "a < b; c { d } [e]"])
def test_plain_text_is_unchanged(cls, text):
    assert parse(cls, text) == (text, [])


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_sample_call_with_leading_and_trailing_text(cls):
    text = "Let me check.\n" + SAMPLES[cls] + "\nDone."
    assert parse(cls, text) == ("Let me check.\nDone.", PARIS)
    assert_stream_matches_parse(cls, text)


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_call_only_output_has_empty_content(cls):
    assert parse(cls, "\n" + SAMPLES[cls] + "\n") == ("", PARIS)


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_two_calls_separated_by_a_newline(cls):
    text = SAMPLES[cls] + "\n" + SAMPLES[cls]
    assert parse(cls, text) == ("", PARIS * 2)
    assert_stream_matches_parse(cls, text)


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_each_call_is_reported_by_the_feed_that_completes_it(cls):
    sent, sent_calls, rest, more = stream(cls, ["Intro. ", SAMPLES[cls], " More text", " and more."])
    assert sent_calls == [[], PARIS, [], []] and more == []
    assert sent == ["Intro.", "", " More text", " and more."] and rest == ""


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_only_a_possible_marker_start_is_held_back(cls):
    for marker in cls.call_start_markers:
        for k in range(1, len(marker)):
            parser = cls(TOOLS)
            assert parser.feed("Hello " + marker[:k]) == ("Hello", [])
            assert parser.feed("zz") == (" " + marker[:k] + "zz", [])
    parser = cls(TOOLS)
    assert parser.feed("no markers here") == ("no markers here", [])


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_unknown_tool_stays_content(cls):
    text = "Try: " + SAMPLES[cls].replace("get_weather", "rm_rf") + " ok"
    assert parse(cls, text) == (text, [])
    assert_stream_matches_parse(cls, text)
    assert parse(cls, SAMPLES[cls], tools={}) == (SAMPLES[cls], [])


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_every_truncation_is_content_or_the_complete_call(cls):
    sample = "Ok " + SAMPLES[cls]
    for i in range(len(sample) + 1):
        content, calls = parse(cls, sample[:i])
        # A suffix cut short (Gemma's "<tool_c") is not markup of the call: it stays content.
        cut_suffixes = [s[:k] for s in cls.call_suffixes for k in range(1, len(s))]
        allowed = [(sample[:i], []), ("Ok", PARIS)] + [("Ok" + s, PARIS) for s in cut_suffixes]
        assert (content, calls) in allowed, f"prefix of {i}"
        # finish() in the middle of a streamed call gives the same.
        assert streamed(cls, list(sample[:i])) == (content, calls)


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_feed_after_finish_is_a_caller_error(cls):
    parser = cls(TOOLS)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
    with pytest.raises(RuntimeError):
        parser.finish()


# --- deep nesting: RecursionError must degrade to content ---------------------------------

DEPTH = 100_000
NEST = "[" * DEPTH + "]" * DEPTH
GEMMA_NEST = "{a:" * DEPTH + "1" + "}" * DEPTH
DEEP: dict[type[ToolCallParser], list[str]] = {
    HermesParser: ['<tool_call>{"name": "search", "arguments": {"q": ' + NEST + "}}</tool_call>",
                   "<tool_call>" + NEST + "</tool_call>",
                   '<tool_call>{"name": "search", "arguments": {"q": ' + "[" * DEPTH + '"</tool_call> x'],
    Gemma4Parser: ["<|tool_call>call:search{q:" + NEST + "}<tool_call|>",
                   "<|tool_call>call:search{q:" + GEMMA_NEST + "}<tool_call|>"],
    Llama3JsonParser: ['{"name": "search", "parameters": {"q": ' + NEST + "}}",
                       '<|python_tag|>{"name": "search", "parameters": ' + "{" * DEPTH + "}" * DEPTH + "}"],
    MistralParser: ['[TOOL_CALLS][{"name": "search", "arguments": {"q": ' + NEST + "}}]",
                    "[TOOL_CALLS]" + NEST,
                    '[TOOL_CALLS]search[ARGS]{"q": ' + NEST + "}"],
    QwenXmlParser: [],  # values are text; typed decoding falls back to a string (its own test)
}


@pytest.mark.parametrize("text", [(cls, t) for cls, texts in DEEP.items() for t in texts],
                         ids=lambda p: p[0].format_name)
def test_deeply_nested_json_degrades_to_content(text):
    cls, text = text
    text = "Deep: " + text + " end"
    assert parse(cls, text) == (text, [])
    for cut in (3, 100, DEPTH // 2, DEPTH, len(text) - 40, len(text) - 5):
        assert streamed(cls, [text[:cut], text[cut:]]) == (text, [])


@pytest.mark.parametrize("cls", [HermesParser, Llama3JsonParser, MistralParser], ids=lambda c: c.format_name)
def test_nesting_that_decodes_but_cannot_be_reencoded_never_raises(cls):
    # Depths around the interpreter's recursion limit: decoding may succeed where encoding
    # the arguments fails; either way the result is a call or content, never an exception.
    for depth in (500, 990, 1000, 1010, 3000):
        deep = "[" * depth + "]" * depth
        text = SAMPLES[cls].replace('"Paris"', deep)
        content, calls = parse(cls, text)
        assert (content, calls) == (text, []) or (content == "" and len(calls) == 1)


# --- fuzzing: any text, any split ------------------------------------------------------------

def _fragments(cls: type[ToolCallParser]) -> list[str]:
    sample = SAMPLES[cls]
    pieces = [sample[i:j] for i, j in [(0, 5), (5, 17), (17, 30), (30, None), (0, None)]]
    markers = list(cls.markers + cls.call_start_markers + cls.call_suffixes)
    partial = [m[: len(m) // 2] for m in markers]
    return markers + partial + pieces + [
        "a", " ", "\n", "é", "🎉", "{", "}", "[", "]", ",", ":", ";", '"', "\\", "<", ">", "|",
        "get_weather", "search", "rm_rf", '"name"', '"arguments"', '"parameters"', "call:",
        '<|"|>', "<parameter=city>", "</parameter>", "<function=search>", "</function>", "[ARGS]",
        "true", "12", "null",
    ]


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_fuzz_never_raises_keeps_text_and_streams_like_parse(cls):
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(parts=st.lists(st.sampled_from(_fragments(cls)), max_size=30), data=st.data())
    def check(parts, data):
        text = "".join(parts)
        content, calls = parse(cls, text)
        if not calls:
            assert content == text  # nothing is dropped when nothing was recognized
        assert len(content) <= len(text)
        cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        assert streamed(cls, pieces) == (content, calls)

    check()


def test_arguments_are_valid_json_objects_with_unicode_kept():
    content, calls = HermesParser(TOOLS).parse(
        '<tool_call>{"name": "search", "arguments": {"q": "Zürich 🎉"}}</tool_call>')
    assert calls[0]["function"]["arguments"] == '{"q": "Zürich 🎉"}'
    assert json.loads(calls[0]["function"]["arguments"]) == {"q": "Zürich 🎉"}


@pytest.mark.parametrize("cls", ALL, ids=ids)
def test_feed_events_keep_content_and_calls_in_output_order(cls):
    # One delta holding content, a call, more content and a second call: feed() can only
    # say "this content, these calls"; feed_events() says in which order they came.
    call = SAMPLES[cls]
    parser = cls(TOOLS)
    events = parser.feed_events("Sure.\n" + call + "\nAlso: " + call + "\nDone") + parser.finish_events()
    kinds = [e if isinstance(e, str) else (e["function"]["name"], json.loads(e["function"]["arguments"]))
             for e in events]
    texts = [k for k in kinds if isinstance(k, str)]
    assert all(texts)  # never an empty content item
    # Merge adjacent text items (how they are split is the engine's business).
    merged: list = []
    for k in kinds:
        if isinstance(k, str) and merged and isinstance(merged[-1], str):
            merged[-1] += k
        else:
            merged.append(k)
    assert merged == ["Sure.", *PARIS, "\nAlso:", *PARIS, "\nDone"]
    assert "".join(texts) == cls(TOOLS).parse("Sure.\n" + call + "\nAlso: " + call + "\nDone")[0]
