"""No connection can be held forever (issue 47, round 5), over real loopback sockets, under both
entry points (``trioserve serve``'s accept loop and ``hypercorn trioserve.app:app --worker-class
trio``):

* **A closed transport ends every send** (h2_guard.py, connection.py): h2c connections that set
  their flow-control window to 0 (or never send WINDOW_UPDATE for a 120 KB answer), then close,
  gave their slot back never: the handler's shielded last send waited for window forever.
  Now their slots come back, 2 of them at a cap of 2 and 256 at the default cap, and a fresh
  request is answered at once. A client that keeps such a connection open gets its stream reset
  once the window deadline passes, and SIGTERM ends the server within its drain timeout while
  such connections hold answers.
* **HTTP/2 connections are evicted at the cap** like HTTP/1.1 ones: 8 h2c connections each
  uploading a 1 MB body at 6 KB/s (and reconnecting when closed) against a cap of 8 lock out
  no fresh request.
* **One answer per WebSocket handshake**: a handshake followed by more bytes (in one segment,
  or after the answer) gets the app's ``426`` every time, and the connection is closed after
  it; 4 such connections held by their clients at a cap of 4 lock out no one.

Each ends with the same server answering a fresh request. Deadlines are generous (a shared,
noisy machine): without the fixes nothing is answered at all, so they test behaviour, not speed.
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import asynccontextmanager
from typing import AsyncIterator

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import httpx
import pytest
import trio

from trioserve.http import h2_guard

from ..conftest import chat_body, live_server
from ..rawhttp import parse_response
from .test_cancellation import process_gone, server_process

pytestmark = pytest.mark.usefixtures("no_leaks")

# The issue asks for a fresh answer within 1-2 s; this leaves room for a noisy 2-core machine.
FRESH_ANSWER_S = 5.0
# hypercorn's own graceful timeout (its entry point's drain timeout), and trioserve serve's here.
HYPERCORN_DRAIN_S = 3.0
SERVE_DRAIN_S = 2.0
ENTRY_POINTS = ["serve", "hypercorn"]


@asynccontextmanager
async def served(tmp_path, monkeypatch, entry: str, max_connections: int = 256) -> AsyncIterator[int]:
    """The port of a server on the fake worker started by ``entry``: ``serve`` (trioserve's
    accept loop, in this process) or ``hypercorn`` (a real process, stopped with SIGTERM at the
    end: it must exit, status 0, within its drain timeout, generously counted)."""
    if entry == "serve":
        async with live_server(tmp_path, script=["ok"], max_connections=max_connections) as srv:
            pid = srv.pool.worker_pid
            yield srv.port
            assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        return
    monkeypatch.setenv("TRIOSERVE_MAX_CONNECTIONS", str(max_connections))
    with server_process(tmp_path, ["ok"], hypercorn=True) as (proc, port, workers):
        yield port
        proc.send_signal(signal.SIGTERM)
        assert await exit_status(proc, HYPERCORN_DRAIN_S + 10) == 0
    assert all(process_gone(pid) for pid in workers)


async def exit_status(proc, within: float) -> int | None:
    """The process's exit status once it exited (polled), None if it still runs after ``within``."""
    with trio.move_on_after(within):
        while proc.poll() is None:
            await trio.sleep(0.05)
    return proc.poll()


async def fresh_answer(port: int) -> float:
    """Seconds until a fresh client's chat request on a new connection is answered 200."""
    started = trio.current_time()
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=FRESH_ANSWER_S * 2) as client:
        with trio.fail_after(FRESH_ANSWER_S):
            resp = await client.post("/v1/chat/completions", json=chat_body())
    assert resp.status_code == 200, resp.text
    return trio.current_time() - started


class H2c:
    """One h2c connection (prior knowledge) driven by hand with the h2 library, client side."""

    def __init__(self, stream: trio.SocketStream, port: int, window: int | None) -> None:
        self.stream = stream
        self.port = port
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        if window is not None:  # SETTINGS_INITIAL_WINDOW_SIZE: what the server may send per stream
            self.conn.local_settings = h2.settings.Settings(
                client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.events: list[h2.events.Event] = []

    @classmethod
    async def open(cls, port: int, *, window: int | None = None) -> H2c:
        self = cls(await trio.open_tcp_stream("127.0.0.1", port), port, window)
        self.conn.initiate_connection()
        await self.flush()
        return self

    async def flush(self) -> None:
        await self.stream.send_all(self.conn.data_to_send())

    async def request(self, method: str, path: str, body: bytes | None = None,
                      length: int | None = None) -> int:
        """Send a request's headers and ``body`` (ending the stream when the body is whole:
        ``length``, default its size)."""
        sid = self.conn.get_next_available_stream_id()
        headers = [(":method", method), (":scheme", "http"), (":authority", f"127.0.0.1:{self.port}"),
                   (":path", path)]
        if body is not None:
            length = len(body) if length is None else length
            headers += [("content-type", "application/json"), ("content-length", str(length))]
        self.conn.send_headers(sid, headers, end_stream=body is None)
        size = self.conn.max_outbound_frame_size
        for i in range(0, len(body or b""), size):
            self.conn.send_data(sid, body[i:i + size], end_stream=i + size >= length)
        await self.flush()
        return sid

    async def until(self, wanted: type, sid: int) -> h2.events.Event:
        """Read (never granting window) until an event of type ``wanted`` for ``sid``."""
        while True:
            for event in self.events:
                if isinstance(event, wanted) and getattr(event, "stream_id", None) == sid:
                    return event
            chunk = await self.stream.receive_some(65536)
            assert chunk, f"the server closed the connection; events: {self.events}"
            self.events += self.conn.receive_data(chunk)
            await self.flush()  # SETTINGS and PING acknowledgements only


async def hold_unanswerable(port: int, *, tokenize: bool) -> H2c:
    """An h2c request whose answer cannot be sent whole: ``GET /health`` with a window of 0, or
    a ``/tokenize`` of 30,000 characters (~120 KB answer) with the default 64 KiB window and
    no WINDOW_UPDATE. Returns once the response headers arrived (the answer is under way)."""
    client = await H2c.open(port, window=None if tokenize else 0)
    if tokenize:
        sid = await client.request("POST", "/tokenize", json.dumps({"content": "x" * 30_000}).encode())
    else:
        sid = await client.request("GET", "/health")
    await client.until(h2.events.ResponseReceived, sid)
    return client


async def take_down(port: int, connections: int, *, tokenize: bool = False, hold: float = 1.0) -> None:
    """The issue's reproduction: ``connections`` such requests, opened 10 ms apart (256 in
    ~3 s; all at once would overflow the listen backlog), each held ``hold`` seconds after its
    answer started, then closed."""
    async def one() -> None:
        client = await hold_unanswerable(port, tokenize=tokenize)
        async with client.stream:
            await trio.sleep(hold)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(connections):
                nursery.start_soon(one)
                await trio.sleep(0.01)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("tokenize", [False, True], ids=["zero-window", "no-window-update"])
async def test_h2c_answers_stuck_on_flow_control_give_their_slots_back_on_close(
        tmp_path, monkeypatch, entry, tokenize):
    async with served(tmp_path, monkeypatch, entry, max_connections=2) as port:
        for _ in range(2):  # twice the cap: the first round's slots must have come back
            await take_down(port, 2, tokenize=tokenize)
        print(f"{entry}: fresh answer in {await fresh_answer(port) * 1000:.0f} ms after 4 closed "
              f"stuck h2c answers at a cap of 2")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
async def test_256_zero_window_connections_at_the_default_cap(tmp_path, monkeypatch, entry):
    async with served(tmp_path, monkeypatch, entry) as port:
        started = trio.current_time()
        await take_down(port, 256)
        took = trio.current_time() - started
        print(f"{entry}: 256 zero-window connections in {took:.1f} s; fresh answer in "
              f"{await fresh_answer(port) * 1000:.0f} ms")


async def test_an_answer_the_client_grants_no_window_for_is_abandoned(tmp_path, monkeypatch):
    # The client keeps its connections open: after WINDOW_TIMEOUT_S (1 s here) each stream is
    # reset, the handler is told the client left, and the connections, now idle, make room.
    monkeypatch.setattr(h2_guard, "WINDOW_TIMEOUT_S", 1.0)
    async with served(tmp_path, monkeypatch, "serve", max_connections=2) as port:
        clients = [await hold_unanswerable(port, tokenize=tokenize) for tokenize in (False, True)]
        for client in clients:
            async with client.stream:
                with trio.fail_after(10):
                    reset = await client.until(h2.events.StreamReset, 1)
                assert reset.error_code == h2.errors.ErrorCodes.CANCEL
                print(f"fresh answer in {await fresh_answer(port) * 1000:.0f} ms beside a "
                      f"connection whose answer was abandoned")


@pytest.mark.parametrize("entry", ENTRY_POINTS)
async def test_sigterm_ends_the_server_while_h2c_connections_hold_stuck_answers(tmp_path, monkeypatch, entry):
    monkeypatch.setenv("TRIOSERVE_DRAIN_TIMEOUT", str(SERVE_DRAIN_S))
    drain = SERVE_DRAIN_S if entry == "serve" else HYPERCORN_DRAIN_S
    with server_process(tmp_path, ["ok"], hypercorn=entry == "hypercorn") as (proc, port, workers):
        clients = [await hold_unanswerable(port, tokenize=i % 2 == 1) for i in range(4)]
        await fresh_answer(port)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        status = await exit_status(proc, drain + 10)
        took = time.monotonic() - started
        for client in clients:
            await client.stream.aclose()
        print(f"{entry}: SIGTERM ended the server in {took:.1f} s (drain timeout {drain:g} s) "
              f"with 4 stuck h2c answers")
        assert status == 0, (status, took)
    assert all(process_gone(pid) for pid in workers)


async def slow_h2_uploader(port: int, closed: list[int], stop: trio.Event) -> None:
    """Upload a 1 MB chat body at 6 KB/s on an h2c connection, reconnecting whenever the server
    closes it (counted in ``closed``), until ``stop``."""
    while not stop.is_set():
        try:
            client = await H2c.open(port)
            async with client.stream:
                sid = await client.request("POST", "/v1/chat/completions", b"{", length=1_000_000)
                next_send = trio.current_time()
                while not stop.is_set():
                    with trio.move_on_at(next_send):  # meanwhile take in the WINDOW_UPDATEs
                        chunk = await client.stream.receive_some(65536)
                        if not chunk:
                            raise trio.BrokenResourceError("closed by the server")
                        client.conn.receive_data(chunk)
                    if trio.current_time() >= next_send:
                        client.conn.send_data(sid, b" " * 600)
                        next_send += 0.1
                    await client.flush()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            closed[0] += 1


@pytest.mark.parametrize("entry", ENTRY_POINTS)
async def test_slow_h2c_uploads_are_evicted_at_the_cap_like_http1_ones(tmp_path, monkeypatch, entry):
    async with served(tmp_path, monkeypatch, entry, max_connections=8) as port:
        closed = [0]
        stop = trio.Event()
        async with trio.open_nursery() as attackers:
            for _ in range(8):
                attackers.start_soon(slow_h2_uploader, port, closed, stop)
            await trio.sleep(1.5)  # every slot is taken by an upload at 6 KB/s
            times = [await fresh_answer(port) for _ in range(5)]
            stop.set()
        print(f"{entry}: 5 fresh answers in {', '.join(f'{t * 1000:.0f}' for t in times)} ms "
              f"beside 8 slow h2c uploads at a cap of 8 ({closed[0]} uploads evicted)")
        assert closed[0] >= 1  # each fresh client got in by evicting an upload


WS_HANDSHAKE = ("GET /v1/responses HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                "Connection: Upgrade, close\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n")
# A masked text frame "hello" (RFC 6455 §5.7), as a client that does not wait for the answer sends.
WS_FRAME = b"\x81\x85\x37\xfa\x21\x3d\x7f\x9f\x4d\x51\x58"


async def websocket_answer(port: int, *, frame_after_answer: bool) -> bytes:
    """Send a handshake followed by a frame (in the same segment, or once the answer began)
    and read until the server closes the connection (this client never closes first)."""
    handshake = WS_HANDSHAKE.format(port=port).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = b""
    async with stream:
        await stream.send_all(handshake if frame_after_answer else handshake + WS_FRAME)
        with trio.fail_after(10):  # the server must close it, answered once
            try:
                while chunk := await stream.receive_some(65536):
                    first, received = not received, received + chunk
                    if frame_after_answer and first:
                        await stream.send_all(WS_FRAME)
            except trio.BrokenResourceError:  # reset: the frame arrived after the close
                pass
    return received


@pytest.mark.parametrize("entry", ENTRY_POINTS)
async def test_a_websocket_handshake_with_more_bytes_gets_one_answer_and_is_closed(tmp_path, monkeypatch, entry):
    async with served(tmp_path, monkeypatch, entry, max_connections=4) as port:
        for i in range(20):
            received = await websocket_answer(port, frame_after_answer=i % 2 == 1)
            assert received.count(b"HTTP/1.1 ") == 1, received
            resp = parse_response(received)
            assert resp.status == 426 and resp.json()["error"]["code"] == "websocket_not_supported", resp

        # Four clients send the same and never close: the server closes each after its answer.
        async def hold() -> None:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(WS_HANDSHAKE.format(port=port).encode() + WS_FRAME)
                await trio.sleep_forever()

        async with trio.open_nursery() as holders:
            for _ in range(4):
                holders.start_soon(hold)
            await trio.sleep(0.5)
            print(f"{entry}: fresh answer in {await fresh_answer(port) * 1000:.0f} ms beside 4 "
                  f"answered WebSocket handshakes at a cap of 4")
            holders.cancel_scope.cancel()
