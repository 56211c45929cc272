"""strict: parameters the contract rejects (§5.3) and parameters it accepts and ignores (§5.2).

A server that silently ignores a rejected parameter fails that point.
"""

from __future__ import annotations

from collections import Counter

import pytest

from conformance._support import (
    check_completion,
    check_error,
    chat_body,
    diff,
    expected_multiset,
    json_of,
    post_chat,
)

pytestmark = pytest.mark.strict

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

REJECTED = [
    ("n", {"n": 2}),
    ("logprobs", {"logprobs": True}),
    ("top_logprobs", {"top_logprobs": 2}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
    ("presence_penalty", {"presence_penalty": 0.5}),
    # response_format: json_object / json_schema and forced tool_choice are the structured
    # area (§5.6); an unknown type is malformed, not unsupported (test below).
    ("functions", {"functions": [TOOL["function"]]}),
    ("foo_bar", {"foo_bar": 1}),
]


@pytest.mark.spec("§5.3")
@pytest.mark.parametrize("param,extra", REJECTED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(REJECTED)])
def test_unsupported_parameter_rejected(client, cfg, param, extra):
    """An unsupported parameter is 400 unsupported_parameter naming it (never silently ignored)."""
    r = post_chat(client, chat_body(cfg, max_tokens=4, **extra))
    err = check_error(r, 400, "unsupported_parameter", param)
    assert param in err["message"], f"message does not name {param!r}: {err['message']!r}"


@pytest.mark.spec("§5.1")
@pytest.mark.parametrize("bias", [{"1": 101}, {"x": 1}, {"1": "5"}], ids=["101", "key", "string"])
def test_malformed_logit_bias_is_invalid(client, cfg, bias):
    """A malformed logit_bias (OpenAI: ids as digit strings, biases in [-100, 100]) is 400 at logit_bias."""
    r = post_chat(client, chat_body(cfg, max_tokens=4, logit_bias=bias))
    check_error(r, 400, "invalid_value", "logit_bias")


@pytest.mark.spec("§5.4")
def test_unknown_response_format_type_is_invalid(client, cfg):
    """response_format with an unknown type is 400 invalid_value at response_format.type (never ignored)."""
    r = post_chat(client, chat_body(cfg, max_tokens=4, response_format={"type": "xml"}))
    check_error(r, 400, "invalid_value", "response_format.type")


def _capabilities(client, cfg) -> dict:
    """The served model's ``capabilities`` from ``GET /v1/models`` (§2); ``{}`` when the
    server publishes none."""
    r = client.get("/models")
    try:
        entry = next(m for m in r.json()["data"] if m.get("id") == cfg.model)
    except (ValueError, KeyError, TypeError, StopIteration):
        return {}
    caps = entry.get("capabilities")
    return caps if isinstance(caps, dict) else {}


@pytest.mark.spec("§5.3")
def test_reasoning_effort_rejected_unless_the_model_has_a_thinking_switch(client, cfg):
    """reasoning_effort is 400 unsupported_parameter unless GET /v1/models says capabilities.reasoning_effort is true (then 200)."""
    honoured = _capabilities(client, cfg).get("reasoning_effort") is True
    r = post_chat(client, chat_body(cfg, max_tokens=4, reasoning_effort="low"))
    if honoured:
        data = json_of(r)
        assert r.status_code == 200, f"capabilities.reasoning_effort is true, got HTTP {r.status_code}: {data!r}"
        check_completion(data, cfg)
        return
    # Not advertised (false, or no capabilities at all): the parameter must not be ignored.
    err = check_error(r, 400, "unsupported_parameter", "reasoning_effort")
    assert "reasoning_effort" in err["message"], f"message does not name it: {err['message']!r}"


@pytest.mark.spec("§5.3")
def test_unsupported_parameters_all_named(client, cfg):
    """Several unsupported parameters: one 400 whose message names every one of them."""
    r = post_chat(client, chat_body(cfg, max_tokens=4, n=3, logprobs=True, foo_bar=1, presence_penalty=1.0))
    err = check_error(r, 400, "unsupported_parameter")
    assert err["param"] in ("n", "logprobs", "foo_bar", "presence_penalty"), f"param = {err['param']!r}"
    for p in ("n", "logprobs", "foo_bar", "presence_penalty"):
        assert p in err["message"], f"message does not name {p!r}: {err['message']!r}"


@pytest.mark.spec("§5.3")
def test_unsupported_parameter_openai_sdk(sdk, cfg):
    """Through the openai SDK an unsupported parameter raises BadRequestError with the code."""
    import openai

    with pytest.raises(openai.BadRequestError) as ei:
        sdk.chat.completions.create(
            model=cfg.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True
        )
    body = ei.value.body
    code = body.get("code") if isinstance(body, dict) else None
    assert code == "unsupported_parameter", f"error body {body!r}"


IGNORED = [
    {"user": "conformance"},
    {"store": False},
    {"metadata": {"k": "v"}},
    {"service_tier": "auto"},
    {"prompt_cache_key": "k"},
    {"safety_identifier": "s"},
    {"prediction": None},
    {"n": 1},
    {"logprobs": False},
    {"top_logprobs": None},
    {"frequency_penalty": 0},
    {"presence_penalty": 0.0},
    {"logit_bias": {}},
    {"response_format": {"type": "text"}},
    {"modalities": ["text"]},
    {"tools": [TOOL], "parallel_tool_calls": True},
    {"reasoning_effort": None},
    {"stream": True, "stream_options": {"include_usage": False, "x_unknown": 1}},
]


def _ids(d):
    return "+".join(sorted(d))


@pytest.mark.spec("§5.2")
@pytest.mark.parametrize("extra", IGNORED, ids=[_ids(d) for d in IGNORED])
def test_ignored_parameter_accepted(client, cfg, extra):
    """A parameter the contract accepts and ignores gives 200."""
    if extra.get("stream"):
        with client.stream("POST", "/chat/completions", json=chat_body(cfg, max_tokens=4, **extra)) as r:
            text = r.read()
            assert r.status_code == 200, f"HTTP {r.status_code}: {text[:300]!r}"
        return
    r = post_chat(client, chat_body(cfg, max_tokens=4, **extra))
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)


ALL_IGNORED = {
    "user": "u", "store": False, "metadata": {"k": "v"}, "n": 1, "logprobs": False,
    "frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
    "modalities": ["text"], "prediction": None, "top_logprobs": None,
}


@pytest.mark.spec("§5.2")
def test_ignored_parameters_do_not_change_output(client, cfg):
    """The accepted-and-ignored parameters, all at once, leave the (greedy) output unchanged."""
    if cfg.scripted:
        got = Counter()
        for _ in cfg.script:
            r = post_chat(client, chat_body(cfg, max_tokens=200, **ALL_IGNORED))
            data = json_of(r)
            assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
            ch = check_completion(data, cfg)
            got[(ch["message"]["content"], ch["finish_reason"])] += 1
        want = expected_multiset(cfg.script, max_tokens=200)
        assert got == want, diff(got, want)
        return
    outs = []
    for extra in ({}, ALL_IGNORED):
        r = post_chat(client, chat_body(cfg, "Name three colors.", temperature=0, max_tokens=16, **extra))
        data = json_of(r)
        assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
        outs.append(check_completion(data, cfg)["message"]["content"])
    assert outs[0] == outs[1], f"ignored parameters changed the output: {outs[0]!r} vs {outs[1]!r}"
