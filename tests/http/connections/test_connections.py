"""A connection ends only itself: malformed framing to routes that do not read
the body, framing conflicts, absolute-form targets, slow requests and connection floods,
over real sockets. After every case the same server answers a normal request with the
same worker (pid unchanged), and no process or file descriptor leaks."""

from __future__ import annotations

import json
import signal
import socket

import httpx
import pytest
import trio

from trioserve.http import connection

from ..conftest import chat_body, live_server
from ..rawhttp import build_request, exchange, parse_response
from .test_cancellation import descendants, process_gone, server_process

pytestmark = pytest.mark.usefixtures("no_leaks")


def bad_chunk_request(port: int, method: str = "GET", path: str = "/health",
                      extra: str = "") -> bytes:
    """The 70-byte take-down: a chunked body whose first chunk size is not hex."""
    return (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n{extra}"
            f"Transfer-Encoding: chunked\r\n\r\nzz\r\n").encode()


async def assert_same_server_serves(srv, worker_pid: int, **client_kwargs) -> None:
    async with srv.client(**client_kwargs) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body())
        assert resp.status_code == 200, resp.text
    assert srv.pool.worker_pid == worker_pid and srv.pool.restarts == 0


def assert_answer_to_bad_chunk(resp) -> None:
    # The route may answer before the parser reaches the bad chunk (then the connection
    # closes after its response), or the parser's 400 comes first; either is whole.
    if resp.status == 400:
        assert resp.json()["error"]["code"] == "invalid_http_request"
        assert resp.headers["connection"] == "close"
    else:
        assert resp.status in (200, 401, 415), resp


async def test_bad_chunk_to_a_route_that_ignores_the_body_200_times(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        data = bad_chunk_request(srv.port)

        async def one_client(count: int) -> None:
            for _ in range(count):
                assert_answer_to_bad_chunk(await exchange(srv.port, data))

        async with trio.open_nursery() as nursery:  # 4 × 50, concurrent like an attacker
            for _ in range(4):
                nursery.start_soon(one_client, 50)
        await assert_same_server_serves(srv, pid)


@pytest.mark.parametrize("method,path,extra", [
    ("GET", "/v1/models", ""),  # refused by the API key check, body unread
    ("POST", "/v1/chat/completions", "Content-Type: text/plain\r\n"),  # refused: not JSON
    ("POST", "/v1/chat/completions", "Content-Type: application/json\r\n"),  # reads the body
    ("DELETE", "/v1/sessions/x", ""),
    ("GET", "/no/such/route", ""),
])
async def test_bad_chunk_with_an_api_key_configured(tmp_path, method, path, extra):
    async with live_server(tmp_path, script=["ok"], api_key="k3y") as srv:
        pid = srv.pool.worker_pid
        for _ in range(20):
            assert_answer_to_bad_chunk(await exchange(srv.port, bad_chunk_request(srv.port, method, path, extra)))
        await assert_same_server_serves(srv, pid, headers={"Authorization": "Bearer k3y"})


async def test_content_length_with_transfer_encoding_closes_without_the_smuggled_request(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        smuggled = f"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n\r\n"
        data = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: 5\r\n"
                f"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}").encode()
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        received = b""
        async with stream:
            await stream.send_all(data)
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):  # until the server closes
                    received += chunk
        assert received.count(b"HTTP/1.1 ") == 1, received  # no answer to the smuggled GET
        resp = parse_response(received)
        assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_http_request"
        assert resp.headers["connection"] == "close"
        await assert_same_server_serves(srv, pid)


async def test_absolute_form_target_is_checked_like_host(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        body = json.dumps(chat_body()).encode()
        host = ("Host", f"127.0.0.1:{srv.port}")
        json_type = ("Content-Type", "application/json")
        evil = await exchange(srv.port, build_request(
            "POST", "http://evil.example/v1/chat/completions",
            headers=[host, json_type, ("Connection", "close")], body=body))
        assert evil.status == 421 and evil.json()["error"]["code"] == "host_not_allowed"
        bad = await exchange(srv.port, build_request(
            "GET", "http://a b/health", headers=[host, ("Connection", "close")]))
        assert bad.status == 400
        ok = await exchange(srv.port, build_request(
            "POST", f"http://127.0.0.1:{srv.port}/v1/chat/completions",
            headers=[host, json_type, ("Connection", "close")], body=body))
        assert ok.status == 200 and ok.json()["object"] == "chat.completion"
        await assert_same_server_serves(srv, pid)


async def test_session_paths_that_match_no_route_are_400(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        pid = srv.pool.worker_pid
        for path in ("/v1/sessions/", "/v1/sessions/a%0Ab", "/v1/sessions/%00"):
            resp = await client.delete(path)
            assert resp.status_code == 400, (path, resp.text)
            error = resp.json()["error"]
            assert error["code"] == "invalid_value" and error["param"] == "session"
        assert (await client.delete("/v1/sessions/unknown")).status_code == 404
        await assert_same_server_serves(srv, pid)


async def test_a_body_that_stops_arriving_gets_408_with_a_code(tmp_path, monkeypatch):
    monkeypatch.setattr(connection, "REQUEST_GRACE_S", 0.5)
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        received = b""
        async with stream:
            await stream.send_all(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                                  f"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{".encode())
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    received += chunk
        resp = parse_response(received)
        assert resp.status == 408, resp
        assert resp.json()["error"]["code"] == "request_timeout"
        assert resp.headers["connection"] == "close"
        await assert_same_server_serves(srv, pid)


async def test_a_request_trickled_in_below_the_minimum_rate_gets_408(tmp_path, monkeypatch):
    monkeypatch.setattr(connection, "REQUEST_GRACE_S", 0.5)
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        received = b""
        async with stream:
            # /health never reads the body: only the connection's receive rate can end this.
            await stream.send_all(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\n"
                                  f"Content-Length: 100000\r\n\r\n{{".encode())
            with trio.fail_after(10):
                while True:
                    try:
                        await stream.send_all(b" ")
                    except trio.BrokenResourceError:
                        pass
                    with trio.move_on_after(0.2):
                        chunk = await stream.receive_some(65536)
                        if not chunk:
                            break
                        received += chunk
        # /health answered at once (200), and the connection was then cut for its slow body.
        assert received.startswith(b"HTTP/1.1 200"), received[:200]
        await assert_same_server_serves(srv, pid)


async def test_slow_request_before_any_response_gets_408_envelope(tmp_path, monkeypatch):
    monkeypatch.setattr(connection, "REQUEST_GRACE_S", 0.5)
    async with live_server(tmp_path, script=["ok"]) as srv:
        pid = srv.pool.worker_pid
        stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
        received = b""
        async with stream:
            await stream.send_all(b"GET /health HTTP/1.1\r\nHo")  # an unfinished head
            with trio.fail_after(10):
                while chunk := await stream.receive_some(65536):
                    received += chunk
        resp = parse_response(received)
        assert resp.status == 408 and resp.json()["error"]["code"] == "request_timeout"
        await assert_same_server_serves(srv, pid)


async def fresh_client_amid_slow_senders(port: int, senders: int = 40) -> tuple[float, int]:
    """Open ``senders`` connections that trickle a body (``Content-Length: 100000``, ``{``,
    then a byte every 3 s), then time a fresh client's chat request (bound: the issue's 2 s).
    Returns the fresh client's time and how many slow connections the server closed."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{{").encode()
    closed = 0

    async def slow_sender() -> None:
        nonlocal closed
        try:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(head)
                while True:
                    with trio.move_on_after(3):
                        if not await stream.receive_some(1024):
                            closed += 1  # the server closed it (evicted)
                            return
                    await stream.send_all(b" ")
        except (trio.BrokenResourceError, OSError):
            closed += 1

    async with trio.open_nursery() as attackers:
        for _ in range(senders):
            attackers.start_soon(slow_sender)
        await trio.sleep(1.5)  # every slot is taken, the rest wait in the backlog
        started = trio.current_time()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            # The issue's bound. By design ~0.6 s: the slow senders fall behind the receive
            # rate, so each is evictable 0.25 s after it was accepted
            # (server.EVICT_SLOW_AFTER_S), and 24 of them are ahead in the backlog.
            with trio.fail_after(2):
                resp = await client.post("/v1/chat/completions", json=chat_body())
        elapsed = trio.current_time() - started
        assert resp.status_code == 200, resp.text
        await trio.sleep(0.5)  # the closed senders notice
        attackers.cancel_scope.cancel()
    return elapsed, closed


async def test_slow_body_connections_do_not_lock_out_a_fresh_client(tmp_path):
    """Connections that trickle a body hold every slot; a fresh client must still
    be served. Here 40 slow connections against a cap of 16 (the same shape as 300 against
    256, at a tenth of the cost)."""
    async with live_server(tmp_path, script=["ok"], max_connections=16) as srv:
        pid = srv.pool.worker_pid
        elapsed, closed = await fresh_client_amid_slow_senders(srv.port)
        print(f"fresh client served in {elapsed * 1000:.0f} ms with 40 slow connections, cap 16")
        # The cap held: the 24 that waited in the backlog were let in only by closing others.
        assert closed >= 40 - 16
        await assert_same_server_serves(srv, pid)


async def test_hypercorn_entry_point_caps_connections_too(tmp_path, monkeypatch):
    """``hypercorn trioserve.app:app --worker-class trio``: the same cap (from
    TRIOSERVE_MAX_CONNECTIONS) and the same eviction as ``trioserve serve``."""
    monkeypatch.setenv("TRIOSERVE_MAX_CONNECTIONS", "16")
    with server_process(tmp_path, ["ok"], hypercorn=True) as (proc, port, workers):
        try:
            elapsed, closed = await fresh_client_amid_slow_senders(port)
            print(f"hypercorn entry: fresh client served in {elapsed * 1000:.0f} ms, "
                  f"{closed} closed")
            assert closed >= 40 - 16  # without a cap none is closed before the 10 s grace
            resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(),
                              timeout=10)
            assert resp.status_code == 200
            assert workers == {pid for pid in descendants(proc.pid) if pid in workers}
        finally:
            # The orderly way, also when an assertion failed: SIGKILL (server_process's
            # fallback) would orphan hypercorn's worker process.
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=15) == 0
        assert "accepting at most 16 connections" in proc.stderr.read()
    assert all(process_gone(pid) for pid in workers)


def test_hypercorn_entry_point_survives_bad_chunks(tmp_path):
    """``hypercorn trioserve.app:app --worker-class trio`` (hypercorn's own accept loop)."""
    with server_process(tmp_path, ["ok"], hypercorn=True) as (proc, port, workers):
        data = bad_chunk_request(port)
        for _ in range(100):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(data)
                received = b""
                while chunk := sock.recv(65536):
                    received += chunk
            assert_answer_to_bad_chunk(parse_response(received))
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=chat_body(), timeout=10)
        assert resp.status_code == 200
        assert proc.poll() is None
        assert workers == {pid for pid in descendants(proc.pid) if pid in workers}  # same worker
        # Stop it the orderly way: SIGKILL would orphan hypercorn's worker process.
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert all(process_gone(pid) for pid in workers)


def test_hypercorn_internals_are_the_verified_ones():
    connection.check_hypercorn_internals()  # raises when hypercorn changed
    from hypercorn.trio import run as hypercorn_run

    import trioserve.app  # noqa: F401 — importing the app module installs the handler
    assert hypercorn_run.TCPServer is connection.IsolatedTCPServer
    from trioserve.http import server  # the connection cap is installed too
    assert isinstance(hypercorn_run.trio, server._TrioWithCappedAccept)
