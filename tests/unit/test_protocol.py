"""protocol.parse_chat_request: spec §4 validation order, §5 parameters, every rejection row."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve.errors import APIError
from trioserve.protocol import SUPPORTED_PARAMETERS, ChatRequest, parse_chat_request

MODEL = "smollm2"
LIMIT = 4 << 20
USER = {"role": "user", "content": "Hi"}


def body(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model": MODEL, "messages": [USER]}
    base.update(fields)
    return {k: v for k, v in base.items() if v is not OMIT}


OMIT = object()


def parse(obj: Any) -> ChatRequest:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return parse_chat_request(raw, served_model=MODEL, max_body_bytes=LIMIT)


def error(obj: Any, max_body_bytes: int = LIMIT) -> APIError:
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    with pytest.raises(APIError) as info:
        parse_chat_request(raw, served_model=MODEL, max_body_bytes=max_body_bytes)
    return info.value


def assert_error(err: APIError, status: int, code: str, param: str | None) -> None:
    assert (err.status, err.code, err.param) == (status, code, param), err.message
    assert err.type == "invalid_request_error"


# --- defaults and normalization ---------------------------------------------------------


def test_minimal_request_gets_documented_defaults():
    req = parse(body())
    assert req == ChatRequest(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert (req.stream, req.include_usage, req.temperature, req.top_p, req.top_k) == (
        False, False, 1.0, 1.0, 0)
    assert (req.seed, req.max_tokens, req.stop, req.tools, req.tool_choice) == (
        None, None, (), None, "auto")
    assert req.chat_template_kwargs == {}
    assert not req.tools_enabled


def test_honoured_parameters_are_normalized():
    req = parse(body(
        stream=True, stream_options={"include_usage": True, "other": 1}, temperature=0,
        top_p=0.5, top_k=40, seed=1234, max_tokens=100, stop="END",
        chat_template_kwargs={"enable_thinking": False},
    ))
    assert req.stream and req.include_usage
    assert (req.temperature, req.top_p, req.top_k, req.seed) == (0.0, 0.5, 40, 1234)
    assert isinstance(req.temperature, float)
    assert req.max_tokens == 100 and req.stop == ("END",)
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_null_means_not_given():
    req = parse(body(stream=None, temperature=None, top_p=None, seed=None, stop=None,
                     tools=None, tool_choice=None, max_tokens=None, n=None, logprobs=None,
                     stream_options=None, chat_template_kwargs=None, response_format=None))
    assert req == parse(body())


@pytest.mark.parametrize("a, b, expected", [(100, None, 100), (None, 50, 50), (100, 50, 50), (30, 80, 30)])
def test_max_tokens_takes_the_smaller_of_both(a, b, expected):
    assert parse(body(max_tokens=a, max_completion_tokens=b)).max_tokens == expected


def test_huge_max_tokens_and_top_k_are_clamped_to_int32():
    req = parse(body(max_tokens=10**12, top_k=2**40))
    assert (req.max_tokens, req.top_k) == (2**31 - 1, 2**31 - 1)


def test_integral_float_is_accepted_for_integers():
    assert parse(body(max_tokens=100.0)).max_tokens == 100


@pytest.mark.parametrize("seed, expected", [
    (0, 0), (2**32 - 1, 2**32 - 1), (2**32 + 5, 5), (-1, 2**32 - 1), (-(2**63), 0),
    (2**64 - 1, 2**32 - 1)])
def test_seed_accepts_int64_and_uint64_reduced_modulo_2_32(seed, expected):
    assert parse(body(seed=seed)).seed == expected


def test_stop_list_keeps_order_drops_duplicates_and_empty_strings():
    assert parse(body(stop=["b", "a", "b"])).stop == ("b", "a")
    assert parse(body(stop=[])).stop == ()
    assert parse(body(stop="")).stop == ()
    assert parse(body(stop=["", "x", ""])).stop == ("x",)
    assert len(parse(body(stop=[str(i) for i in range(16)])).stop) == 16


def test_include_usage_only_when_streaming():
    assert parse(body(stream=True, stream_options={"include_usage": True})).include_usage
    assert not parse(body(stream_options={"include_usage": True})).include_usage


def test_messages_are_normalized_for_templates():
    req = parse(body(messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "bob"},
        {"role": "assistant", "content": None, "refusal": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "get", "arguments": "{\"city\": \"Paris\"}"}},
                        {"id": "call_2", "function": {"name": "raw", "arguments": "not json"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."},
    ]))
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "bob"},
        {"role": "assistant", "content": "", "reasoning_content": "hmm", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function", "function": {"name": "raw", "arguments": "not json"}},
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Sunny."},
    ]


def test_tools_are_normalized_and_enabled_with_auto():
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "d",
                                               "parameters": {"type": "object"}, "strict": True}},
             {"type": "function", "function": {"name": "noop"}}]
    req = parse(body(tools=tools))
    assert req.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "d", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "noop"}},
    ]
    assert req.tools_enabled and req.tool_names == {"get_weather", "noop"}
    req = parse(body(tools=tools, tool_choice="none"))
    assert req.tool_choice == "none" and not req.tools_enabled
    assert parse(body(tools=[])).tools is None


def test_accepted_and_ignored_parameters_do_not_change_the_request():
    ignored = dict(user="u", store=False, metadata={"a": "b"}, service_tier="auto", prediction=None,
                   prompt_cache_key="k", safety_identifier="s",
                   stream_options={"include_obfuscation": False}, parallel_tool_calls=True, n=1,
                   logprobs=False, top_logprobs=None, frequency_penalty=0, presence_penalty=0.0,
                   logit_bias={}, response_format={"type": "text"}, modalities=["text"],
                   reasoning_effort=None, audio=None, functions=None, function_call=None,
                   web_search_options=None, verbosity=None)
    assert parse(body(**ignored)) == parse(body())
    assert parse(body(logit_bias=None)) == parse(body())


# --- stage 1: size ----------------------------------------------------------------------


def test_body_over_the_limit_is_413_before_anything_else():
    raw = b"not json at all" * 10
    assert_error(error(raw, max_body_bytes=100), 413, "request_too_large", None)
    assert parse_chat_request(json.dumps(body()).encode(), served_model=MODEL, max_body_bytes=len(json.dumps(body())))


# --- stage 2: JSON ----------------------------------------------------------------------


@pytest.mark.parametrize("raw", [b"", b"  \n", b"{", b"{'a': 1}", b"[1, 2]", b'"str"', b"null", b"\xff\xfe{",
                                 '{"model": "x"}'.encode("utf-16"), b'{"model": "\xe9"}',
                                 b'{"model": NaN}', b'{"temperature": Infinity}', b"[" * 100000])
def test_malformed_json_or_non_object_is_invalid_json(raw):
    assert_error(error(raw), 400, "invalid_json", None)


# --- stage 3: types and values ----------------------------------------------------------

INVALID = [
    # (fields, param, code)
    ({"messages": OMIT}, "messages", "missing_required_parameter"),
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_value"),
    ({"messages": ["hi"]}, "messages[0]", "invalid_value"),
    ({"model": OMIT}, "model", "missing_required_parameter"),
    ({"model": 3}, "model", "invalid_value"),
    ({"messages": [{"content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [USER, {"role": 1, "content": "x"}]}, "messages[1].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content", "missing_required_parameter"),
    ({"messages": [USER, {"role": "user", "content": 5}]}, "messages[1].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content[0]", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"text": "x"}]}]}, "messages[0].content[0].type", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages[0].content[0].text", "invalid_value"),
    ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name", "invalid_value"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]}, "messages[0].tool_call_id", "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": "x"}]}, "messages[0].tool_calls", "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].type", "invalid_value"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c"}]}]},
     "messages[0].tool_calls[0].function", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]},
     "messages[0].tool_calls[0].function.arguments", "invalid_value"),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": 1}]},
     "messages[0].reasoning_content", "invalid_value"),
    ({"stream": "yes"}, "stream", "invalid_value"),
    ({"stream": 1}, "stream", "invalid_value"),
    ({"stream_options": True}, "stream_options", "invalid_value"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"temperature": True}, "temperature", "invalid_value"),
    ({"temperature": -0.1}, "temperature", "invalid_value"),
    ({"temperature": 2.01}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"top_p": "1"}, "top_p", "invalid_value"),
    ({"top_k": -1}, "top_k", "invalid_value"),
    ({"top_k": 1.5}, "top_k", "invalid_value"),
    ({"seed": "42"}, "seed", "invalid_value"),
    ({"seed": 4.2}, "seed", "invalid_value"),
    ({"seed": True}, "seed", "invalid_value"),
    ({"seed": -(2**63) - 1}, "seed", "invalid_value"),
    ({"seed": 2**64}, "seed", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"max_tokens": "10"}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_value"),
    ({"stop": ["a", 1]}, "stop[1]", "invalid_value"),
    ({"stop": {"a": 1}}, "stop", "invalid_value"),
    ({"stop": [str(i) for i in range(17)]}, "stop", "invalid_value"),
    ({"tools": {}}, "tools", "invalid_value"),
    ({"tools": ["f"]}, "tools[0]", "invalid_value"),
    ({"tools": [{"function": {"name": "f"}}]}, "tools[0].type", "missing_required_parameter"),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools[1].function.name", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters", "invalid_value"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}, "tools[0].function.description", "invalid_value"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools[0].type", "invalid_value"),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
    ({"tool_choice": 1}, "tool_choice", "invalid_value"),
    ({"tool_choice": {"type": "tool"}}, "tool_choice.type", "invalid_value"),
    ({"tool_choice": {"type": "function"}}, "tool_choice.function", "missing_required_parameter"),
    ({"tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name", "missing_required_parameter"),
    ({"tool_choice": {"type": "function", "function": {"name": 3}}}, "tool_choice.function.name", "invalid_value"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "invalid_value"),
    ({"messages": [USER, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "input_audio", "input_audio": {}}]}]},
     "messages[1].content[1]", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]}, "messages[0].content[0]", "invalid_value"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs", "invalid_value"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages", "invalid_value"),
    ({"n": 0}, "n", "invalid_value"),
    ({"n": "1"}, "n", "invalid_value"),
    ({"logprobs": "true"}, "logprobs", "invalid_value"),
    ({"top_logprobs": "5"}, "top_logprobs", "invalid_value"),
    ({"frequency_penalty": "0.5"}, "frequency_penalty", "invalid_value"),
    ({"presence_penalty": "0"}, "presence_penalty", "invalid_value"),
    ({"logit_bias": []}, "logit_bias", "invalid_value"),
    ({"response_format": "text"}, "response_format", "invalid_value"),
    ({"response_format": {}}, "response_format.type", "missing_required_parameter"),
    ({"user": 1}, "user", "invalid_value"),
    ({"store": "no"}, "store", "invalid_value"),
    ({"metadata": "x"}, "metadata", "invalid_value"),
    ({"modalities": "text"}, "modalities", "invalid_value"),
    ({"prompt_cache_key": 1}, "prompt_cache_key", "invalid_value"),
]


@pytest.mark.parametrize("fields, param, code", INVALID, ids=[p for _, p, _ in INVALID])
def test_invalid_values_name_the_parameter_path(fields, param, code):
    err = error(body(**fields))
    assert_error(err, 400, code, param)
    assert param in err.message


def test_messages_never_leak_python_internals():
    err = error(body(temperature="hot"))
    assert err.message == "Invalid type for 'temperature': expected a number, got string."


def test_first_value_problem_is_reported_in_a_fixed_order():
    # messages is checked before temperature whatever the key order in the body
    raw = {"temperature": 9, "model": MODEL, "messages": []}
    assert error(raw).param == "messages"


def test_value_problems_beat_unsupported_parameters():
    assert_error(error(body(n=2, temperature=5)), 400, "invalid_value", "temperature")


def test_invalid_and_unsupported_is_invalid_value():
    assert_error(error(body(foo=1, messages=[{"role": "robot", "content": "x"}])), 400, "invalid_value",
                 "messages[0].role")


def test_size_beats_json():
    assert_error(error(b"{" * 50, max_body_bytes=10), 413, "request_too_large", None)


# --- stage 4: unsupported parameters ----------------------------------------------------

UNSUPPORTED = [
    ({"n": 2}, "n"),
    ({"logprobs": True}, "logprobs"),
    ({"top_logprobs": 0}, "top_logprobs"),
    ({"top_logprobs": 5}, "top_logprobs"),
    ({"top_logprobs": 50}, "top_logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"presence_penalty": -1}, "presence_penalty"),
    ({"logit_bias": {"50256": -100}}, "logit_bias"),
    # json_object and json_schema are supported since issue 13 (tests/unit/test_structured.py).
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    # Forced tool_choice is supported since issue 13; parallel_tool_calls false only where a
    # grammar enforces it (not with tool_choice auto and no JSON response_format).
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False},
     "parallel_tool_calls"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"verbosity": "low"}, "verbosity"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"min_p": 0.1}, "min_p"),
    ({"session_id": "abc"}, "session_id"),
    ({"foo": None}, "foo"),
]


@pytest.mark.parametrize("fields, param", UNSUPPORTED, ids=[p for _, p in UNSUPPORTED])
def test_unsupported_parameters_are_rejected(fields, param):
    err = error(body(**fields))
    assert_error(err, 400, "unsupported_parameter", param)
    assert param in err.message
    for supported in SUPPORTED_PARAMETERS:
        assert supported in err.message


def test_image_part_message_says_only_text_is_supported():
    err = error(body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]))
    assert "only text content parts" in err.message and "image_url" in err.message


def test_all_unsupported_parameters_are_named_first_in_body_order():
    raw = {"logprobs": True, "model": MODEL, "n": 3, "messages": [USER], "foo": 1,
           "presence_penalty": 1}
    err = error(raw)
    assert_error(err, 400, "unsupported_parameter", "logprobs")
    for name in ("'logprobs'", "'n'", "'foo' (unknown parameter)", "'presence_penalty'"):
        assert name in err.message
    assert err.message.index("'logprobs'") < err.message.index("'n'") < err.message.index("'foo'")


def test_unsupported_beats_unknown_model():
    assert_error(error(body(model="gpt-4o", n=2)), 400, "unsupported_parameter", "n")


# --- stage 5: model ---------------------------------------------------------------------


def test_unknown_model_is_404():
    err = error(body(model="gpt-4o"))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-4o" in err.message and MODEL in err.message


# --- structured outputs (issue 13): what protocol passes on to trioserve.structured ----------


def test_forced_tool_choice_and_response_format_are_carried():
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse(body(tools=tools, tool_choice="required", parallel_tool_calls=False))
    assert req.tool_choice == "required" and req.tools_enabled and not req.parallel_tool_calls
    named = {"type": "function", "function": {"name": "f", "extra": 1}}
    req = parse(body(tools=tools, tool_choice=named))
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}} and req.tools_enabled
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert parse(body(response_format=fmt)).response_format == fmt
    assert parse(body(response_format={"type": "json_object"})).response_format == {"type": "json_object"}
    assert parse(body(response_format={"type": "text"})).response_format is None
    # parallel_tool_calls false is accepted where a grammar enforces it
    assert not parse(body(tools=tools, parallel_tool_calls=False,
                          response_format={"type": "json_object"})).parallel_tool_calls
    assert not parse(body(parallel_tool_calls=False)).parallel_tool_calls  # no tools: vacuous
