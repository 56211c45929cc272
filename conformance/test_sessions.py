"""sessions: keyed sessions (§12, v1.2). The key's precedence and validation, a follow-up turn in a
session reporting its reused prompt as ``cached_tokens`` (§8), and ``DELETE /v1/sessions/{key}``."""

from __future__ import annotations

import uuid

import pytest

from conformance._support import check_completion, check_error, chat_body, json_of, post_chat

pytestmark = pytest.mark.sessions


def _key() -> str:
    return "conf-" + uuid.uuid4().hex


@pytest.mark.spec("§12")
def test_delete_unknown_session_is_404(root, cfg):
    """DELETE of a session the server does not hold: 404 session_not_found with the envelope."""
    check_error(root.request("DELETE", "/v1/sessions/" + _key()), 404, "session_not_found", "session")


@pytest.mark.spec("§12")
def test_no_other_session_methods(root, cfg):
    """Only DELETE exists under /v1/sessions/: another method is 405 method_not_allowed."""
    check_error(root.request("POST", "/v1/sessions/conf-1/reset"), 405, "method_not_allowed", None)


@pytest.mark.spec("§12")
@pytest.mark.parametrize("where", ["prompt_cache_key", "session_id", "x-session-affinity", "x-session-id"])
def test_session_key_sources_open_a_session_that_delete_frees(client, root, cfg, where):
    """Each key source names a session; DELETE frees it (204), a second DELETE is 404."""
    key = _key()
    body = chat_body(cfg, max_tokens=4, **({where: key} if not where.startswith("x-") else {}))
    headers = {where: key} if where.startswith("x-") else {}
    r = post_chat(client, body, headers=headers)
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)
    assert root.request("DELETE", "/v1/sessions/" + key).status_code == 204
    check_error(root.request("DELETE", "/v1/sessions/" + key), 404, "session_not_found", "session")


@pytest.mark.spec("§12")
@pytest.mark.parametrize("value", ["", "k" * 257, "a\u0001b"])
def test_bad_session_key_is_invalid_value(client, cfg, value):
    """An empty, over-long (> 256 characters) or control-character key: 400 invalid_value."""
    check_error(post_chat(client, chat_body(cfg, max_tokens=4, prompt_cache_key=value)), 400, "invalid_value",
                "prompt_cache_key")


@pytest.mark.spec("§12")
def test_follow_up_turn_reports_cached_tokens(client, root, cfg):
    """A second turn in the same session that extends the first reports its reused prefix in
    usage.prompt_tokens_details.cached_tokens (at least the first turn's prompt)."""
    key = _key()
    messages = [{"role": "user", "content": "Say hello."}]
    first = json_of(post_chat(client, {"model": cfg.model, "messages": messages, "max_tokens": 8,
                                       "prompt_cache_key": key}))
    reply = first["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again."}]
    second = json_of(post_chat(client, {"model": cfg.model, "messages": messages, "max_tokens": 8,
                                        "prompt_cache_key": key}))
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and first["usage"]["prompt_tokens"] - 1 <= cached < second["usage"]["prompt_tokens"]
    root.request("DELETE", "/v1/sessions/" + key)
