"""protocol.parse_chat_request: spec §4 validation order, §5 parameters, every rejection row."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trioserve.errors import APIError
from trioserve.api.chat.validation import SUPPORTED_PARAMETERS, ChatRequest, parse_chat_request
from testkit import REPO

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


# Worker seeds are [0, 2^32 - 1): 2^32 - 1 is llama.cpp's "random" sentinel (limits.worker_seed).
WORKER_SEEDS = 2**32 - 1


@pytest.mark.parametrize("seed, expected", [
    (0, 0), (1234, 1234), (2**32 - 2, 2**32 - 2), (2**32 - 1, 0), (2**32, 1), (2**32 + 5, 6),
    (-2, 2**32 - 3), (-(2**63), (-(2**63)) % WORKER_SEEDS), (2**63 - 1, (2**63 - 1) % WORKER_SEEDS),
    (2**64 - 1, 0), (2**64 - 2, 2**32 - 2), (1e9, 10**9)])
def test_seed_accepts_int64_and_uint64_wrapped_into_the_worker_range(seed, expected):
    assert parse(body(seed=seed)).seed == expected


def test_seed_minus_one_means_random_like_absent():
    # Regression: -1 (a common client default) used to become 2^32 - 1, which the worker
    # refuses, and the client got a 400 blaming 'messages'.
    assert parse(body(seed=-1)).seed is None
    assert parse(body(seed=-1)) == parse(body())


@pytest.mark.parametrize("seed", [-(2**63), -(2**31), -2, -1, 0, 2**31, 2**32 - 2, 2**32 - 1, 2**32,
                                  2**63, 2**64 - 1])
def test_every_accepted_seed_is_a_seed_the_worker_accepts(seed):
    worker = parse(body(seed=seed)).seed
    assert worker is None or 0 <= worker < WORKER_SEEDS


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
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"verbosity": "low"}, "verbosity"),
    ({"audio": {"voice": "x"}}, "audio"),
    ({"min_p": 0.1}, "min_p"),
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
           "modalities": ["audio"]}
    err = error(raw)
    assert_error(err, 400, "unsupported_parameter", "logprobs")
    for name in ("'logprobs'", "'n'", "'foo' (unknown parameter)", "'modalities'"):
        assert name in err.message
    assert err.message.index("'logprobs'") < err.message.index("'n'") < err.message.index("'foo'")


def test_unsupported_beats_unknown_model():
    assert_error(error(body(model="gpt-4o", n=2)), 400, "unsupported_parameter", "n")


# --- stage 5: model ---------------------------------------------------------------------


def test_unknown_model_is_404():
    err = error(body(model="gpt-4o"))
    assert (err.status, err.code, err.param) == (404, "model_not_found", "model")
    assert "gpt-4o" in err.message and MODEL in err.message


# --- hostile input ----------------------------------------------------------------------
# Every case must be a clean 400 whose envelope can be sent: the app encodes responses as
# UTF-8 with ensure_ascii=False, so a lone surrogate echoed into a message would be a 500.


def raw_error(raw: bytes) -> APIError:
    err = error(raw)
    json.dumps(err.envelope(), ensure_ascii=False).encode("utf-8")  # must not raise
    return err


def raw_body(**fields: str) -> bytes:
    """A body whose listed fields are raw JSON text (json.dumps cannot write lone surrogates
    as escapes the way a hostile client can)."""
    base = {"model": json.dumps(MODEL), "messages": json.dumps([USER])}
    base.update(fields)
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in base.items()) + "}").encode()


LONE = r'"a\ud800b"'  # JSON text: a string with a lone high surrogate
SURROGATES = [
    (dict(model=LONE), "model"),
    (dict(messages=f'[{{"role": "user", "content": {LONE}}}]'), "messages[0].content"),
    (dict(messages='[{"role": "user", "content": [{"type": "text", "text": "ok"}, '
                   '{"type": "text", "text": "\\udc00"}]}]'), "messages[0].content[1].text"),
    (dict(messages=f'[{{"role": "user", "content": "x", "name": {LONE}}}]'), "messages[0].name"),
    (dict(messages=f'[{{"role": "tool", "content": "x", "tool_call_id": {LONE}}}]'),
     "messages[0].tool_call_id"),
    (dict(messages=f'[{{"role": "assistant", "content": "x", "reasoning_content": {LONE}}}]'),
     "messages[0].reasoning_content"),
    (dict(messages=f'[{{"role": "assistant", "tool_calls": [{{"id": "c", "function": '
                   f'{{"name": "f", "arguments": {LONE}}}}}]}}]'),
     "messages[0].tool_calls[0].function.arguments"),
    # The surrogate escaped once more: valid Unicode as a string, but the JSON in it is not.
    (dict(messages=r'[{"role": "assistant", "tool_calls": [{"id": "c", "function": '
                   r'{"name": "f", "arguments": "{\"city\": \"\\ud800\"}"}}]}]'),
     "messages[0].tool_calls[0].function.arguments"),
    (dict(stop=LONE), "stop"),
    (dict(stop=f'["ok", {LONE}]'), "stop[1]"),
    (dict(tools=f'[{{"type": "function", "function": {{"name": "f", "description": {LONE}}}}}]'),
     "tools[0].function.description"),
    (dict(tools='[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", '
                f'"properties": {{"city": {{"description": {LONE}}}}}}}}}}}]'),
     "tools[0].function.parameters.properties.city.description"),
    (dict(tool_choice=f'{{"type": "function", "function": {{"name": {LONE}}}}}'),
     "tool_choice.function.name"),
    (dict(chat_template_kwargs=f'{{"greeting": [{LONE}]}}'), "chat_template_kwargs.greeting[0]"),
    (dict(user=LONE), "user"),
    (dict(metadata=f'{{"k": {LONE}}}'), "metadata.k"),
    (dict(prompt_cache_key=LONE), "prompt_cache_key"),
]


@pytest.mark.parametrize("fields, param", SURROGATES, ids=[p for _, p in SURROGATES])
def test_lone_surrogates_are_invalid_value_at_their_exact_path(fields, param):
    err = raw_error(raw_body(**fields))
    assert_error(err, 400, "invalid_value", param)
    assert "lone surrogate" in err.message and "not valid Unicode" in err.message


def test_lone_surrogate_in_a_free_form_key_is_named_with_an_escape():
    err = raw_error(raw_body(chat_template_kwargs=r'{"x": {"\ud800": 1}}'))
    assert_error(err, 400, "invalid_value", "chat_template_kwargs.x")
    assert "key" in err.message


def test_lone_surrogate_in_an_unknown_parameter_name_is_escaped_in_the_error():
    err = raw_error(raw_body(**{"\\ud800x": "1"}))
    assert_error(err, 400, "unsupported_parameter", "\\ud800x")


def test_lone_surrogate_in_an_ignored_message_key_is_ignored_with_the_key():
    req = parse(raw_body(messages=r'[{"role": "user", "content": "x", "refusal": "\ud800"}]'))
    assert req.messages == [{"role": "user", "content": "x"}]


def test_valid_surrogate_pairs_are_text():
    req = parse(raw_body(messages=r'[{"role": "user", "content": "\ud83c\udf89"}]'))
    assert req.messages[0]["content"] == "🎉"


@pytest.mark.parametrize("raw", [
    b"[" * 100_000,
    b'{"model": "smollm2", "messages": ' + b"[" * 100_000,
    b'{"metadata": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    # below Python's recursion limit, above the contract's nesting limit
    b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "metadata": '
    + b'{"a": ' * 64 + b"1" + b"}" * 64 + b"}",
])
def test_deeply_nested_bodies_are_invalid_json(raw):
    err = raw_error(raw)
    assert_error(err, 400, "invalid_json", None)


def test_nesting_up_to_the_limit_is_accepted():
    from trioserve.limits import MAX_JSON_DEPTH
    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH - 1):  # the body object is the first level
        deep = {"a": deep}
    assert parse(body(metadata=deep)) == parse(body())
    err = error(body(metadata={"a": deep}))
    assert_error(err, 400, "invalid_json", None)


@pytest.mark.parametrize("arguments", ["[" * 100_000, '{"a": ' * 100 + "1" + "}" * 100])
def test_deeply_nested_tool_call_arguments_are_invalid_value(arguments):
    err = raw_error(json.dumps(body(messages=[
        {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": arguments}}]}
    ])).encode())
    assert_error(err, 400, "invalid_value", "messages[0].tool_calls[0].function.arguments")


@pytest.mark.parametrize("literal", [b"1e400", b"-1e400", b"1.5e308000", b"NaN", b"Infinity", b"-Infinity",
                                     b"9" * 5000, b"-" + b"9" * 5000])
@pytest.mark.parametrize("field", [b"temperature", b"seed", b"metadata"])
def test_out_of_range_or_non_json_numbers_are_invalid_json(literal, field):
    raw = b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "' + field + b'": ' + literal + b"}"
    err = raw_error(raw)
    assert_error(err, 400, "invalid_json", None)
    assert "int_max_str_digits" not in err.message  # no Python internals


def test_long_but_bounded_integers_reach_range_checks():
    assert_error(error(body(seed=10**99)), 400, "invalid_value", "seed")
    assert parse(body(max_tokens=10**99)).max_tokens == 2**31 - 1
    assert parse(body(metadata={"n": 10**4000})) == parse(body())


def test_a_top_level_number_body_is_invalid_json_not_a_crash():
    for raw in (b"1e400", b"9" * 5000, b"NaN"):
        assert_error(raw_error(raw), 400, "invalid_json", None)


def test_unicode_checks_run_only_when_the_body_has_a_surrogate_escape():
    """The fast path must not miss anything: every way a lone surrogate can be written
    contains the escape the pre-check looks for, and valid pairs still parse."""
    from trioserve.strict_json import _SURROGATE_ESCAPE
    assert _SURROGATE_ESCAPE.search(raw_body(user=r'"\uDBFF"'))
    assert not _SURROGATE_ESCAPE.search(json.dumps(body(user="日本語 🎉"), ensure_ascii=False).encode())
    assert parse(json.dumps(body(user="🎉")).encode()) == parse(body())  # "\ud83c\udf89"
    err = raw_error(raw_body(user=r'"\uDBFF"'))
    assert_error(err, 400, "invalid_value", "user")


def test_no_python_exception_escapes_for_odd_json():
    for raw in [b"{}", b'{"messages": {}}', b'{"model": {}, "messages": [[]]}', b'{"model": "smollm2", "messages": [{"role": []}]}',
                b'{"model": "smollm2", "messages": [{"role": "user", "content": [[]]}]}',
                b'{"model": "smollm2", "messages": [{"role": "assistant", "tool_calls": [[]]}]}',
                b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": []}]}',
                b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "response_format": []}',
                b'{"model": "smollm2", "messages": [{"role": "user", "content": "x"}], "stream_options": []}']:
        assert raw_error(raw).status == 400


# --- fields modelled for features to come ---------------------------------------------------

@pytest.mark.parametrize("fields, expected", [
    ({"prompt_cache_retention": "in_memory"}, {"prompt_cache_retention": "in_memory"}),
    ({"prompt_cache_retention": "24h"}, {"prompt_cache_retention": "24h"}),
    ({"session_id": "abc", "prompt_cache_key": "k"}, {"session_id": "abc", "prompt_cache_key": "k"}),
])
def test_session_fields_reach_chat_request(fields, expected):
    """Supported since sessions (spec §12); the chat adapter picks the key by precedence."""
    req = parse(body(**fields))
    assert {k: getattr(req, k) for k in expected} == expected


MODELLED_INVALID = [
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "invalid_value"),
    ({"reasoning_effort": 1}, "reasoning_effort", "invalid_value"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": 1}}, "response_format.type", "invalid_value"),
    ({"response_format": {"type": None}}, "response_format.type", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
     "response_format.json_schema.schema", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": "yes"}}},
     "response_format.json_schema.strict", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema.name", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "invalid_value"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     "response_format.json_schema.schema", "missing_required_parameter"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention", "invalid_value"),
    ({"prompt_cache_key": ["k"]}, "prompt_cache_key", "invalid_value"),
    ({"tool_choice": {"function": {"name": "f"}}}, "tool_choice.type", "missing_required_parameter"),
]


@pytest.mark.parametrize("fields, param, code", MODELLED_INVALID, ids=[p for _, p, _ in MODELLED_INVALID])
def test_modelled_fields_are_validated_and_named(fields, param, code):
    err = error(body(**fields))
    assert_error(err, 400, code, param)
    assert param in err.message


@pytest.mark.parametrize("fields, expected", [
    ({"response_format": {"type": "json_object"}}, {"response_format": {"type": "json_object"}}),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}},
     {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}}}}),
    ({"tool_choice": "required"}, {"tool_choice": "required", "tool_choice_function": None}),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}},
     {"tool_choice": "function", "tool_choice_function": "f"}),
])
def test_structured_output_fields_reach_chat_request(fields, expected):
    """Supported since structured outputs (spec §5.6); core/constraints.py enforces them."""
    req = parse(body(**fields))
    assert {k: getattr(req, k) for k in expected} == expected


def test_parallel_tool_calls_false_reaches_chat_request_and_is_listed_as_supported():
    """Honoured under every tool_choice since the first complete call can end the answer
    (spec §10 "At most one call")."""
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse(body(parallel_tool_calls=False, tools=tools))
    assert req.parallel_tool_calls is False and req.tool_choice == "auto"
    assert ", parallel_tool_calls" in error(body(n=2)).message


def test_neutral_values_of_modelled_fields_are_the_defaults():
    req = parse(body(response_format={"type": "text"}, parallel_tool_calls=True, prompt_cache_key="k",
                     reasoning_effort=None, prompt_cache_retention=None))
    assert (req.response_format, req.parallel_tool_calls, req.reasoning_effort) == (None, True, None)
    assert (req.prompt_cache_key, req.prompt_cache_retention) == ("k", None)
    assert req.tool_choice == "auto" and req.tool_choice_function is None


# --- limits and the worker's ranges ---------------------------------------------------------


def test_edge_values_map_into_the_worker_ranges():
    from trioserve import limits
    req = parse(body(temperature=limits.TEMPERATURE_MAX, top_p=limits.TOP_P_MAX, top_k=2**64,
                     max_tokens=2**64, stop=[str(i) for i in range(limits.MAX_STOP_STRINGS)]))
    assert 0 <= req.temperature and req.top_p <= 1
    assert 0 <= req.top_k < 2**31 and 1 <= req.max_tokens < 2**31
    assert len(req.stop) == limits.MAX_STOP_STRINGS


# --- JSON Schema export ---------------------------------------------------------------------


def test_committed_request_schema_is_generated_from_the_models():
    """spec/request.schema.json is `python -m trioserve.api.chat.validation > spec/request.schema.json`."""

    from trioserve.api.chat.validation import request_json_schema
    committed = REPO / "spec" / "request.schema.json"
    assert json.loads(committed.read_text(encoding="utf-8")) == request_json_schema()


def test_request_schema_accepts_what_the_parser_accepts():
    jsonschema = pytest.importorskip("jsonschema")
    from trioserve.api.chat.validation import request_json_schema
    schema = request_json_schema()
    full = body(stream=True, stream_options={"include_usage": True}, temperature=0.5, top_p=0.9, top_k=4,
                seed=-1, max_tokens=5, stop=["x"], tools=[{"type": "function", "function": {"name": "f"}}],
                tool_choice="auto", chat_template_kwargs={"enable_thinking": False}, user="u",
                messages=[{"role": "developer", "content": "d"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}]},
                          {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "c", "content": "r"}])
    parse(full)
    jsonschema.validate(full, schema)
    for bad in (body(temperature=3), body(foo=1), body(messages=[]), body(stop=[str(i) for i in range(17)])):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


NULLS = [
    # null for a required field is missing; a null list item is a wrong type
    ({"model": None}, "model", "missing_required_parameter"),
    ({"messages": [None]}, "messages[0]", "invalid_value"),
    ({"messages": [{"role": None, "content": "x"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [None]}]}, "messages[0].content[0]", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": None, "text": "x"}]}]},
     "messages[0].content[0].type", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
     "messages[0].content[0].text", "missing_required_parameter"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": None}]},
     "messages[0].tool_call_id", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": None, "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].id", "missing_required_parameter"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": None}]}]},
     "messages[0].tool_calls[0].function", "missing_required_parameter"),
    ({"stop": ["a", None]}, "stop[1]", "invalid_value"),
    ({"tools": [None]}, "tools[0]", "invalid_value"),
    ({"tools": [{"type": None, "function": {"name": "f"}}]}, "tools[0].type", "missing_required_parameter"),
    ({"tools": [{"type": "function", "function": {"name": None}}]}, "tools[0].function.name", "missing_required_parameter"),
    ({"tool_choice": {"type": "function", "function": None}}, "tool_choice.function", "missing_required_parameter"),
    ({"response_format": {"type": "json_schema", "json_schema": None}}, "response_format.json_schema",
     "missing_required_parameter"),
    ({"modalities": [None]}, "modalities[0]", "invalid_value"),
]


@pytest.mark.parametrize("fields, param, code", NULLS, ids=[p for _, p, _ in NULLS])
def test_null_is_missing_for_required_fields_and_wrong_for_list_items(fields, param, code):
    assert_error(error(body(**fields)), 400, code, param)


# --- property: any body is a ChatRequest or an APIError whose envelope can be sent ------------


# --- what SGLang-lineage routers write into every forwarded body ----------------------------

# The chat body vllm-router 0.1.17 forwards for {"model", "messages", "max_tokens"} (captured).
ROUTER_WRITTEN = dict(stream=False, logprobs=False, no_stop_trim=False, ignore_eos=False,
                      continue_final_message=False, skip_special_tokens=True,
                      separate_reasoning=True, stream_reasoning=True, return_hidden_states=False,
                      include_reasoning=True)


def test_a_body_as_a_router_rewrites_it_is_the_same_request():
    assert parse(body(max_tokens=3, **ROUTER_WRITTEN)) == parse(body(max_tokens=3))


@pytest.mark.parametrize("name", ["no_stop_trim", "ignore_eos", "continue_final_message",
                                  "skip_special_tokens", "separate_reasoning", "stream_reasoning",
                                  "include_reasoning", "return_hidden_states"])
def test_a_router_field_at_its_other_value_is_unsupported(name):
    err = error(body(**{name: not ROUTER_WRITTEN[name]}))
    assert_error(err, 400, "unsupported_parameter", name)
    assert f"only {str(ROUTER_WRITTEN[name]).lower()} is supported" in err.message
    assert_error(error(body(**{name: "yes"})), 400, "invalid_value", name)  # typed, not coerced



def test_completions_accept_the_fields_a_router_writes_there_too():
    from trioserve.api.completions.adapter import parse_completion_request

    def completion(**fields):
        raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, **fields}).encode()
        return parse_completion_request(raw, served_model=MODEL, max_body_bytes=LIMIT)

    # vllm-router 0.1.17's rewrite of that body (captured).
    written = dict(stream=False, echo=False, no_stop_trim=False, ignore_eos=False,
                   skip_special_tokens=True, return_hidden_states=False)
    assert completion(**written) == completion()
    with pytest.raises(APIError) as info:
        completion(ignore_eos=True)
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "ignore_eos")
    with pytest.raises(APIError) as info:
        completion(separate_reasoning=True)  # a chat-only field stays unknown here
    assert (info.value.code, info.value.param) == ("unsupported_parameter", "separate_reasoning")


from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trioserve.api.chat.models import ChatCompletionBody  # noqa: E402

# Text with lone surrogates, control characters and astral characters.
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=8)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | ANY_TEXT
    | st.sampled_from(["user", "assistant", "tool", "system", "text", "function", "auto", "none",
                       "required", "json_schema", "low", "24h", "f", MODEL]),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "name", "id", "function",
                                       "arguments", "tool_calls", "tool_call_id", "json_schema",
                                       "schema", "include_usage"]) | ANY_TEXT, children, max_size=4),
    max_leaves=20,
)
FIELDS = st.sampled_from(sorted(ChatCompletionBody.model_fields) + ["foo"]) | ANY_TEXT


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(FIELDS, JSON_VALUES, max_size=6), st.booleans())
def test_any_body_gives_a_request_or_a_sendable_error(fields, with_base):
    obj = ({"model": MODEL, "messages": [USER]} if with_base else {}) | fields
    raw = json.dumps(obj).encode()  # ensure_ascii: lone surrogates travel as \\udXXX escapes
    try:
        req = parse_chat_request(raw, served_model=MODEL, max_body_bytes=LIMIT)
    except APIError as err:
        assert err.status in (400, 404)
        json.dumps(err.envelope(), ensure_ascii=False).encode("utf-8")  # param included
    else:
        # what reaches the worker and the templates is valid Unicode and in the worker's ranges
        json.dumps([req.messages, req.tools, req.stop, req.chat_template_kwargs],
                   ensure_ascii=False).encode("utf-8")
        assert req.seed is None or 0 <= req.seed < 2**32 - 1
        assert 0 <= req.top_k < 2**31 and 0 < req.top_p <= 1 and 0 <= req.temperature <= 2


# --- reasoning_effort (profiles branch: accepted and validated; the serving layer decides) ---


@pytest.mark.parametrize("effort", ["none", "minimal", "low", "medium", "high", "xhigh"])
def test_reasoning_effort_values_are_accepted(effort):
    assert parse(body(reasoning_effort=effort)).reasoning_effort == effort
    assert parse(body()).reasoning_effort is None


@pytest.mark.parametrize("effort", ["max", "", 3])
def test_reasoning_effort_other_values_are_invalid(effort):
    assert_error(error(body(reasoning_effort=effort)), 400, "invalid_value", "reasoning_effort")
