"""A raw HTTP/1.1 client over a trio socket, for requests no well-behaved client sends
(forged Host headers, malformed request lines, odd bytes in headers).

Every request is sent whole and the response read until the server closes the
connection (requests carry ``Connection: close``; parser errors close anyway).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import trio


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-cased names; the last value wins
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def build_request(method: str, path: str, *, headers: list[tuple[str | bytes, str | bytes]],
                  body: bytes = b"") -> bytes:
    """Request bytes with exactly ``headers`` (plus Content-Length when there is a body)."""
    def raw(x: str | bytes) -> bytes:
        return x if isinstance(x, bytes) else x.encode("latin-1")

    lines = [f"{method} {path} HTTP/1.1".encode("latin-1")]
    lines += [raw(name) + b": " + raw(value) for name, value in headers]
    if body:
        lines.append(f"Content-Length: {len(body)}".encode())
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def exchange(port: int, data: bytes, timeout: float = 20.0) -> RawResponse:
    """Send ``data`` and read the whole response (until EOF); parse status, headers, body
    (a response to HEAD has none, whatever its Content-Length says)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    received = bytearray()
    async with stream:
        with trio.fail_after(timeout):
            try:
                await stream.send_all(data)
            except trio.BrokenResourceError:
                pass  # the server answered and closed before reading everything
            while True:
                try:
                    chunk = await stream.receive_some(65536)
                except trio.BrokenResourceError:
                    break
                if not chunk:
                    break
                received += chunk
    return parse_response(bytes(received), to_head=data.startswith(b"HEAD "))


def parse_response(data: bytes, *, to_head: bool = False) -> RawResponse:
    head, sep, body = data.partition(b"\r\n\r\n")
    assert sep, f"no complete response head: {data[:300]!r}"
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    version, status, *_ = status_line.split(" ", 2)
    assert version in ("HTTP/1.1", "HTTP/1.0"), status_line
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    if to_head:
        assert not body, f"a response to HEAD with a body: {body[:100]!r}"
    elif headers.get("transfer-encoding", "").lower() == "chunked":
        body = dechunk(body)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        assert len(body) == length, f"body has {len(body)} bytes, Content-Length says {length}"
    return RawResponse(int(status), headers, body)


def dechunk(data: bytes) -> bytes:
    out = bytearray()
    while True:
        size_line, sep, rest = data.partition(b"\r\n")
        assert sep, "truncated chunked body"
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += rest[:size]
        assert rest[size:size + 2] == b"\r\n", "malformed chunk"
        data = rest[size + 2:]
