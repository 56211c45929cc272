"""errors: envelope (§3), validation order (§4), invalid values (§5.4), context (§9.1), limits (§15),
routes and health (§2, §13)."""

from __future__ import annotations

import json

import pytest

from conformance._support import check_error, chat_body, json_of, post_chat, stream_chat

pytestmark = pytest.mark.errors

BIG_PROMPT = "word " * 40_000  # far beyond any small context, well under the 4 MiB body limit


@pytest.mark.spec("§3")
@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"", b"[]", b'"a string"', b"\xff\xfe{}", b'{"model": "x", "messages": [}'],
    ids=["garbage", "empty", "array", "string", "not-utf8", "truncated"],
)
def test_malformed_body(client, cfg, raw):
    """A body that is not a JSON object is 400 invalid_json with param null."""
    r = post_chat(client, raw)
    check_error(r, 400, "invalid_json", None)


INVALID = [
    # (patch applied to a valid body, expected param, expected code)
    ({"temperature": 3}, "temperature", "invalid_value"),
    ({"temperature": -0.5}, "temperature", "invalid_value"),
    ({"temperature": "hot"}, "temperature", "invalid_value"),
    ({"temperature": True}, "temperature", "invalid_value"),
    ({"top_p": 0}, "top_p", "invalid_value"),
    ({"top_p": 1.5}, "top_p", "invalid_value"),
    ({"top_k": -1}, "top_k", "invalid_value"),
    ({"top_k": 2.5}, "top_k", "invalid_value"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"max_tokens": -5}, "max_tokens", "invalid_value"),
    ({"max_tokens": "ten"}, "max_tokens", "invalid_value"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    ({"seed": "abc"}, "seed", "invalid_value"),
    ({"seed": 1.5}, "seed", "invalid_value"),
    ({"stop": 5}, "stop", "invalid_value"),
    ({"stop": [1, 2]}, "stop*", "invalid_value"),  # "stop" or the element's path "stop[0]"
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "invalid_value"),
    ({"stream": "maybe"}, "stream", "invalid_value"),
    ({"stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage", "invalid_value"),
    ({"messages": []}, "messages", "invalid_value"),
    ({"messages": "hi"}, "messages", "invalid_value"),
    ({"messages": None}, "messages", "missing_required_parameter"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "missing_required_parameter"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     "messages[0].content[0]", "invalid_value"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0]", "invalid_value"),
    ({"model": 5}, "model", "invalid_value"),
    ({"tools": "get_weather"}, "tools", "invalid_value"),
    ({"tool_choice": "sometimes"}, "tool_choice", "invalid_value"),
]


@pytest.mark.spec("§5.4")
@pytest.mark.parametrize("patch,param,code", INVALID, ids=[f"{p}-{i}" for i, (_, p, _c) in enumerate(INVALID)])
def test_invalid_value(client, cfg, patch, param, code):
    """A wrong type or bad value is 400 with the §5.4 code and the parameter's path (never 422)."""
    body = chat_body(cfg, max_tokens=4)
    body.update(patch)  # {"messages": None} sends an explicit null
    r = post_chat(client, body)
    if param.startswith("messages[0].content["):
        check_error(r, 400, code, param_prefix="messages[0].content")
    elif param.endswith("*"):
        check_error(r, 400, code, param_prefix=param[:-1])
    else:
        check_error(r, 400, code, param)


@pytest.mark.spec("§3")
@pytest.mark.parametrize("field", ["model", "messages"])
def test_missing_required(client, cfg, field):
    """An absent model or messages is 400 missing_required_parameter naming it."""
    body = chat_body(cfg, max_tokens=4)
    del body[field]
    check_error(post_chat(client, body), 400, "missing_required_parameter", field)


@pytest.mark.spec("§3")
def test_unknown_model(client, cfg):
    """An unknown model is 404 model_not_found, param model."""
    body = chat_body(cfg, max_tokens=4)
    body["model"] = "no-such-model-conformance"
    check_error(post_chat(client, body), 404, "model_not_found", "model")


@pytest.mark.spec("§3")
def test_unknown_model_openai_sdk(sdk, cfg):
    """Through the openai SDK an unknown model raises NotFoundError."""
    import openai

    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="no-such-model-conformance", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


@pytest.mark.spec("§4")
def test_order_invalid_before_unsupported(client, cfg):
    """invalid_value wins over unsupported_parameter."""
    check_error(post_chat(client, chat_body(cfg, temperature=5, n=2)), 400, "invalid_value", "temperature")


@pytest.mark.spec("§4")
def test_order_unsupported_before_model(client, cfg):
    """unsupported_parameter wins over model_not_found."""
    body = chat_body(cfg, logprobs=True)
    body["model"] = "no-such-model-conformance"
    check_error(post_chat(client, body), 400, "unsupported_parameter", "logprobs")


@pytest.mark.spec("§4")
def test_order_model_before_context(client, cfg):
    """model_not_found wins over context_length_exceeded."""
    body = chat_body(cfg, BIG_PROMPT)
    body["model"] = "no-such-model-conformance"
    check_error(post_chat(client, body), 404, "model_not_found", "model")


@pytest.mark.spec("§9.1")
def test_context_overflow_nonstream(client, cfg):
    """A prompt far beyond the context is 400 context_length_exceeded (never truncated)."""
    check_error(post_chat(client, chat_body(cfg, BIG_PROMPT, max_tokens=4)), 400, "context_length_exceeded", "messages")


@pytest.mark.spec("§9.1")
def test_context_overflow_stream_before_any_bytes(client, cfg):
    """Streamed, the overflow is still a plain JSON 400 — no SSE byte is sent."""
    st = stream_chat(client, chat_body(cfg, BIG_PROMPT, max_tokens=4))
    assert not st.events, f"the stream started (HTTP {st.status}) before the context check: {st.events[:2]!r}"
    check_error(st, 400, "context_length_exceeded", "messages")


@pytest.mark.spec("§15")
def test_body_limit(client, cfg):
    """A body over 4 MiB is 413 request_too_large."""
    raw = json.dumps(chat_body(cfg, "x" * (5 * 1024 * 1024), max_tokens=4)).encode()
    try:
        r = post_chat(client, raw)
    except Exception as e:  # a server may answer and close before reading the whole upload
        pytest.fail(f"no HTTP answer to a 5 MiB body: {type(e).__name__}: {e}")
    check_error(r, 413, "request_too_large", None)


@pytest.mark.spec("§2")
def test_unknown_route(root, cfg):
    """An unknown route is 404 not_found with the JSON envelope."""
    check_error(root.get("/v1/no-such-route"), 404, "not_found", None)


@pytest.mark.spec("§2")
def test_one_v1_too_many_names_the_route(client, cfg):
    """A route with one /v1 too many (/v1/v1/chat/completions) is 404 not_found naming the route."""
    r = client.post("/v1/chat/completions", json={"model": cfg.model, "messages": []})
    error = check_error(r, 404, "not_found", None)
    assert "'/v1/chat/completions'" in error["message"], error


@pytest.mark.spec("§2")
def test_wrong_method(client, cfg):
    """GET on /v1/chat/completions is 405 method_not_allowed with the JSON envelope."""
    check_error(client.get("/chat/completions"), 405, "method_not_allowed", None)


@pytest.mark.spec("§13")
def test_health_ready(root, cfg):
    """GET /health of a serving server is 200 {"status": "ready"}."""
    r = root.get("/health", timeout=5.0)
    data = json_of(r)
    assert r.status_code == 200 and data.get("status") == "ready", f"HTTP {r.status_code}: {data!r}"


@pytest.mark.spec("§3")
def test_invalid_value_openai_sdk(sdk, cfg):
    """Through the openai SDK a bad temperature raises BadRequestError with code invalid_value."""
    import openai

    with pytest.raises(openai.BadRequestError) as ei:
        sdk.chat.completions.create(model=cfg.model, messages=[{"role": "user", "content": "hi"}], temperature=9, max_tokens=4)
    body = ei.value.body
    assert isinstance(body, dict) and body.get("code") == "invalid_value" and body.get("param") == "temperature", f"{body!r}"
