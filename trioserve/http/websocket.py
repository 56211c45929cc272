"""WebSocket upgrades: refused cleanly, after the same guards as every HTTP request (spec §2, §3).

trioserve serves HTTP only. A WebSocket handshake (``GET`` with ``Upgrade: websocket``, or
an HTTP/2 extended ``CONNECT``) arrives as an ASGI ``websocket`` scope; Quart would route it
to websocket rules (there are none) and its error handlers, which are written for HTTP
requests, cannot answer it. So websocket scopes never reach Quart:

1. ``HostCheck`` refuses a bad or foreign Host first (as for HTTP);
2. :class:`WebSocketRefusal` checks the API key (``Authorization: Bearer`` or ``x-api-key``),
   then refuses the upgrade with ``426 websocket_not_supported``: HTTP clients that try a
   WebSocket first (Codex's Responses transport) read a non-101 answer and fall back to plain
   HTTP at once, instead of retrying the upgrade.

The refusal is an ordinary HTTP response with the JSON error envelope (Anthropic's under
``/v1/messages``) when the server offers the ASGI ``websocket.http.response`` extension
(hypercorn does), else a ``websocket.close`` before accepting, which servers answer with
``403`` and no body. Either way the access log gets its one line and nothing else is logged.

**One answer per handshake** (:class:`RefusingWSStream`, installed into hypercorn's HTTP/1.1 and
HTTP/2 handlers by :func:`install_websocket_guard`). hypercorn answered bytes that follow a
handshake before it was accepted with its own ``400 Not a valid WebSocket handshake``: when
they arrived before the app's answer (the same bytes, split differently by the network) the
client got that 400 and the app's ``426`` was dropped — and with it the end of the stream, so
the connection stayed open, never evicted, despite its ``Connection: close`` (found by a hostile
test: 4 such connections locked out every client at a cap of 4). trioserve never accepts a
WebSocket, so those bytes can only be meant for a connection that will not exist: they are
dropped, the app's refusal is the one answer, and the connection closes after it.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import hypercorn.protocol.h11 as hypercorn_h11
import hypercorn.protocol.h2 as hypercorn_h2
from hypercorn.protocol.events import Body, Data
from hypercorn.protocol.ws_stream import WSStream

from trioserve import errors
from trioserve.http.guard import RequestGuard, send_websocket_error

__all__ = ["RefusingWSStream", "WebSocketRefusal", "install_websocket_guard",
           "websocket_not_supported"]

def websocket_not_supported() -> errors.APIError:
    """426 ``websocket_not_supported``: the route exists only as plain HTTP."""
    return errors.APIError(
        426, errors.INVALID_REQUEST,
        "This server does not accept WebSocket connections: send the request as plain HTTP "
        "(a POST with a JSON body; streams are server-sent events).",
        code="websocket_not_supported")


class WebSocketRefusal:
    """ASGI middleware in front of Quart: a websocket scope gets the API-key check, then
    :func:`websocket_not_supported`; it never reaches the app. Other scopes pass through.
    ``body_for(error, path)``: the error body for a path (each API's own error shape)."""

    def __init__(self, app: Any, guard: RequestGuard,
                 body_for: Callable[[errors.APIError, str], Any] | None = None) -> None:
        self.app = app
        self.guard = guard
        self.body_for = body_for

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket":
            return await self.app(scope, receive, send)
        headers = scope.get("headers") or ()
        authorization = api_key = None
        for name, value in headers:
            lowered = name.lower()
            if lowered == b"authorization" and authorization is None:
                authorization = value.decode("latin-1")
            elif lowered == b"x-api-key" and api_key is None:
                api_key = value.decode("latin-1")
        if authorization is None and api_key is not None:
            authorization = "Bearer " + api_key
        server = scope.get("server")
        refusal = self.guard.check(method="GET", path=scope.get("path", ""),
                                   authorization=authorization, content_type=None,
                                   local_address=server[0] if server else None,
                                   route_matched=False)
        await send_websocket_error(scope, send, refusal or websocket_not_supported(), self.body_for)


class RefusingWSStream(WSStream):
    """hypercorn's WebSocket stream, where bytes that follow the handshake before it was
    accepted (never, here) are dropped instead of answered with a second, racing ``400``
    (module docstring). Everything else is hypercorn's: an invalid handshake still gets its
    ``400`` (with trioserve's envelope, ``server.install_protocol_error_bodies``)."""

    async def handle(self, event: Any) -> None:
        # Body/Data only ever follow the stream's Request, which set `handshake`.
        if isinstance(event, (Body, Data)) and not self.handshake.accepted:
            return
        await super().handle(event)


def install_websocket_guard() -> None:
    """Make hypercorn's HTTP/1.1 and HTTP/2 handlers create :class:`RefusingWSStream`s;
    idempotent. Raises RuntimeError when hypercorn's WebSocket stream is not the one this was
    written against (hypercorn 0.18: the early ``400`` in ``WSStream.handle``, the handlers
    creating ``WSStream`` by their module's name)."""
    problems = []
    if "isinstance(event, (Body, Data)) and not self.handshake.accepted" not in inspect.getsource(WSStream.handle):
        problems.append("WSStream.handle")
    for module, handler in ((hypercorn_h11, hypercorn_h11.H11Protocol), (hypercorn_h2, hypercorn_h2.H2Protocol)):
        if "WSStream(" not in inspect.getsource(handler._create_stream) \
                or getattr(module, "WSStream", None) not in (WSStream, RefusingWSStream):
            problems.append(f"{module.__name__}.WSStream")
    if problems:
        raise RuntimeError("trioserve's WebSocket handshake guard does not match the installed "
                           f"hypercorn; changed: {', '.join(problems)}. Install a verified hypercorn version.")
    hypercorn_h11.WSStream = RefusingWSStream  # type: ignore[misc]
    hypercorn_h2.WSStream = RefusingWSStream  # type: ignore[misc]
