"""The two shapes every API route answers with: a JSON body, or an event stream.

Shared by the chat, Responses, Messages and legacy routes so that the headers an event stream
needs (no caching, no proxy buffering) and its cancellation hook are set in one place.
"""

from __future__ import annotations

from typing import Any, AsyncIterator, Callable, Mapping

from quart import Response

from ..guard import json_bytes

__all__ = ["json_response", "event_stream"]


def json_response(body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json_bytes(body), content_type="application/json", headers=dict(headers or {}))


def event_stream(body: AsyncIterator[bytes], cancel: Callable[[], None],
                 call_at_request_end: Callable[[Callable[[], None]], None],
                 headers: Mapping[str, str] | None = None) -> Response:
    """An SSE response over ``body``. ``cancel`` (synchronous, idempotent) runs when the
    request ends, whether or not the body was iterated, so a client that disconnects at any
    point frees its generation."""
    call_at_request_end(cancel)
    resp = Response(body, content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
    resp.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long streams
    return resp
