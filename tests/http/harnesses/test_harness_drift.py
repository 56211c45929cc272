"""What agent harnesses send as they drift between releases, over real sockets on the fake
worker (spec §2, §4.1).

* Unknown keys inside conversation items (harness metadata) are served: 200, the JSON or the
  stream as for the same request without them, and the ``x-trioserve-ignored-fields`` header
  naming each (Chat, Messages; Responses in test_codex.py with Codex's own request). The
  bounds on a body hold for them too: an ignored field holding more JSON objects than a body
  may is still ``413``.
* An unknown top-level parameter is still ``400 unsupported_parameter`` on every API.
* A base URL with one ``/v1`` too many (Claude Code with ``ANTHROPIC_BASE_URL=…/v1`` asks for
  ``/v1/v1/messages``): ``404 not_found`` whose message names the route to use, in the
  envelope of that route's API.
"""

from __future__ import annotations

import json

import pytest

from trioserve import limits

from ..conftest import chat_body, live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

HEADER = "x-trioserve-ignored-fields"

CHAT_MESSAGES = [
    {"role": "system", "content": "Be brief.", "x_harness": {"id": 1}},
    {"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]},
]
CHAT_IGNORED = "messages[0].x_harness, messages[1].content[0].cache_control"

MESSAGES_BODY = {
    "model": "fake", "max_tokens": 20,
    "system": [{"type": "text", "text": "Be brief.", "x_harness": 1}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "citations": []}],
                  "x_turn": "t1"}],
}
MESSAGES_IGNORED = "system[0].x_harness, messages[0].x_turn, messages[0].content[0].citations"


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_serves_messages_with_unknown_keys_and_names_them(tmp_path, stream):
    async with live_server(tmp_path, script=["Hello!"] * 2) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": CHAT_MESSAGES, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None})
        assert resp.status_code == 200, resp.text
        assert resp.headers[HEADER] == CHAT_IGNORED
        if stream:
            events = parse_sse(resp.content)
            text = "".join(e["choices"][0]["delta"].get("content") or ""
                           for e in events[:-1] if e["choices"])
            usage = events[-2]["usage"]
        else:
            text = resp.json()["choices"][0]["message"]["content"]
            usage = resp.json()["usage"]
        assert text == "Hello!"
        # The same conversation without the keys: the same prompt (the fake's tokens are bytes).
        plain = await client.post("/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
        assert plain.status_code == 200 and HEADER not in plain.headers
        assert plain.json()["usage"]["prompt_tokens"] == usage["prompt_tokens"]


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_serves_blocks_with_unknown_keys_and_names_them(tmp_path, stream):
    async with live_server(tmp_path, script=["Hello!"] * 2) as srv, srv.client() as client:
        resp = await client.post("/v1/messages", json={**MESSAGES_BODY, "stream": stream},
                                 headers={"x-api-key": "x", "anthropic-version": "2023-06-01"})
        assert resp.status_code == 200, resp.text
        assert resp.headers[HEADER] == MESSAGES_IGNORED
        if stream:
            blocks = [block for block in resp.text.split("\n\n") if block.startswith("event:")]
            data = [json.loads(block.split("\ndata: ", 1)[1]) for block in blocks]
            text = "".join(d["delta"].get("text", "") for d in data if d["type"] == "content_block_delta")
            assert data[-1]["type"] == "message_stop"
        else:
            text = resp.json()["content"][0]["text"]
        assert text == "Hello!"
        plain = await client.post("/v1/messages", json={
            "model": "fake", "max_tokens": 20, "system": "Be brief.",
            "messages": [{"role": "user", "content": "hi"}]})
        assert plain.status_code == 200 and HEADER not in plain.headers


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", chat_body(internal_metadata={})),
    ("/v1/responses", {"model": "fake", "input": "hi", "internal_metadata": {}}),
    ("/v1/messages", {**MESSAGES_BODY, "internal_metadata": {}}),
])
async def test_an_unknown_top_level_parameter_is_still_refused(tmp_path, path, body):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post(path, json=body)
        assert resp.status_code == 400, resp.text
        if path == "/v1/messages":
            error = resp.json()["error"]
            assert error["type"] == "invalid_request_error" and "'internal_metadata'" in error["message"]
        else:
            error = resp.json()["error"]
            assert (error["code"], error["param"]) == ("unsupported_parameter", "internal_metadata")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "fake", "messages": [
        {"role": "user", "content": "hi", "x_harness": [{}] * (limits.MAX_BODY_OBJECTS + 1)}]}),
    ("/v1/responses", {"model": "fake", "input": [
        {"role": "user", "content": "hi", "x_harness": [{}] * (limits.MAX_BODY_OBJECTS + 1)}]}),
    ("/v1/messages", {"model": "fake", "max_tokens": 4, "messages": [
        {"role": "user", "content": "hi", "x_harness": [{}] * (limits.MAX_BODY_OBJECTS + 1)}]}),
])
async def test_ignored_fields_count_toward_the_body_bounds(tmp_path, path, body):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post(path, json=body)
        assert resp.status_code == 413, resp.text[:300]
        assert f"at most {limits.MAX_BODY_OBJECTS}" in resp.text


@pytest.mark.parametrize("method, path, route, anthropic_envelope", [
    ("POST", "/v1/v1/messages?beta=true", "/v1/messages", True),
    ("POST", "/v1/v1/messages/count_tokens", "/v1/messages/count_tokens", True),
    ("POST", "/v1/v1/chat/completions", "/v1/chat/completions", False),
    ("POST", "/v1/v1/responses", "/v1/responses", False),
    ("GET", "/v1/v1/models", "/v1/models", False),
])
async def test_one_v1_too_many_is_a_404_naming_the_route(tmp_path, method, path, route,
                                                         anthropic_envelope):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.request(method, path, json=MESSAGES_BODY if method == "POST" else None)
        assert resp.status_code == 404, resp.text
        assert resp.headers["content-type"] == "application/json"
        body = resp.json()
        if anthropic_envelope:
            assert body["type"] == "error" and body["error"]["type"] == "not_found_error"
            message = body["error"]["message"]
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert (body["error"]["code"], body["error"]["param"]) == ("not_found", None)
            message = body["error"]["message"]
        assert "one '/v1' too many" in message and f"the route is '{route}'" in message
        # The route it names answers.
        answer = await client.request(method, route, json=MESSAGES_BODY if method == "POST" else None)
        assert answer.status_code != 404, answer.text


@pytest.mark.parametrize("path", ["/v1/v1/nothing", "/v1/v1//messages", "/v1/v1", "/v2/v1/messages"])
async def test_other_unknown_paths_keep_the_plain_404(tmp_path, path):
    async with live_server(tmp_path, script=["x"]) as srv, srv.client() as client:
        resp = await client.post(path, json=MESSAGES_BODY)
        assert resp.status_code == 404, resp.text
        error = resp.json()["error"]
        assert error["code"] == "not_found" and "too many" not in error["message"]
