"""No request stalls or kills a healthy worker: token counting and HTTP/2 streams, over real
sockets (HTTP/1.1 and h2c).

* **Token counting runs beside the steps.** Six concurrent ``count_tokens`` of 110,000 empty
  messages (3.4 MB each; three over HTTP/1.1, three multiplexed on one h2c connection) on a
  fake worker whose tokenizer costs what a real one does (``--tokenize-us-per-byte``): once a
  count is at the worker, a stream started then completes, and ``/health`` answers, while
  that count is still being tokenized; every count is exact; the worker is the same process
  (no restart), and then serves a normal request with no fd growth. Before the worker's call
  thread (cpp/call_worker.h) the tokenize ran on the step loop: the stream stood still for
  every count and the parent's ping queued behind them.
* **A client that leaves takes its tokenize with it**: the worker's call is cancelled (its
  id is answered `cancelled`), so nothing keeps running for nobody.
* **Rapid reset** (trioserve/h2_guard.py): 400 streams opened with a chat body and reset at
  once on one h2c connection: the server sends GOAWAY (ENHANCE_YOUR_CALM) and closes it; a
  normal request right after is served, over HTTP/1.1 and h2c, by the same worker.

How long these take is measured by bench/hostile_bench.py, never asserted here.
"""

from __future__ import annotations

import json
import os
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import httpx
import pytest
import trio
from hypercorn.config import Config

from trioserve import limits
from trioserve.http import connection

from ..conftest import chat_body, live_server, open_fds, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

# The most a conversation may hold (count_tokens applies generation's bounds: 110,000 is a 400,
# tests/http/connections/test_hostile_routes.py).
EMPTY_MESSAGES = limits.MAX_CONVERSATION_ITEMS


def count_body(messages: int = EMPTY_MESSAGES) -> bytes:
    return json.dumps({"model": "fake",
                       "messages": [{"role": "user", "content": ""}] * messages}).encode()


async def settled_fds(before: int) -> int:
    """Open fds once connections the server closed are gone (bounded wait)."""
    for _ in range(100):
        if open_fds() <= before:
            break
        await trio.sleep(0.02)
    return open_fds()


async def test_count_tokens_runs_beside_a_stream_over_http1_and_h2c(tmp_path):
    # 10 µs a byte: about 3 s of "tokenizer" per count (0.3 MB of rendered template), far
    # longer than the bystander stream takes.
    async with live_server(tmp_path, script=["s" * 40],
                           worker_args="--tokenize-us-per-byte 10 --token-delay-ms 2") as srv:
        pid = srv.pool.worker_pid
        body = count_body()
        async with srv.client() as warm:  # the connection pool and worker, warmed up
            assert (await warm.post("/v1/chat/completions", json=chat_body())).status_code == 200
            small = await warm.post("/v1/messages/count_tokens", content=count_body(2),
                                    headers={"content-type": "application/json"})
            assert small.status_code == 200, small.text
        fds_before = await settled_fds(open_fds())
        order: list[str] = []
        counts: list[httpx.Response] = []
        at_worker = trio.Event()

        async def count(client: httpx.AsyncClient) -> None:
            resp = await client.post("/v1/messages/count_tokens", content=body,
                                     headers={"content-type": "application/json"})
            order.append("count")
            counts.append(resp)

        async def watch_worker() -> None:
            while srv.pool.calls_in_flight == 0:
                await trio.sleep(0.005)
            at_worker.set()

        async def bystander(client: httpx.AsyncClient) -> None:
            await at_worker.wait()
            assert not counts, "a count finished before the bystander could start"
            async with client.stream("POST", "/v1/chat/completions",
                                     json=chat_body(stream=True)) as resp:
                assert resp.status_code == 200
                raw = b"".join([chunk async for chunk in resp.aiter_bytes()])
            events = parse_sse(raw)
            assert events[-1] == "[DONE]"
            order.append(f"stream done, {srv.pool.calls_in_flight} calls at the worker")
            health = await client.get("/health")
            assert health.status_code == 200 and health.json()["restarts"] == 0
            order.append("health")

        async with srv.client(timeout=120) as h1, \
                srv.client(timeout=120, http1=False, http2=True) as h2c, \
                srv.client(timeout=120) as side:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch_worker)
                nursery.start_soon(bystander, side)
                for client in (h1, h1, h1, h2c, h2c, h2c):
                    nursery.start_soon(count, client)
        # The stream and /health completed while a count was still at the worker.
        assert order[0].startswith("stream done") and not order[0].endswith(" 0 calls at the worker"), order
        assert order[1] == "health", order
        assert len(counts) == 6
        for resp in counts:
            assert resp.status_code == 200, resp.text
        totals = {resp.json()["input_tokens"] for resp in counts}
        assert len(totals) == 1 and totals.pop() > EMPTY_MESSAGES
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        async with srv.client() as after:
            resp = await after.post("/v1/chat/completions", json=chat_body())
            assert resp.status_code == 200 and resp.json()["choices"][0]["message"]["content"]
        assert srv.pool.worker_pid == pid
        assert await settled_fds(fds_before) <= fds_before


async def test_a_client_that_leaves_cancels_its_tokenize_at_the_worker(tmp_path):
    # 50 µs a byte: a 1 MB /tokenize would hold the call thread for 50 s.
    async with live_server(tmp_path, script=["ok"], worker_args="--tokenize-us-per-byte 50") as srv:
        pid = srv.pool.worker_pid
        async with srv.client() as client:
            with trio.move_on_after(60) as guard:
                async with trio.open_nursery() as nursery:
                    async def leave() -> None:
                        await client.post("/tokenize", json={"content": "x" * 1_000_000})

                    nursery.start_soon(leave)
                    while srv.pool.calls_in_flight == 0:
                        await trio.sleep(0.005)
                    nursery.cancel_scope.cancel()  # the client disconnects
                # The worker answers the abandoned call `cancelled` (its id's bookkeeping ends)
                # long before the 50 s of work it would otherwise do.
                while srv.pool.calls_in_flight:
                    await trio.sleep(0.01)
            assert not guard.cancelled_caught, "the abandoned tokenize was not cancelled"
            resp = await client.post("/tokenize", json={"content": "ab"})
            assert resp.status_code == 200 and resp.json() == {"tokens": [97, 98]}
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_a_long_tokenize_is_not_taken_for_a_hung_worker(tmp_path, monkeypatch):
    # The watchdog pings an idle worker after 0.5 s of silence and kills it when no pong comes
    # within 1 s. A tokenize of 640 KB costs the fake 3.2 s: answered on the call thread, it
    # leaves the loop free to answer the pings (before, the ping queued behind it and the
    # healthy worker was killed as "silent while idle"). Its own deadline grows with its text.
    async with live_server(tmp_path, script=["ok"], health_timeout=1, stall_timeout=0.5,
                           worker_args="--tokenize-us-per-byte 5") as srv:
        pid = srv.pool.worker_pid
        (runtime,) = [w.runtime for w in srv.pool.workers]
        runtime.health_interval = 0.5
        sent: list[str] = []
        worker = runtime.client
        send_request = worker.send_request

        async def counting(prepared, **kwargs):
            sent.append(prepared.op)
            return await send_request(prepared, **kwargs)

        monkeypatch.setattr(worker, "send_request", counting)
        async with srv.client(timeout=60) as client:
            # A generation wakes the watchdog, which then keeps the 0.5 s idle interval.
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
            resp = await client.post("/tokenize", json={"content": "y" * 640_000})
            assert resp.status_code == 200, resp.text[:300]
            assert len(resp.json()["tokens"]) == 640_000
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
        start = sent.index("tokenize")
        during = sent[start + 1:sent.index("generate", start)]
        assert during.count("ping") >= 2, sent  # the watchdog probed while it tokenized
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_one_client_holds_at_most_its_share_of_the_tokenizer_queue(tmp_path):
    # Queue depth 2: 2 in flight + 2 waiting = 4 places, 2 per client. A third /tokenize from
    # one address is refused at once (503 server_busy, Retry-After) while another address
    # still gets in; when the first client leaves, its tokenizes are cancelled at the worker.
    async with live_server(tmp_path, script=["ok"], queue_depth=2,
                           worker_args="--tokenize-us-per-byte 50") as srv:
        pid = srv.pool.worker_pid
        other = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with srv.client(timeout=60) as a, srv.client(timeout=60, transport=other) as b:
            async def big() -> None:  # 1 MB: 50 s of work unless cancelled
                await a.post("/tokenize", json={"content": "z" * 1_000_000})

            async with trio.open_nursery() as nursery:
                for _ in range(2):
                    nursery.start_soon(big)
                while srv.pool.tokenize_gate.held_by("127.0.0.1") < 2:
                    await trio.sleep(0.005)
                refused = await a.post("/tokenize", json={"content": "ab"})
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "server_busy"
                assert refused.headers["retry-after"]
                nursery.cancel_scope.cancel()  # client a leaves
            resp = await b.post("/tokenize", json={"content": "ab"})
            assert resp.status_code == 200 and resp.json() == {"tokens": [97, 98]}
            assert srv.pool.tokenize_gate.held == 0
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


def h2_headers(port: int, path: str, length: int) -> list[tuple[str, str]]:
    return [(":method", "POST"), (":scheme", "http"), (":authority", f"127.0.0.1:{port}"),
            (":path", path), ("content-type", "application/json"), ("content-length", str(length))]


async def rapid_reset(port: int, streams: int = 400) -> tuple[list[h2.events.Event], bool]:
    """Open ``streams`` streams with a chat body on one h2c connection, resetting each at
    once; return the server's connection-level events and whether it closed the connection."""
    body = json.dumps(chat_body(stream=True)).encode()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    events: list[h2.events.Event] = []
    closed = False
    async with stream:
        try:
            await stream.send_all(conn.data_to_send())
            for i in range(streams):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, h2_headers(port, "/v1/chat/completions", len(body)))
                conn.send_data(sid, body, end_stream=True)
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
                if i % 25 == 24:
                    await stream.send_all(conn.data_to_send())
        except (trio.BrokenResourceError, trio.ClosedResourceError, h2.exceptions.ProtocolError):
            pass  # the server closed it mid-attack
        with trio.move_on_after(30):
            while True:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    closed = True
                    break
                if not data:
                    closed = True
                    break
                try:
                    events += [e for e in conn.receive_data(data)
                               if isinstance(e, (h2.events.ConnectionTerminated,
                                                 h2.events.RemoteSettingsChanged))]
                except h2.exceptions.ProtocolError:
                    pass
    return events, closed


async def test_rapid_reset_closes_the_connection_and_the_next_request_is_served(tmp_path):
    async with live_server(tmp_path, script=["fine"], queue_depth=4) as srv:
        pid = srv.pool.worker_pid
        async with srv.client() as client:
            assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
        fds_before = await settled_fds(open_fds())
        events, closed = await rapid_reset(srv.port)
        assert closed, "the server kept the rapid-reset connection open"
        goaways = [e for e in events if isinstance(e, h2.events.ConnectionTerminated)]
        assert goaways and goaways[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM
        settings = [e for e in events if isinstance(e, h2.events.RemoteSettingsChanged)]
        advertised = settings[0].changed_settings[h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS]
        assert advertised.new_value == 32
        # Right after: served over HTTP/1.1 and over h2c, by the same worker.
        async with srv.client() as h1, srv.client(http1=False, http2=True) as h2c:
            for client in (h1, h2c):
                resp = await client.post("/v1/chat/completions", json=chat_body())
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["message"]["content"] == "fine"
            assert (await h2c.get("/health")).json()["restarts"] == 0
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        assert await settled_fds(fds_before) <= fds_before


async def test_a_well_behaved_h2c_client_multiplexing_and_cancelling_is_not_cut(tmp_path):
    # 24 concurrent requests on one connection (within the advertised 32), then a few
    # cancelled ones: every request is answered, the connection stays usable.
    async with live_server(tmp_path, script=["fine"], queue_depth=32) as srv:
        async with srv.client(http1=False, http2=True) as h2c:
            results: list[int] = []

            async def one() -> None:
                results.append((await h2c.post("/v1/chat/completions", json=chat_body())).status_code)

            async with trio.open_nursery() as nursery:
                for _ in range(24):
                    nursery.start_soon(one)
            assert results == [200] * 24
        # Five requests reset by the client (raw h2: httpx's own cancellation is not what is
        # tested), then a request on the same connection: answered, no GOAWAY.
        body = json.dumps(chat_body()).encode()
        conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        conn.initiate_connection()
        async with await trio.open_tcp_stream("127.0.0.1", srv.port) as stream:
            for _ in range(5):
                sid = conn.get_next_available_stream_id()
                conn.send_headers(sid, h2_headers(srv.port, "/v1/chat/completions", len(body)))
                conn.send_data(sid, body, end_stream=True)
                conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
            last = conn.get_next_available_stream_id()
            conn.send_headers(last, h2_headers(srv.port, "/v1/chat/completions", len(body)))
            conn.send_data(last, body, end_stream=True)
            await stream.send_all(conn.data_to_send())
            status, data, ended, goaway = None, b"", False, False
            with trio.fail_after(30):
                while not ended:
                    chunk = await stream.receive_some(65536)
                    assert chunk, "the server closed the connection"
                    for event in conn.receive_data(chunk):
                        if isinstance(event, h2.events.ResponseReceived) and event.stream_id == last:
                            status = dict(event.headers)[b":status"]
                        elif isinstance(event, h2.events.DataReceived) and event.stream_id == last:
                            data += event.data
                            conn.acknowledge_received_data(event.flow_controlled_length, last)
                        elif isinstance(event, h2.events.StreamEnded) and event.stream_id == last:
                            ended = True
                        elif isinstance(event, h2.events.ConnectionTerminated):
                            goaway = True
                    await stream.send_all(conn.data_to_send())
            assert status == b"200" and not goaway
            assert json.loads(data)["choices"][0]["message"]["content"] == "fine"


class RawH2:
    """One h2c connection driven by hand (the h2 library, client side): what a client that
    keeps sending after its answer, or trickles a body, does."""

    def __init__(self, stream: trio.SocketStream, port: int) -> None:
        self.stream = stream
        self.port = port
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.status: dict[int, bytes] = {}
        self.bodies: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.goaway = False

    @classmethod
    async def open(cls, port: int) -> RawH2:
        self = cls(await trio.open_tcp_stream("127.0.0.1", port), port)
        self.conn.initiate_connection()
        await self.flush()
        return self

    async def flush(self) -> None:
        await self.stream.send_all(self.conn.data_to_send())

    async def start(self, path: str, length: int) -> int:
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, h2_headers(self.port, path, length))
        await self.flush()
        return sid

    async def send(self, sid: int, data: bytes, end: bool = False) -> None:
        size = self.conn.max_outbound_frame_size
        for i in range(0, len(data), size):
            self.conn.send_data(sid, data[i:i + size], end_stream=end and i + size >= len(data))
        await self.flush()

    async def receive(self) -> None:
        """Read once and take in the server's frames (the connection must stay open)."""
        chunk = await self.stream.receive_some(65536)
        assert chunk, "the server closed the connection"
        for event in self.conn.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived):
                self.status[event.stream_id] = dict(event.headers)[b":status"]
            elif isinstance(event, h2.events.DataReceived):
                self.bodies[event.stream_id] = self.bodies.get(event.stream_id, b"") + event.data
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = True
        await self.flush()

    async def answer(self, sid: int) -> tuple[bytes, Any]:
        while sid not in self.ended:
            await self.receive()
        return self.status[sid], json.loads(self.bodies[sid])


async def test_data_sent_after_an_early_answer_ends_only_that_request(tmp_path):
    # A 404 is sent as soon as the headers arrive, while the client still sends its body:
    # hypercorn forgot the stream, and the next DATA frame for it raised KeyError in the
    # connection's reading task, ending the connection and every request on it. Now that data
    # is dropped and its flow-control credit returned: here the stray bytes fill the whole
    # connection window (64 KiB), so the next request's body can only go out once the server
    # handed that credit back.
    async with live_server(tmp_path, script=["fine"]) as srv:
        pid = srv.pool.worker_pid
        client = await RawH2.open(srv.port)
        async with client.stream:
            with trio.fail_after(30):
                early = await client.start("/v1/nowhere", 200_000)
                status, error = await client.answer(early)
                assert status == b"404" and error["error"]["code"] == "not_found"
                window = client.conn.outbound_flow_control_window
                await client.send(early, b" " * window)
                body = json.dumps(chat_body()).encode()
                normal = await client.start("/v1/chat/completions", len(body))
                while client.conn.local_flow_control_window(normal) < len(body):
                    await client.receive()  # waits for the WINDOW_UPDATE
                await client.send(normal, body, end=True)
                status, answer = await client.answer(normal)
            assert status == b"200" and answer["choices"][0]["message"]["content"] == "fine"
            assert not client.goaway
        # A real client: httpx sends a whole 3 MB body to a path that does not exist (404 after
        # the headers), then a chat request on the same h2c connection; both answered. One after
        # the other: two requests at once on one connection meet httpcore's own flow-control
        # stall (an upload waiting for window reads the socket after the other request's task
        # already took the WINDOW_UPDATE, and waits for bytes the server never sends;
        # pydantic/httpx2#1133), which failed this test under CPU contention.
        async with srv.client(http1=False, http2=True) as h2c:
            statuses = []
            for path, content in (("/v1/nowhere", b" " * 3_000_000),
                                  ("/v1/chat/completions", json.dumps(chat_body()).encode())):
                resp = await h2c.post(path, content=content, headers={"content-type": "application/json"})
                statuses.append((resp.http_version, resp.status_code))
            assert statuses == [("HTTP/2", 404), ("HTTP/2", 200)]
            assert len(h2c._transport._pool.connections) == 1  # the same connection
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_a_body_still_uploading_after_its_answer_keeps_the_connection_alive(tmp_path, monkeypatch):
    # Keep-alive counted from a stream's answer, not from the last byte of its body: a client
    # still uploading to a path answered 404 after the headers had the connection closed under
    # it once the timeout passed, and it never read the answer. Each byte of the drained
    # stream restarts the timer; once the client is done, the idle connection still closes on it.
    monkeypatch.setattr(Config, "keep_alive_timeout", 1.0)
    async with live_server(tmp_path, script=["fine"]) as srv:
        client = await RawH2.open(srv.port)
        async with client.stream:
            with trio.fail_after(30):
                early = await client.start("/v1/nowhere", 12 * 2000)
                status, error = await client.answer(early)
                assert status == b"404" and error["error"]["code"] == "not_found"
                for piece in range(12):  # 3 s of body after the answer: three timeouts
                    await trio.sleep(0.25)
                    await client.send(early, b" " * 2000, end=piece == 11)
                body = json.dumps(chat_body()).encode()
                normal = await client.start("/v1/chat/completions", len(body))
                await client.send(normal, body, end=True)
                status, answer = await client.answer(normal)
                assert status == b"200" and answer["choices"][0]["message"]["content"] == "fine"
                assert not client.goaway
                while await client.stream.receive_some(65536):  # idle: closed by keep-alive
                    pass


async def test_an_h2_body_must_arrive_at_the_minimum_rate_not_within_a_fixed_time(tmp_path, monkeypatch):
    # Over HTTP/2 the connection's receive rate does not apply (one connection carries many
    # requests): the route's body read holds each stream to the same rule, 10 s + its size at
    # 4 KiB/s (scaled down here). A body above the rate is read whole however long it takes
    # past the grace (Quart's fixed 60 s cut it); one below it gets 408, and only its stream ends.
    monkeypatch.setattr(connection, "REQUEST_GRACE_S", 0.5)
    monkeypatch.setattr(connection, "MIN_RECEIVE_RATE", 1000)
    async with live_server(tmp_path, script=["fine"]) as srv:
        pid = srv.pool.worker_pid
        client = await RawH2.open(srv.port)
        async with client.stream:
            with trio.fail_after(30):
                body = json.dumps(chat_body()).encode().ljust(4000)  # JSON allows the spaces
                steady = await client.start("/v1/chat/completions", len(body))
                started = trio.current_time()
                for i in range(0, len(body), 400):  # 2,000 bytes a second: twice the rate
                    await client.send(steady, body[i:i + 400], end=i + 400 >= len(body))
                    await trio.sleep(0.2)
                assert trio.current_time() - started > 1.5  # well past the grace
                status, answer = await client.answer(steady)
                assert status == b"200" and answer["choices"][0]["message"]["content"] == "fine"
                slow = await client.start("/v1/chat/completions", len(body))
                await client.send(slow, body[:100])
                status, error = await client.answer(slow)
            assert status == b"408" and error["error"]["code"] == "request_timeout"
            assert "too slowly: 100 bytes" in error["error"]["message"]
            assert not client.goaway
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


def llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return os.path.join(override, "trioserve-llama-worker") if override else ""  # "": installed


@pytest.mark.slow
async def test_a_tokenize_of_megabytes_on_the_real_model_runs_beside_a_stream(tmp_path):
    # 4.1 MB of spaces: seconds of llama.cpp's tokenizer, which once stalled every stream.
    # The bystander keeps receiving tokens while that tokenize is at the worker, the answer is
    # the exact token list (or, past one worker record, a 413), and the worker stays the same.
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=2,
                           max_body_bytes=8 << 20) as srv, srv.client(timeout=120) as client:
        pid = srv.pool.worker_pid
        model = srv.settings.resolved_model_id()
        short = await client.post("/tokenize", json={"content": " " * 64})
        assert short.status_code == 200
        per_64 = len(short.json()["tokens"])
        tokens_during: list[int] = []
        calls_seen = trio.Event()
        answered = trio.Event()
        result: list[httpx.Response] = []

        async def tokenize() -> None:
            result.append(await client.post("/tokenize", json={"content": " " * 4_100_000}))
            answered.set()

        async def watch() -> None:
            while srv.pool.calls_in_flight == 0 and not answered.is_set():
                await trio.sleep(0.002)
            calls_seen.set()

        bystander = {"model": model, "stream": True, "max_tokens": 200, "temperature": 0,
                     "messages": [{"role": "user", "content": "Tell a long story about the sea."}]}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with client.stream("POST", "/v1/chat/completions", json=bystander) as resp:
                assert resp.status_code == 200
                started = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    if not started:
                        started = True
                        nursery.start_soon(tokenize)
                    elif calls_seen.is_set() and not answered.is_set():
                        tokens_during.append(1)
        assert result, "the tokenize did not finish"
        resp = result[0]
        if resp.status_code == 200:
            assert len(resp.json()["tokens"]) >= 4_100_000 // 64 * max(1, per_64) // 2
        else:
            assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        # Tokens kept arriving while the worker tokenized (before the call thread, none did).
        assert len(tokens_during) >= 3, (len(tokens_during), resp.status_code)
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
        print(json.dumps({"status": resp.status_code, "bystander_tokens_during": len(tokens_during)}))
