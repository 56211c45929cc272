"""sessions: none in v1.0 — reserved for a later version (§12). Checks that nothing session-shaped
is half-supported: no endpoints, the body key is rejected, session headers are harmless."""

from __future__ import annotations

import pytest

from conformance._support import check_completion, check_error, chat_body, json_of, post_chat

pytestmark = pytest.mark.sessions


@pytest.mark.spec("§12")
@pytest.mark.parametrize("method,path", [("DELETE", "/v1/sessions/conf-1"), ("POST", "/v1/sessions/conf-1/reset")])
def test_no_session_endpoints(root, cfg, method, path):
    """/v1/sessions/… does not exist in v1.0: 404 not_found with the envelope."""
    check_error(root.request(method, path), 404, "not_found", None)


@pytest.mark.spec("§12")
def test_session_id_body_rejected(client, cfg):
    """A session_id body key is an unknown parameter: 400 unsupported_parameter."""
    check_error(post_chat(client, chat_body(cfg, max_tokens=4, session_id="conf-1")), 400, "unsupported_parameter", "session_id")


@pytest.mark.spec("§12")
def test_session_headers_ignored(client, cfg):
    """Session headers are ignored: the request succeeds normally."""
    hdrs = {"X-Session-ID": "conf-1", "session_id": "conf-1", "x-session-affinity": "conf-1"}
    r = post_chat(client, chat_body(cfg, max_tokens=4), headers=hdrs)
    data = json_of(r)
    assert r.status_code == 200, f"HTTP {r.status_code}: {data!r}"
    check_completion(data, cfg)
