"""The rule for fields the server does not know, per API, without processes (spec §4.1):
unknown keys inside conversation items are noted with their paths and never reach the model
(the core request equals the one without them); unknown top-level parameters, unknown item and
part types, and known item fields that would change what the model sees but cannot be honoured
stay 400s."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve import errors
from trioserve.api.chat.adapter import core_request as chat_core_request
from trioserve.api.chat.validation import parse_chat_request
from trioserve.api.messages.request import parse_messages_request
from trioserve.api.responses.request import parse_responses_body

# Keys no API knows, used as harness metadata below.
METADATA = {"x_meta", "cache_hint", "index", "parsed", "trace_id", "annotations",
            "internal_chat_message_metadata_passthrough", "origin", "duration_ms", "meta",
            "extra", "billing", "citations", "redacted", "caller", "duration", "x"}


def without_metadata(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: without_metadata(v) for k, v in value.items() if k not in METADATA}
    if isinstance(value, list):
        return [without_metadata(v) for v in value]
    return value


def refused(parse: Any, body: dict[str, Any]) -> errors.APIError:
    with pytest.raises(errors.APIError) as info:
        parse(body)
    return info.value


# --- Chat Completions --------------------------------------------------------------------------


def chat(body: dict[str, Any]):
    return parse_chat_request(json.dumps({"model": "m", **body}).encode(), served_model="m",
                              max_body_bytes=1 << 20)


CHAT_MESSAGES = [
    {"role": "system", "content": "S", "x_meta": {"a": [1, 2]}},
    {"role": "user", "name": "bob",
     "content": [{"type": "text", "text": "u", "cache_hint": {"type": "ephemeral"}}]},
    {"role": "assistant", "content": None, "refusal": None, "audio": None, "function_call": None,
     "reasoning_content": "r", "annotations": [],
     "tool_calls": [{"id": "c1", "type": "function", "index": 0,
                     "function": {"name": "f", "arguments": "{}", "parsed": {}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "ok", "trace_id": "t"},
    {"role": "user", "content": "go"},
]


def test_chat_unknown_keys_in_messages_parts_and_calls_are_noted_and_not_used():
    req = chat({"messages": CHAT_MESSAGES})
    assert req.ignored_fields.paths == [
        "messages[0].x_meta", "messages[1].content[0].cache_hint", "messages[2].annotations",
        "messages[2].tool_calls[0].index", "messages[2].tool_calls[0].function.parsed",
        "messages[3].trace_id"]
    plain = chat({"messages": without_metadata(CHAT_MESSAGES)})
    assert not plain.ignored_fields
    assert chat_core_request(req, None) == chat_core_request(plain, None)


def test_chat_refusal_is_what_the_assistant_said():
    def assistant_text(message: dict[str, Any]) -> str:
        req = chat({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", **message},
                                 {"role": "user", "content": "q2"}]})
        assert not req.ignored_fields
        return req.messages[1]["content"]

    assert assistant_text({"content": None, "refusal": "I can't help with that."}) == \
        "I can't help with that."
    assert assistant_text({"content": "Well.", "refusal": "No."}) == "Well.\nNo."
    assert assistant_text({"content": "Fine.", "refusal": None}) == "Fine."
    err = refused(chat, {"messages": [{"role": "assistant", "content": None}]})
    assert (err.code, err.param) == ("missing_required_parameter", "messages[0].content")


@pytest.mark.parametrize("key, value", [("audio", {"id": "audio_1"}),
                                        ("function_call", {"name": "f", "arguments": "{}"})])
def test_chat_assistant_fields_that_change_the_conversation_are_refused_not_dropped(key, value):
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", key: value},
                {"role": "user", "content": "q2"}]
    err = refused(chat, {"messages": messages})
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", f"messages[1].{key}")
    # In body order with the top-level offenders, all named in one error.
    err = refused(chat, {"foo": 1, "messages": messages, "bar": 2})
    assert err.param == "foo"
    assert all(name in err.message for name in ("'foo'", f"'messages[1].{key}'", "'bar'"))


def test_chat_unknown_top_level_parameter_is_still_refused():
    err = refused(chat, {"messages": CHAT_MESSAGES, "internal_metadata": {}})
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", "internal_metadata")


# --- Responses -----------------------------------------------------------------------------------


def responses(body: dict[str, Any]):
    return parse_responses_body({"model": "m", **body}, served_model="m")


RESPONSES_INPUT = [
    {"type": "message", "role": "developer", "content": "rules",
     "internal_chat_message_metadata_passthrough": {"turn": 1}},
    {"role": "user", "id": "msg_1", "status": "completed",
     "content": [{"type": "input_text", "text": "hi", "cache_hint": 1}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None, "x": 1,
     "content": [{"type": "reasoning_text", "text": "t", "extra": 1}]},
    {"type": "message", "role": "assistant", "phase": "commentary",
     "content": [{"type": "output_text", "text": "a", "annotations": [], "logprobs": []}]},
    {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "origin": "codex"},
    {"type": "function_call_output", "call_id": "c1", "duration_ms": 5,
     "output": [{"type": "input_text", "text": "ok", "meta": 2}]},
]


def test_responses_unknown_keys_in_items_and_parts_are_noted_not_used_and_not_stored():
    req = responses({"input": RESPONSES_INPUT, "tools": [{"type": "function", "name": "f"}]})
    assert req.ignored_fields.paths == [
        "input[0].internal_chat_message_metadata_passthrough", "input[1].content[0].cache_hint",
        "input[2].x", "input[2].content[0].extra", "input[4].origin", "input[5].duration_ms",
        "input[5].output[0].meta"]
    # An output_text part's annotations are an echo OpenAI defines: known, not reported.
    plain = responses({"input": without_metadata(RESPONSES_INPUT),
                       "tools": [{"type": "function", "name": "f"}]})
    assert req.core_request((), None) == plain.core_request((), None)
    stored = json.dumps(req.input_items)
    assert not any(f'"{key}"' in stored for key in METADATA - {"annotations"})
    assert [item["type"] for item in req.input_items] == [
        "message", "message", "reasoning", "message", "function_call", "function_call_output"]


@pytest.mark.parametrize("body, param", [
    ({"input": "x", "internal_metadata": {}}, "internal_metadata"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[0].content[0].type"),
])
def test_responses_unknown_parameters_and_types_are_still_refused(body, param):
    err = refused(responses, body)
    assert (err.status, err.code, err.param) == (400, "unsupported_parameter", param)


# --- Anthropic Messages ----------------------------------------------------------------------------


def messages(body: dict[str, Any]):
    return parse_messages_request(json.dumps({"model": "m", "max_tokens": 10, **body}).encode(),
                                  served_model="m", max_body_bytes=1 << 20)


MESSAGES_BODY = {
    "system": [{"type": "text", "text": "S", "cache_control": {"type": "ephemeral"}, "billing": 1}],
    "messages": [
        {"role": "user", "x": "m1", "content": [{"type": "text", "text": "q", "citations": []}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "t", "signature": "", "redacted": False},
            {"type": "tool_use", "id": "tu", "name": "Bash", "input": {"c": 1},
             "caller": {"type": "direct"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "tu", "duration": 3, "cache_control": None,
             "content": [{"type": "text", "text": "r", "extra": 1}]},
            {"type": "text", "text": "go"}]},
    ],
}


def test_messages_unknown_keys_in_messages_blocks_and_system_are_noted_and_not_used():
    req = messages(MESSAGES_BODY)
    assert req.ignored_fields.paths == [
        "system[0].billing", "messages[0].x", "messages[0].content[0].citations",
        "messages[1].content[0].redacted", "messages[1].content[1].caller",
        "messages[2].content[0].duration", "messages[2].content[0].content[0].extra"]
    plain = messages(without_metadata(MESSAGES_BODY))
    assert not plain.ignored_fields
    assert req.core == plain.core


@pytest.mark.parametrize("body, param", [
    ({"internal_metadata": {}}, "internal_metadata"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
])
def test_messages_unknown_parameters_and_unsupported_blocks_are_still_refused(body, param):
    err = refused(messages, {**MESSAGES_BODY, **body})
    assert (err.status, err.code) == (400, "unsupported_parameter")
    assert f"'{param}'" in err.message or err.param == param
