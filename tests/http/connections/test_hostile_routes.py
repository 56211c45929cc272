"""Hostile requests that used to slip past the guards, over real sockets (spec §2, §3, §17, §20).

* A WebSocket handshake on every route, with a bad Host, without and with the API key
  (``x-api-key`` on Messages): the Host check, then the key check, then ``426
  websocket_not_supported``, each a JSON error the client reads at once with an
  ``x-request-id``; one access-log line per handshake and nothing at WARNING or above. A
  handshake hypercorn finds invalid itself gets the envelope too. Over HTTP/1.1 and h2c
  (an RFC 8441 extended CONNECT).
* ``//`` in a path and a trailing slash: ``404`` with the envelope, never a redirect with HTML.
* The response store counts every string it keeps (a 4 MB ``call_id`` included).
* Body shapes that skipped the early refusal (template kwargs ``{}``, ``reasoning: {}``,
  100k system messages or system blocks, Messages with ``thinking: disabled``, and every
  shape of ``/v1/messages/count_tokens``): refused before any per-message work (by the turn
  bound or the bound on items or objects).
* Responses input items held to Chat's rules: deep and non-Unicode ``function_call.arguments``
  are 400s naming the client's own field (unknown keys inside items are harness metadata,
  ignored and reported: spec §4.1, test_item_fields.py and test_codex.py).

After each: a normal request is served by the same worker (pid, no restart), and the
``no_leaks`` fixture checks the file descriptors.
"""

from __future__ import annotations

import json
import logging

import h2.config
import h2.connection
import h2.events
import pytest
import trio

from trioserve import limits
from trioserve.api.responses.adapter import ResponseStore
from trioserve.core.request import Message, ToolCallPart

from ..conftest import chat_body, live_server
from ..rawhttp import RawResponse, build_request, exchange

pytestmark = pytest.mark.usefixtures("no_leaks")

WS_HANDSHAKE = [("Upgrade", "websocket"), ("Connection", "Upgrade, close"),
                ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="), ("Sec-WebSocket-Version", "13")]
ROUTES = ["/v1/responses", "/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens",
          "/v1/completions", "/tokenize", "/detokenize", "/v1/models", "/health", "/metrics",
          "/v1/sessions/abc", "/no/such/route", "/v1//models"]


async def websocket(port: int, path: str, *extra: tuple[str, str], host: str | None = None,
                    handshake: list[tuple[str, str]] = WS_HANDSHAKE) -> RawResponse:
    headers = [("Host", host or f"127.0.0.1:{port}"), *handshake, *extra]
    return await exchange(port, build_request("GET", path, headers=headers), timeout=10)


def error_of(resp: RawResponse, path: str) -> dict:
    """The error object of a JSON error response in the API's own envelope."""
    assert resp.headers["content-type"].startswith("application/json"), resp
    assert resp.headers["x-request-id"].startswith("req-"), resp.headers
    body = resp.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    else:
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


async def assert_same_worker_serves(srv, pid: int) -> None:
    async with srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
    assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


def quiet_except_access(caplog) -> list[logging.LogRecord]:
    """The access lines; asserts nothing else reached WARNING."""
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not loud, [r.getMessage()[:300] for r in loud]
    return [r for r in caplog.records if r.name == "trioserve.access"]


async def test_websocket_upgrades_are_refused_on_every_route_with_a_json_426(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        for path in ROUTES:
            resp = await websocket(srv.port, path)
            assert resp.status == 426, (path, resp)
            error = error_of(resp, path)
            if not path.startswith("/v1/messages"):
                assert error["code"] == "websocket_not_supported", error
            assert "plain HTTP" in error["message"]
        access = quiet_except_access(caplog)
        assert len(access) == len(ROUTES)
        assert all('"WEBSOCKET ' in r.getMessage() and " 426 " in r.getMessage() for r in access)
        await assert_same_worker_serves(srv, pid)


async def test_websocket_upgrades_pass_the_host_check_first(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        for path in ("/v1/responses", "/v1/messages", "/health"):
            resp = await websocket(srv.port, path, host="evil.example")
            assert resp.status == 421, resp
            assert resp.json()["error"]["code"] == "host_not_allowed"
            assert resp.headers["x-request-id"].startswith("req-")
            resp = await websocket(srv.port, path, host="a b")
            assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_host", resp
        quiet_except_access(caplog)
        await assert_same_worker_serves(srv, pid)


async def test_websocket_upgrades_pass_the_api_key_check_first(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")
    async with live_server(tmp_path, script=["ok"], api_key="s3cret") as srv:
        pid = srv.pool.worker_pid
        for path in ROUTES:
            resp = await websocket(srv.port, path)
            if path == "/health":  # public, as for HTTP
                assert resp.status == 426, resp
                continue
            assert resp.status == 401, (path, resp)
            assert resp.headers["www-authenticate"] == "Bearer"
            error_of(resp, path)
            wrong = await websocket(srv.port, path, ("Authorization", "Bearer nope"))
            assert wrong.status == 401, (path, wrong)
            good = await websocket(srv.port, path, ("Authorization", "Bearer s3cret"))
            assert good.status == 426, (path, good)
        # Anthropic clients send the key as x-api-key.
        resp = await websocket(srv.port, "/v1/messages", ("x-api-key", "s3cret"))
        assert resp.status == 426 and resp.json()["type"] == "error", resp
        quiet_except_access(caplog)
        async with srv.client(headers={"Authorization": "Bearer s3cret"}) as client:
            resp = await client.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 200, resp.text
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_an_invalid_websocket_handshake_gets_the_envelope(tmp_path, caplog):
    """No Sec-WebSocket-Key: hypercorn refuses the handshake before the app runs."""
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        handshake = [("Upgrade", "websocket"), ("Connection", "Upgrade, close")]
        resp = await websocket(srv.port, "/v1/responses", handshake=handshake)
        assert resp.status == 400, resp
        assert resp.headers["content-type"] == "application/json"
        assert resp.json()["error"]["code"] == "invalid_http_request"
        quiet_except_access(caplog)
        await assert_same_worker_serves(srv, pid)


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1//models"), ("POST", "/v1//chat/completions"), ("GET", "//health"),
    ("POST", "/v1//responses"), ("POST", "/v1/messages//count_tokens"), ("GET", "/v1/models/"),
    ("POST", "/v1/chat/completions/"), ("DELETE", "/v1//sessions/abc"),
])
async def test_doubled_and_trailing_slashes_are_404_json(tmp_path, method, path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        headers = [("Host", f"127.0.0.1:{srv.port}"), ("Connection", "close"),
                   ("Content-Type", "application/json")]
        body = json.dumps(chat_body()).encode() if method == "POST" else b""
        resp = await exchange(srv.port, build_request(method, path, headers=headers, body=body))
        assert resp.status == 404, resp
        assert "location" not in resp.headers
        error = error_of(resp, path)
        assert error.get("code", "not_found") == "not_found"  # (Anthropic's shape has none)
        await assert_same_worker_serves(srv, pid)


def test_the_store_counts_every_string_it_keeps():
    """540 stored responses each holding a 4 MB call id: the store stays within its bound
    (the count covers ids, so 64 Mi characters hold about 16 of them)."""
    store = ResponseStore()
    call_id = "c" * (4 << 20)
    for i in range(540):
        conversation = (Message("user", "hi"),
                        Message("assistant", "", tool_calls=(ToolCallPart(call_id, "f", {}),)),
                        Message("tool", "done", tool_call_id=call_id))
        store.put(f"resp_{i:032x}", conversation)
        assert store.chars <= store.max_chars
    assert 0 < len(store) <= store.max_chars // (8 << 20)
    assert store.get(f"resp_{539:032x}") is not None and store.get(f"resp_{0:032x}") is None


async def test_stored_responses_with_huge_call_ids_stay_within_the_store_bound(tmp_path):
    """Over HTTP, with a small store (4 Mi characters) and 256 Ki-character call ids."""
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        store = ResponseStore(max_chars=4 << 20)
        srv.quart_app.services.default.responses.store = store
        call_id = "k" * (256 << 10)
        for i in range(12):
            body = {"model": "fake", "max_output_tokens": 2, "store": True, "input": [
                {"role": "user", "content": f"turn {i}"},
                {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": call_id, "output": "ok"}]}
            resp = await client.post("/v1/responses", json=body)
            assert resp.status_code == 200, resp.text[:300]
            assert store.chars <= store.max_chars
        # Each stored response keeps the two 256 Ki-character ids twice: in its conversation
        # and in its input items (GET /v1/responses/{id}/input_items): over 1 Mi characters.
        assert 0 < len(store) <= 3
        await assert_same_worker_serves(srv, pid)


MANY = 110_000


def _many(role: str = "user", count: int = MANY) -> list[dict]:
    return [{"role": role, "content": ""}] * count


BYPASS_SHAPES = {
    "chat + chat_template_kwargs {}": ("/v1/chat/completions", {
        "model": "fake", "max_tokens": 4, "messages": _many(), "chat_template_kwargs": {}}),
    "chat, system messages": ("/v1/chat/completions", {
        "model": "fake", "max_tokens": 4, "messages": _many("system", 100_000) + _many(count=1)}),
    "chat + chat_template_kwargs": ("/v1/chat/completions", {
        "model": "fake", "max_tokens": 4, "messages": _many(), "chat_template_kwargs": {"x": 1}}),
    "messages + thinking disabled": ("/v1/messages", {
        "model": "fake", "max_tokens": 4, "messages": _many(), "thinking": {"type": "disabled"}}),
    "messages, system blocks": ("/v1/messages", {
        "model": "fake", "max_tokens": 4, "messages": _many(count=1),
        "system": [{"type": "text", "text": ""}] * 100_000}),
    "responses + reasoning {}": ("/v1/responses", {
        "model": "fake", "max_output_tokens": 4, "input": _many(), "reasoning": {}}),
    "responses + reasoning.effort": ("/v1/responses", {
        "model": "fake", "max_output_tokens": 4, "input": _many(), "reasoning": {"effort": "low"}}),
    "responses, developer items": ("/v1/responses", {
        "model": "fake", "max_output_tokens": 4, "input": _many("developer", 100_000)}),
    # One message of 110,000 parts; 50,000 tools: the bound on objects.
    "chat, content parts": ("/v1/chat/completions", {
        "model": "fake", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * MANY}]}),
    "messages, content blocks": ("/v1/messages", {
        "model": "fake", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * MANY}]}),
    "responses, content parts": ("/v1/responses", {
        "model": "fake", "max_output_tokens": 4,
        "input": [{"role": "user", "content": [{"type": "input_text", "text": ""}] * MANY}]}),
    "chat, tools": ("/v1/chat/completions", {
        "model": "fake", "max_tokens": 4, "messages": _many(count=1),
        "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(50_000)]}),
    # Token counts take the same bounds as generation (110k messages were counted, seconds of
    # worker time each): items, system blocks, content blocks.
    "count_tokens": ("/v1/messages/count_tokens", {"model": "fake", "messages": _many()}),
    "count_tokens + thinking disabled": ("/v1/messages/count_tokens", {
        "model": "fake", "messages": _many(), "thinking": {"type": "disabled"}}),
    "count_tokens, system blocks": ("/v1/messages/count_tokens", {
        "model": "fake", "messages": _many(count=1),
        "system": [{"type": "text", "text": ""}] * 100_000}),
    "count_tokens, content blocks": ("/v1/messages/count_tokens", {
        "model": "fake",
        "messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * MANY}]}),
}


@pytest.mark.parametrize("shape", list(BYPASS_SHAPES))
async def test_every_body_shape_is_refused_before_per_message_work(tmp_path, shape):
    path, body = BYPASS_SHAPES[shape]
    async with live_server(tmp_path, script=["ok"], max_body_bytes=8 << 20) as srv, \
            srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        resp = await client.post(path, json=body)
        message = resp.json()["error"]["message"]
        if resp.status_code == 413:  # the bound on objects
            assert f"at most {limits.MAX_BODY_OBJECTS} are accepted" in message, message
            assert shape.endswith(("parts", "blocks", "tools")), shape
            await assert_same_worker_serves(srv, pid)
            return
        assert resp.status_code == 400, resp.text[:300]
        assert ("take at least" in message
                or f"at most {limits.MAX_CONVERSATION_ITEMS} items" in message), message
        if path.endswith("/count_tokens"):  # a count has no context bound: only the size
            assert f"at most {limits.MAX_CONVERSATION_ITEMS} items" in message, message
        if not path.startswith("/v1/messages"):
            assert resp.json()["error"]["code"] in ("context_length_exceeded", "invalid_value")
            assert resp.json()["error"]["param"] == ("input" if path == "/v1/responses" else "messages")
        await assert_same_worker_serves(srv, pid)


def _responses(*items: dict) -> dict:
    return {"model": "fake", "max_output_tokens": 2, "input": list(items)}


CALL = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
OUTPUT = {"type": "function_call_output", "call_id": "c1", "output": "ok"}


@pytest.mark.parametrize("body, code, param", [
    (_responses({"role": "user", "content": "hi"}, {**CALL, "arguments": "[" * 100 + "]" * 100}, OUTPUT),
     "invalid_value", "input[1].arguments"),
    (_responses({"role": "user", "content": "hi"}, {**CALL, "arguments": '{"a": "\\ud800"}'}, OUTPUT),
     "invalid_value", "input[1].arguments"),
])
async def test_responses_items_are_as_strict_as_chat_messages(tmp_path, body, code, param):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        pid = srv.pool.worker_pid
        resp = await client.post("/v1/responses", json=body)
        assert resp.status_code == 400, resp.text[:300]
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == (code, param), error
        assert "prompt_segments" not in error["message"]
        await assert_same_worker_serves(srv, pid)


async def test_echoed_responses_items_with_ids_and_statuses_are_accepted(tmp_path):
    """What clients echo back (ids, statuses, annotations, encrypted reasoning) is not unknown."""
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        body = _responses(
            {"type": "message", "role": "user", "id": "msg_1", "status": "completed",
             "content": [{"type": "input_text", "text": "hi"}]},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": None,
             "content": [{"type": "reasoning_text", "text": "thinking"}]},
            {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
             "content": [{"type": "output_text", "text": "x", "annotations": [], "logprobs": []}]},
            {**CALL, "id": "fc_1", "status": "completed", "arguments": '{"a": "\\u00e9"}'},
            {**OUTPUT, "id": "fco_1"},
            {"role": "user", "content": "go on"})
        resp = await client.post("/v1/responses", json=body)
        assert resp.status_code == 200, resp.text[:300]


async def h2c_exchange(port: int, headers: list[tuple[str, str]], body: bytes = b"") -> tuple[dict, bytes]:
    """One HTTP/2 request over cleartext with prior knowledge: (response headers, body)."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    answer: dict[str, str] = {}
    data = b""
    async with stream:
        await stream.send_all(conn.data_to_send())
        with trio.fail_after(10):
            sent = False
            while True:
                if not sent and conn.remote_settings.enable_connect_protocol is not None:
                    stream_id = conn.get_next_available_stream_id()
                    conn.send_headers(stream_id, headers, end_stream=not body)
                    if body:
                        conn.send_data(stream_id, body, end_stream=True)
                    await stream.send_all(conn.data_to_send())
                    sent = True
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                done = False
                for event in conn.receive_data(chunk):
                    if isinstance(event, h2.events.ResponseReceived):
                        answer = {k.decode(): v.decode() for k, v in event.headers}
                    elif isinstance(event, h2.events.DataReceived):
                        data += event.data
                        conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                    elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                        done = True
                await stream.send_all(conn.data_to_send())
                if done:
                    break
    return answer, data


async def test_h2c_websocket_connect_and_doubled_slashes_get_json_errors(tmp_path, caplog):
    """The same over HTTP/2 (h2c, prior knowledge): an extended CONNECT for a WebSocket
    (RFC 8441) gets the 426 envelope after the key check; a doubled slash is 404 JSON."""
    async with live_server(tmp_path, script=["ok"], api_key="k2") as srv:
        pid = srv.pool.worker_pid
        connect = [(":method", "CONNECT"), (":protocol", "websocket"), (":scheme", "http"),
                   (":path", "/v1/responses"), (":authority", f"127.0.0.1:{srv.port}"),
                   ("sec-websocket-version", "13")]
        head, body = await h2c_exchange(srv.port, connect)
        assert head[":status"] == "401" and json.loads(body)["error"]["code"] == "invalid_api_key"
        head, body = await h2c_exchange(srv.port, [*connect, ("authorization", "Bearer k2")])
        assert head[":status"] == "426", (head, body)
        assert json.loads(body)["error"]["code"] == "websocket_not_supported"
        assert head["x-request-id"].startswith("req-")
        get = [(":method", "GET"), (":scheme", "http"), (":path", "/v1//models"),
               (":authority", f"127.0.0.1:{srv.port}"), ("authorization", "Bearer k2")]
        head, body = await h2c_exchange(srv.port, get)
        assert head[":status"] == "404" and json.loads(body)["error"]["code"] == "not_found"
        quiet_except_access(caplog)
        async with srv.client(headers={"Authorization": "Bearer k2"}) as client:
            resp = await client.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 200, resp.text
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
