"""A streamed body chunk framed without a trip through h11 (HTTP/1.1 chunked responses).

Every SSE chunk of every stream passes hypercorn's ``H11Protocol.stream_send`` with a
``Body`` event, which builds an ``h11.Data`` event and hands it to ``h11.Connection.send``:
the state machine is consulted (a ``Data`` event in ``SEND_BODY`` changes nothing), then
the chunked writer frames the bytes as ``<hex length>\\r\\n<data>\\r\\n``. That is ~5 µs of
Python per chunk, per stream, per step; at fleet rates it is a sizeable share of the
control plane's CPU per token. :func:`install_chunked_body_fast_path` makes
``stream_send`` frame such a chunk itself when (and only when) h11 would do exactly that:
our side is in ``SEND_BODY`` and h11 chose its chunked writer. Everything else (the
response head, the end of the body, HTTP/1.0 or ``Content-Length`` bodies, any error
state) goes through h11 as before, so h11's state is the same as if it had sent the chunk.

It relies on h11's ``Connection._writer`` and ``ChunkedWriter`` (h11 0.16) and hypercorn's
``Body`` event; :func:`install_chunked_body_fast_path` checks them and leaves hypercorn
alone (returns False) when they differ.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import h11
from h11._writers import ChunkedWriter
from hypercorn.events import RawData
from hypercorn.protocol.events import Body
from hypercorn.protocol.h11 import H11Protocol

__all__ = ["install_chunked_body_fast_path"]

log = logging.getLogger("trioserve.http.connection")

_original_stream_send = H11Protocol.stream_send


async def _stream_send(self: H11Protocol, event: Any) -> None:
    if type(event) is Body:
        connection = self.connection
        if connection.our_state is h11.SEND_BODY and type(connection._writer) is ChunkedWriter:
            data = event.data
            if data:  # h11 writes nothing for an empty chunk (it would end the body)
                await self.send(RawData(data=b"%x\r\n%s\r\n" % (len(data), data)))
            return
    await _original_stream_send(self, event)


def _h11_is_known() -> bool:
    connection = h11.Connection(h11.SERVER)
    if not hasattr(connection, "_writer"):
        return False
    writer_source = inspect.getsource(ChunkedWriter.send_data)
    return all(needle in writer_source for needle in ('b"%x\\r\\n" % len(data)', 'write(b"\\r\\n")'))


def install_chunked_body_fast_path() -> bool:
    """Replace ``H11Protocol.stream_send`` process-wide (idempotent); False, leaving
    hypercorn as it is, when h11 or hypercorn are not the versions this was written for."""
    if H11Protocol.stream_send is _stream_send:
        return True
    source = inspect.getsource(_original_stream_send)
    if "h11.Data(data=event.data)" not in source or not _h11_is_known():
        log.warning("h11/hypercorn are not the versions trioserve knows: streamed chunks "
                    "keep the general path")
        return False
    H11Protocol.stream_send = _stream_send  # type: ignore[method-assign]
    return True
