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
"""

from __future__ import annotations

from typing import Any, Callable

from trioserve import errors
from trioserve.http.guard import RequestGuard, send_websocket_error

__all__ = ["WebSocketRefusal", "websocket_not_supported"]

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
