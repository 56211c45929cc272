"""The guards of a local server, over real sockets (spec §17): API key, JSON-only POST
bodies, the Host allow-list, the connection cap, JSON bodies on HTTP parser errors, and
streams that end with an error event instead of being cut. After every refusal the server
still answers a normal request, and no process or file descriptor leaks."""

from __future__ import annotations

import json
import socket
from functools import partial

import pytest
import trio
from hypercorn.config import Config

from trioserve.http.application import asgi_app, create_quart_app
from trioserve.cli import main
from trioserve.config import Settings
from trioserve.http.server import serve

from ..conftest import chat_body, fake_worker_path, live_server, parse_sse
from ..rawhttp import build_request, exchange, parse_response

pytestmark = pytest.mark.usefixtures("no_leaks")

JSON = ("Content-Type", "application/json")


def assert_envelope(resp, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text[:300]
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert resp.headers["x-request-id"]
    return error


async def assert_still_serving(srv, **client_kwargs) -> None:
    async with srv.client(**client_kwargs) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["message"]["content"]
    assert srv.pool.restarts == 0 and srv.pool.state == "ready"


# -- API key -------------------------------------------------------------------------

async def test_api_key_is_required_on_every_route_but_health(tmp_path):
    async with live_server(tmp_path, script=["ok"], api_key="s3cret-key") as srv, srv.client() as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-key"},
                        {"Authorization": "Bearer s3cret-key-and-more"}, {"Authorization": "s3cret-key"},
                        {"Authorization": "Bearer"}):
            resp = await client.post("/v1/chat/completions", json=chat_body(), headers=headers)
            error = assert_envelope(resp, 401, "invalid_api_key")
            assert "s3cret" not in error["message"]
            assert resp.headers["www-authenticate"] == "Bearer"
        assert_envelope(await client.get("/v1/models"), 401, "invalid_api_key")
        assert_envelope(await client.get("/metrics"), 401, "invalid_api_key")
        assert_envelope(await client.get("/no/such/route"), 401, "invalid_api_key")
        assert (await client.get("/health")).status_code == 200
        # The right key, with the scheme in any case, passes.
        for auth in ("Bearer s3cret-key", "bearer s3cret-key"):
            resp = await client.get("/v1/models", headers={"Authorization": auth})
            assert resp.status_code == 200
        assert srv.pool.dispatched == 0  # nothing refused reached the worker
        await assert_still_serving(srv, headers={"Authorization": "Bearer s3cret-key"})


async def test_openai_sdk_sends_the_key(tmp_path):
    import openai

    async with live_server(tmp_path, script=["via sdk"], api_key="k-123") as srv:
        good = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="k-123", max_retries=0)
        bad = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="nope", max_retries=0)
        async with good, bad:
            reply = await good.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
            assert reply.choices[0].message.content == "via sdk"
            with pytest.raises(openai.AuthenticationError) as err:
                await bad.chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
            assert err.value.code == "invalid_api_key"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::"])
def test_non_loopback_bind_without_key_is_a_startup_error(host, monkeypatch, capsys):
    monkeypatch.delenv("TRIOSERVE_API_KEY", raising=False)
    monkeypatch.delenv("TRIOSERVE_ALLOW_NO_AUTH", raising=False)
    assert main(["serve", "--engine", "fake", "--host", host]) == 2
    err = capsys.readouterr().err
    assert "TRIOSERVE_API_KEY" in err and "TRIOSERVE_ALLOW_NO_AUTH" in err


def non_loopback_address() -> str | None:
    """This machine's address on its default route (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
        except OSError:
            return None
        address = probe.getsockname()[0]
    return None if address.startswith("127.") else address


@pytest.mark.parametrize("allow_no_auth", [False, True])
async def test_public_connection_without_a_key_is_refused_per_request(tmp_path, allow_no_auth):
    """What `hypercorn trioserve.app:app --bind 0.0.0.0:…` gives: settings that say loopback,
    a socket that is not. Without a key (and without allow_no_auth) a connection that
    arrives on a non-loopback address is refused; loopback connections are served."""
    address = non_loopback_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    settings = Settings(engine="fake", worker_bin=fake_worker_path(), log_level="warning",
                        allow_no_auth=allow_no_auth)
    quart_app = create_quart_app(settings)
    config = Config()
    config.bind = ["0.0.0.0:0"]
    config.graceful_timeout = 2.0
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, asgi_app(quart_app), config, max_connections=8,
                                            shutdown_trigger=shutdown.wait))
        port = int(binds[0].rsplit(":", 1)[1])
        try:
            with trio.fail_after(15):
                while quart_app.services.default.pool.state != "ready":
                    await trio.sleep(0.01)
            models = build_request("GET", "/v1/models", headers=[("Host", "localhost"), ("Connection", "close")])
            stream = await trio.open_tcp_stream(address, port)
            async with stream:
                await stream.send_all(models)
                data = b""
                while chunk := await stream.receive_some(65536):
                    data += chunk
            resp = parse_response(data)
            if allow_no_auth:
                assert resp.status == 200
            else:
                assert resp.status == 403 and resp.json()["error"]["code"] == "api_key_required"
                assert (await exchange(port, build_request("GET", "/health", headers=[
                    ("Host", "localhost"), ("Connection", "close")]))).status == 200
            assert (await exchange(port, models)).status == 200  # loopback: served
        finally:
            shutdown.set()


# -- JSON bodies only ------------------------------------------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain;charset=UTF-8",
                                          "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", "application/jsonx",
                                          "json", "application/json-seq"])
async def test_post_bodies_must_be_declared_json(tmp_path, content_type):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        headers = {"Content-Type": content_type} if content_type else {}
        resp = await client.post("/v1/chat/completions", content=json.dumps(chat_body()).encode(),
                                 headers=headers)
        error = assert_envelope(resp, 415, "unsupported_media_type")
        assert "application/json" in error["message"]
        assert srv.pool.dispatched == 0
        await assert_still_serving(srv)


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON;charset=UTF-8"])
async def test_json_content_types_with_parameters_are_accepted(tmp_path, content_type):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", content=json.dumps(chat_body()).encode(),
                                 headers={"Content-Type": content_type})
        assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"] == "ok"


async def test_unknown_routes_and_wrong_methods_keep_404_and_405(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/no-such-endpoint", content=b"x", headers={"Content-Type": "text/plain"})
        assert_envelope(resp, 404, "not_found")
        assert_envelope(await client.get("/v1/chat/completions"), 405, "method_not_allowed")
        await assert_still_serving(srv)


# -- Host allow-list (DNS rebinding) --------------------------------------------------------

async def raw_get(srv, host: str | bytes | None, path: str = "/v1/models"):
    headers = [("Connection", "close")] + ([("Host", host)] if host is not None else [])
    return await exchange(srv.port, build_request("GET", path, headers=headers))


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example",
                                  "localhost.evil.example", "attacker.localhost.example:80",
                                  "10.0.0.1", "[::2]", "127.0.0.2"])
async def test_forged_host_is_refused(tmp_path, host):
    async with live_server(tmp_path, script=["ok"]) as srv:
        resp = await raw_get(srv, host)
        assert resp.status == 421, resp.body
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "host_not_allowed"
        # /health too: a rebinding page must not read anything.
        assert (await raw_get(srv, host, "/health")).status == 421
        await assert_still_serving(srv)


@pytest.mark.parametrize("allowed", ["", "*"])
@pytest.mark.parametrize("host", ["localhost:port", "local host", "", "[::1", "[nothex]",
                                  "localhost:99999999", "a" * 64 + ".example", "h" * 3000,
                                  "localhost:80:80", "user@localhost", b"localhost\xff", None])
async def test_missing_or_malformed_host_is_a_400(tmp_path, host, allowed):
    async with live_server(tmp_path, script=["ok"], allowed_hosts=allowed) as srv:
        resp = await raw_get(srv, host)
        assert resp.status == 400, resp.body
        assert resp.json()["error"]["code"] == ("invalid_host" if host is not None else "invalid_http_request")
        await assert_still_serving(srv)


@pytest.mark.parametrize("host", ["localhost", "localhost:8000", "127.0.0.1", "127.0.0.1:1",
                                  "[::1]", "[::1]:8000", "LOCALHOST:8000"])
async def test_loopback_hosts_are_accepted_by_default(tmp_path, host):
    async with live_server(tmp_path, script=["ok"]) as srv:
        resp = await raw_get(srv, host)
        assert resp.status == 200, resp.body


async def test_two_or_no_host_headers_are_refused(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        data = build_request("GET", "/v1/models", headers=[
            ("Host", "localhost"), ("Host", "evil.example"), ("Connection", "close")])
        resp = await exchange(srv.port, data)
        # h11 already refuses a repeated Host; HostCheck would too.
        assert resp.status == 400 and resp.json()["error"]["code"] in ("invalid_http_request", "invalid_host")
        # HTTP/1.0 may omit Host, so h11 lets it through; HostCheck refuses it.
        resp = await exchange(srv.port, b"GET /v1/models HTTP/1.0\r\n\r\n")
        assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_host"
        await assert_still_serving(srv)


async def test_configured_allowed_hosts(tmp_path):
    async with live_server(tmp_path, script=["ok"], allowed_hosts="api.internal, 10.1.2.3:9") as srv:
        assert (await raw_get(srv, "api.internal:8000")).status == 200
        assert (await raw_get(srv, "10.1.2.3")).status == 200
        assert (await raw_get(srv, "localhost")).status == 421  # the default list is replaced
    async with live_server(tmp_path, script=["ok"], allowed_hosts="*") as srv:
        assert (await raw_get(srv, "anything.example")).status == 200


# -- connection cap ---------------------------------------------------------------------

async def test_connections_beyond_the_cap_wait_and_are_served_later(tmp_path):
    async with live_server(tmp_path, script=["x" * 150], max_connections=2,
                           worker_args="--token-delay-ms 20") as srv:
        holders = [await trio.open_tcp_stream("127.0.0.1", srv.port) for _ in range(2)]
        try:
            # Both slots are taken by connections whose request is being answered (a stream
            # of ~3 s; idle ones could be closed for a newcomer, server.eviction_victim)...
            for stream in holders:
                await stream.send_all(build_request(
                    "POST", "/v1/chat/completions", body=json.dumps(chat_body(stream=True)).encode(),
                    headers=[("Host", "127.0.0.1"), ("Content-Type", "application/json")]))
                with trio.fail_after(10):
                    assert (await stream.receive_some(65536)).startswith(b"HTTP/1.1 200")
            # ...so a third gets no answer...
            waiting = await trio.open_tcp_stream("127.0.0.1", srv.port)
            async with waiting:
                await waiting.send_all(build_request("GET", "/health", headers=[
                    ("Host", "127.0.0.1"), ("Connection", "close")]))
                with trio.move_on_after(0.5):
                    early = await waiting.receive_some(65536)
                    pytest.fail(f"answered beyond the connection cap: {early!r}")
                # ...until a slot frees up.
                await holders.pop().aclose()
                with trio.fail_after(10):
                    answer = await waiting.receive_some(65536)
                assert answer.startswith(b"HTTP/1.1 200")
        finally:
            for stream in holders:
                await stream.aclose()
        await assert_still_serving(srv)


# -- HTTP parser errors get the envelope ---------------------------------------------------

@pytest.mark.parametrize("data,status,code", [
    (b"GARBAGE\r\n\r\n", 400, "invalid_http_request"),
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\nBad Header: x\r\n\r\n", 400, "invalid_http_request"),
    (b"GET /health HTTP/1.1\r\n\r\n", 400, "invalid_http_request"),  # HTTP/1.1 without Host
    (b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 431, "headers_too_large"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: gzip\r\n\r\n",
     501, "not_implemented"),
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabc",
     400, "invalid_http_request"),
])
async def test_http_parser_errors_have_json_bodies(tmp_path, data, status, code):
    async with live_server(tmp_path, script=["ok"]) as srv:
        resp = await exchange(srv.port, data)
        assert resp.status == status
        assert resp.headers["content-type"] == "application/json"
        error = resp.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
        await assert_still_serving(srv)


# -- streams are never cut ----------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
DEPTH = 100_000


def deep_tool_call() -> str:
    return '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * DEPTH + "]" * DEPTH + "}}</tool_call>"


async def test_deeply_nested_tool_call_output_ends_cleanly(tmp_path):
    """A model that writes a tool call nested 100,000 levels deep: the parser may fail
    (a clean error event / 500 envelope) or degrade to content, but the stream is always
    well formed and ends with [DONE], and the server keeps serving."""
    script = [deep_tool_call(), deep_tool_call(), "after"]
    async with live_server(tmp_path, script=script, max_context=2 * DEPTH + 4096) as srv, \
            srv.client(timeout=60) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=True, tools=TOOLS))
        assert resp.status_code == 200
        events = parse_sse(resp.content)  # every event is complete JSON
        assert events[-1] == "[DONE]"
        last = events[-2]
        if "error" in last:
            assert set(last["error"]) == {"message", "type", "param", "code"}
            assert last["error"]["code"] == "internal_error"
        else:
            assert last["choices"][0]["finish_reason"] in ("stop", "length")
            content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1]
                              if e.get("choices"))
            assert content == deep_tool_call()

        resp = await client.post("/v1/chat/completions", json=chat_body(tools=TOOLS))
        if resp.status_code == 500:
            assert_envelope(resp, 500, "internal_error")
        else:
            assert resp.status_code == 200
            assert resp.json()["choices"][0]["message"]["content"] == deep_tool_call()

        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.json()["choices"][0]["message"]["content"] == "after"
        assert srv.pool.restarts == 0
