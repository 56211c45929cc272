"""The chunked body fast path (trioserve/http/chunked_body.py) writes exactly what h11
would have written, and leaves h11's state as h11 would have left it."""

from __future__ import annotations

import h11
import pytest
import trio
from hypercorn.protocol.events import Body, EndBody
from hypercorn.protocol.h11 import H11Protocol

from trioserve.http import chunked_body


def _protocol(request: bytes, sent: list[bytes]) -> H11Protocol:
    """Just enough of an ``H11Protocol`` for ``stream_send``: its h11 connection (a response
    head already sent for ``request``) and a ``send`` that keeps the bytes."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(request)
    assert isinstance(connection.next_event(), h11.Request)
    headers = [(b"content-type", b"text/event-stream")]
    connection.send(h11.Response(status_code=200, headers=headers))
    protocol = H11Protocol.__new__(H11Protocol)
    protocol.connection = connection

    async def send(event) -> None:
        sent.append(event.data)

    protocol.send = send  # type: ignore[method-assign]
    return protocol


CHUNKS = [b"data: {}\n\n", b"", "data: \u00e9\u4e2d\U0001f600\n\n".encode(), b"x" * 70000]


async def _wire(request: bytes, send) -> tuple[list[bytes], h11.Connection]:
    sent: list[bytes] = []
    protocol = _protocol(request, sent)
    for chunk in CHUNKS:
        await send(protocol, Body(stream_id=1, data=chunk))
    await send(protocol, EndBody(stream_id=1))
    return sent, protocol.connection


@pytest.mark.parametrize("request_line", [b"GET / HTTP/1.1\r\nHost: a\r\n\r\n",  # chunked
                                          b"GET / HTTP/1.0\r\n\r\n"])  # HTTP/1.0: not chunked
def test_the_fast_path_writes_what_h11_writes(request_line):
    async def main() -> None:
        fast, fast_conn = await _wire(request_line, chunked_body._stream_send)
        general, general_conn = await _wire(request_line, chunked_body._original_stream_send)
        assert b"".join(fast) == b"".join(general)
        assert fast_conn.our_state is general_conn.our_state  # DONE, or MUST_CLOSE for 1.0
        if b"1.1" in request_line:  # a client's parser reads the chunks back whole
            client = h11.Connection(h11.CLIENT)
            client.send(h11.Request(method="GET", target="/", headers=[("Host", "a")]))
            client.send(h11.EndOfMessage())
            head = b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            client.receive_data(head + b"".join(fast))
            body = b""
            while not isinstance(event := client.next_event(), h11.EndOfMessage):
                body += event.data if isinstance(event, h11.Data) else b""
            assert body == b"".join(CHUNKS)

    trio.run(main)


def test_installing_is_idempotent_and_replaces_stream_send():
    assert chunked_body.install_chunked_body_fast_path()
    assert chunked_body.install_chunked_body_fast_path()
    assert H11Protocol.stream_send is chunked_body._stream_send
