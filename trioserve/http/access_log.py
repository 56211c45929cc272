"""Request ids, the access log and the HTTP request metrics: one ASGI layer around the app.

For every HTTP request (and every WebSocket handshake, which is refused with an HTTP
response: its line shows the method ``WEBSOCKET``):

* a request id is made before the app runs (``req-<24 hex>``); a handler may replace it
  while the response has not started (chat completions use their ``chatcmpl-…`` id, so
  the header, the log lines and the response body agree) through ``current_request()``;
* the response carries it as ``x-request-id``;
* if anything below fails before a response started (a bug, or a framework error outside
  Quart's handlers), the client still gets the ``500 internal_error`` envelope and the
  traceback is logged, instead of hypercorn's empty 500;
* when the request ends — normally, failing, or cancelled because the client left — one
  INFO line goes to the ``trioserve.access`` logger: client address, method, path,
  status (``-`` if no response started), duration in ms, body bytes sent, request id,
  and the client's own ``x-request-id`` when it sent a sane one (``client_id=…``).

A client's ``x-request-id`` is never echoed back or used as ours: ours must stay unique
and, on chat completions, equal to the completion id. It is logged only when it matches
``[A-Za-z0-9._:-]{1,128}``, so it cannot forge or break log lines.
"""

from __future__ import annotations

import contextvars
import logging
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from trioserve.core.session_branches import ACCESS_NOTES
from trioserve.errors import internal_error
from trioserve.http.guard import send_error, send_websocket_error
from trioserve.http.metrics import Metrics

log = logging.getLogger("trioserve.access")  # access lines only
errors_log = logging.getLogger("trioserve")

REQUEST_ID_HEADER = b"x-request-id"
_SANE_CLIENT_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")
_MAX_LOGGED_PATH = 200


@dataclass
class RequestInfo:
    """The current request as the observability layer knows it (mutable by handlers)."""

    request_id: str
    client_request_id: str | None = None


_current: contextvars.ContextVar[RequestInfo] = contextvars.ContextVar("trioserve_request")


def current_request() -> RequestInfo | None:
    """The RequestInfo of the HTTP request being served in this context, if any."""
    return _current.get(None)


def new_request_id() -> str:
    return "req-" + secrets.token_hex(12)


def _client_request_id(headers: list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == REQUEST_ID_HEADER:
            text = value.decode("latin-1")
            return text if _SANE_CLIENT_ID.fullmatch(text) else None
    return None


def _printable(text: str, limit: int = _MAX_LOGGED_PATH) -> str:
    """``text`` safe for one log line: control characters, quotes and backslashes escaped."""
    out = []
    for ch in text[:limit]:
        if ch.isprintable() and ch not in '"\\':
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii") if ch != '"' else '\\"')
    return "".join(out) + ("…" if len(text) > limit else "")


class RequestObserver:
    """ASGI middleware: request id header, access log line and request metrics."""

    def __init__(self, app: Any, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        # A websocket scope is a handshake that is always refused (trioserve.http.websocket)
        # with an HTTP response: it is observed like any request.
        prefix = "websocket." if kind == "websocket" else ""
        info = RequestInfo(new_request_id(), _client_request_id(scope.get("headers") or []))
        status: int | None = None
        sent = 0
        started = time.perf_counter()

        async def observed_send(message: dict) -> None:
            nonlocal status, sent
            if message["type"] == prefix + "http.response.start":
                status = int(message["status"])
                headers = [*message.get("headers", ()), (REQUEST_ID_HEADER, info.request_id.encode())]
                message = {**message, "headers": headers}
            elif message["type"] == prefix + "http.response.body":
                sent += len(message.get("body", b""))
            elif message["type"] == "websocket.close" and status is None:
                status = 403  # what a server answers to a close before accept
            await send(message)

        token = _current.set(info)
        notes: list[str] = []  # the serving core's notes for this line (divergence=…)
        notes_token = ACCESS_NOTES.set(notes)
        if self.metrics is not None:
            self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, observed_send)
        except Exception:
            errors_log.exception("request %s failed before responding", info.request_id)
            if status is not None:
                raise  # the response started: hypercorn ends the connection
            error = internal_error(f"the request could not be completed (request id "
                                   f"{info.request_id}; details in the server log)")
            if kind == "websocket":
                await send_websocket_error(scope, observed_send, error)
            else:
                await send_error(observed_send, error)
        finally:
            _current.reset(token)
            ACCESS_NOTES.reset(notes_token)
            path = scope.get("path", "")
            if self.metrics is not None:
                self.metrics.in_flight.dec()
                self.metrics.request_finished(path, status)
            if log.isEnabledFor(logging.INFO):
                client = scope.get("client")
                where = f"{client[0]}:{client[1]}" if client else "-"
                extra = f" client_id={info.client_request_id}" if info.client_request_id else ""
                extra += "".join(" " + _printable(note) for note in notes)
                method = "WEBSOCKET" if kind == "websocket" else str(scope.get("method", "-"))
                log.info('%s "%s %s" %s %.1fms %dB id=%s%s', where,
                         _printable(method, 16), _printable(path),
                         status if status is not None else "-",
                         (time.perf_counter() - started) * 1000, sent, info.request_id, extra)
