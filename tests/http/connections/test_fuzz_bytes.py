"""Fuzz the HTTP layer at the byte level over raw sockets, under both entry points.

Hypothesis builds each case from request lines (every route, absolute form, doubled
slashes, garbage), headers (Host, Content-Length and Transfer-Encoding in agreeing and
conflicting forms, Expect, Upgrade to h2c and WebSocket handshakes, Connection, garbage lines), bodies (plain, chunked with good and bad
sizes, extensions, trailers, truncation), pipelining (up to three requests per
connection), and how the bytes are sent (at once, in pieces, then half-closed, or the
connection dropped early without reading). Bodies go to routes that do not read them too.

The assertion is about the server, not any one answer: after every case a fresh
connection gets ``200`` from ``/health`` (0 listener deaths), no answer is a 500, and
every answer starts with a status line. After all cases: the same worker process (pid),
the server process alive, and its file descriptors back to where they were.

Bounded: ``derandomize`` makes the cases the same on every run, ``max_examples`` caps them.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .test_cancellation import descendants, server_process

EXAMPLES = 100

ROUTES = [b"GET /health", b"GET /v1/models", b"POST /v1/chat/completions", b"GET /metrics",
          b"DELETE /v1/sessions/x", b"DELETE /v1/sessions/", b"GET /no/such", b"OPTIONS /health",
          b"HEAD /health", b"POST /health", b"POST http://evil.example/v1/chat/completions",
          b"GET http://127.0.0.1/health", b"PRI *", b"GET *", b"GET /v1/sessions/a%0Ab",
          b"POST /v1/responses", b"POST /v1/messages", b"POST /v1/completions",
          b"POST /v1/messages/count_tokens", b"POST /tokenize", b"POST /detokenize",
          b"GET /v1//models", b"POST /v1//chat/completions", b"GET /v1/responses",
          b"GET //health", b"GET /v1/models/fake", b"GET /v1/models/%ff%00", b"POST /v1/models/fake/load",
          b"POST /v1/models/fake/unload", b"POST /v1/models/nope/load"]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1 extra", b"HTTP/9.9", b""]
CHAT = b'{"model":"fake","messages":[{"role":"user","content":"hi"}],"max_tokens":2}'

request_lines = st.one_of(
    st.tuples(st.sampled_from(ROUTES), st.sampled_from(VERSIONS)).map(lambda rv: b" ".join(rv).rstrip()),
    st.binary(max_size=40).filter(lambda b: b"\n" not in b),
)
header_lines = st.one_of(
    st.sampled_from([
        b"Host: 127.0.0.1", b"Host: evil.example", b"Host:", b"Host: a b", b"Host: [::1]:80",
        b"Content-Type: application/json", b"Content-Type: text/plain",
        b"Content-Length: 0", b"Content-Length: 5", b"Content-Length: 75", b"Content-Length: -1",
        b"Content-Length: 99999999999999999999", b"Content-Length: 5, 5", b"Content-Length: 0x10",
        b"Transfer-Encoding: chunked", b"Transfer-Encoding: gzip", b"Transfer-Encoding: chunked, chunked",
        b"Transfer-Encoding:  chunked", b"Transfer-Encoding: identity",
        b"Connection: close", b"Connection: keep-alive", b"Connection: upgrade",
        b"Upgrade: h2c", b"HTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA", b"Expect: 100-continue",
        b"Upgrade: websocket", b"Connection: Upgrade, close", b"Sec-WebSocket-Version: 13",
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", b"x-api-key: k",
        b"Authorization: Bearer x", b"X-Session-Id: \x7f", b" folded", b"No-Colon", b": empty-name",
        b"Bad Name: x", b"X: " + b"y" * 20_000,
    ]),
    st.binary(max_size=30).filter(lambda b: b"\n" not in b and b"\r" not in b),
)
chunk = st.one_of(
    st.builds(lambda data: b"%x\r\n" % len(data) + data + b"\r\n", st.binary(max_size=20)),
    st.sampled_from([b"zz\r\n", b"5\r\nabc\r\n", b"-1\r\n", b"ffffffffffffffffff\r\n", b"3;ext=1\r\nabc\r\n",
                     b"0\r\n\r\n", b"0\r\nTrailer: x\r\n\r\n", b"0\r\n", b"\r\n", b"1\r\nab\r\n",
                     b"10\r\n" + b"a" * 16 + b"\r\n"]),
)
bodies = st.one_of(
    st.just(b""), st.just(CHAT), st.binary(max_size=200), st.builds(b"".join, st.lists(chunk, max_size=5)),
    st.just(b"{"),
)


@st.composite
def one_request(draw) -> bytes:
    """Mostly a well-formed head (valid route, HTTP/1.1, a good Host) with odd framing, so
    cases get past the parser to the routes; sometimes garbage from the first byte."""
    if draw(st.integers(0, 4)) == 0:
        lines = [draw(request_lines)] + draw(st.lists(header_lines, max_size=6))
        return b"\r\n".join(lines) + b"\r\n\r\n" + draw(bodies)
    route = draw(st.sampled_from(ROUTES))
    lines = [route + b" HTTP/1.1", b"Host: 127.0.0.1"] + draw(st.lists(header_lines, max_size=3))
    if draw(st.integers(0, 7)) == 0:  # a whole WebSocket handshake, on any route
        lines += [b"Upgrade: websocket", b"Connection: Upgrade", b"Sec-WebSocket-Version: 13",
                  b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ=="]
    framing = draw(st.sampled_from(["none", "length", "chunked", "both", "raw"]))
    body = draw(bodies)
    if framing == "length":
        lines.append(b"Content-Length: %d" % (len(body) + draw(st.integers(-2, 2))))
    if framing in ("chunked", "both"):
        lines.append(b"Transfer-Encoding: chunked")
        body = b"".join(draw(st.lists(chunk, min_size=1, max_size=4)))
    if framing == "both":
        lines.append(b"Content-Length: %d" % len(body))
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


@st.composite
def cases(draw) -> tuple[list[bytes], str]:
    requests = draw(st.lists(one_request(), min_size=1, max_size=3))
    data = b"".join(requests)
    mode = draw(st.sampled_from(["whole", "pieces", "drop-early", "no-half-close"]))
    if mode == "pieces":
        cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=4))))
        pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True) if b > a]
        return pieces, mode
    if mode == "drop-early":
        return [data[: draw(st.integers(0, len(data)))]], mode
    return [data], mode


def run_case(port: int, pieces: list[bytes], mode: str) -> bytes:
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        try:
            for piece in pieces:
                sock.sendall(piece)
                if mode == "pieces":
                    time.sleep(0.005)
            if mode == "drop-early":
                return b""  # closed without reading: the server must cope
            if mode != "no-half-close":
                sock.shutdown(socket.SHUT_WR)
            sock.settimeout(0.3 if mode == "no-half-close" else 5.0)
            while chunk := sock.recv(65536):
                received += chunk
        except OSError:
            pass  # a keep-alive connection left open, a reset, or closed before the
            # half-close: the answer so far counts
    return received


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def serving_process(root: int, worker: int) -> int:
    """The process that runs the app: the fake worker's parent (hypercorn forks one)."""
    with open(f"/proc/{worker}/stat") as stat:
        parent = int(stat.read().rsplit(")", 1)[1].split()[1])
    assert parent == root or parent in descendants(root)
    return parent


@pytest.fixture(scope="module", params=["trioserve-serve", "hypercorn"])
def fuzzed_server(request, tmp_path_factory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp(request.param)
    with server_process(tmp, ["ok"], hypercorn=request.param == "hypercorn") as (proc, port, workers):
        (worker,) = workers
        server = serving_process(proc.pid, worker)
        state = {"port": port, "proc": proc, "worker": worker, "server": server,
                 "fds": open_fds(server), "answers": 0}
        yield state
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=cases())
def test_no_bytes_stop_the_listener(fuzzed_server, case):
    pieces, mode = case
    received = run_case(fuzzed_server["port"], pieces, mode)
    if received:
        fuzzed_server["answers"] += 1
        assert received.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")) or received.startswith(b"\x00\x00"), \
            received[:100]  # (an h2 frame after a prior-knowledge preface)
        for line in received.split(b"\r\n"):
            if line.startswith(b"HTTP/1.1 ") or line.startswith(b"HTTP/1.0 "):
                assert not line[9:12].startswith(b"5") or line[9:12] in (b"501", b"503"), received[:400]
    # 0 listener deaths: the same server still answers a new connection.
    resp = httpx.get(f"http://127.0.0.1:{fuzzed_server['port']}/health", timeout=5)
    assert resp.status_code == 200 and resp.json()["restarts"] == 0


def test_after_fuzzing_same_worker_and_no_fd_leak(fuzzed_server):
    """Runs after the fuzz test of the same entry point (module order)."""
    assert fuzzed_server["proc"].poll() is None
    assert fuzzed_server["answers"] > EXAMPLES // 4  # the cases reached the server
    worker = fuzzed_server["worker"]
    assert os.path.exists(f"/proc/{worker}")
    resp = httpx.post(f"http://127.0.0.1:{fuzzed_server['port']}/v1/chat/completions",
                      json={"model": "fake", "messages": [{"role": "user", "content": "hi"}]}, timeout=10)
    assert resp.status_code == 200
    deadline = time.monotonic() + 15  # connections the fuzzer left open time out server-side
    while open_fds(fuzzed_server["server"]) > fuzzed_server["fds"]:
        assert time.monotonic() < deadline, (open_fds(fuzzed_server["server"]), fuzzed_server["fds"])
        time.sleep(0.2)
