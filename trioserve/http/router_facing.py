"""What a router in front of trioserve sees on every response (docs/deployment.md).

Replicas run behind routers that keep a conversation on the replica holding its KV state
(nginx/HAProxy ``hash … consistent``, the SGLang Model Gateway, vllm-router, the Gateway API
Inference Extension's endpoint picker). This ASGI middleware adds what they, and the people
checking them, need:

* ``x-trioserve-instance`` on every response: this server's instance id (``--instance-id``;
  default ``<hostname>:<local port>``), so affinity can be checked from outside: the requests
  of one session must all show the same instance.
* ``x-trioserve-worker`` on every response: the index of the worker that served it (0 while
  a server drives one worker; the route records another index in :func:`serving_info`).
* On ``text/event-stream`` responses: ``X-Accel-Buffering: no`` (nginx then passes the stream
  unbuffered even where ``proxy_buffering`` is on), and an SSE comment line
  (``: keep-alive``) whenever the body has been silent for ``keepalive`` seconds, so proxies
  and clients with read timeouts keep a quiet stream open (a tool call's arguments are held
  back until the call is complete; a big model on a small CPU decodes slowly). Every SSE
  parser ignores comment lines.

Limit, by design: trioserve answers a request only after its first worker record (so errors
known before generation are plain HTTP errors, spec §7): the prefill before that sends no
byte at all, not even headers, and a router's read timeout must exceed the worst time to
first token (docs/deployment.md).

Cancellation: the keep-alive ticker is a child of this request's own nursery and ends with
the request however it ends; body writes and keep-alives are serialised by one lock, so a
comment never splits an event.
"""

from __future__ import annotations

import contextvars
import socket
from dataclasses import dataclass
from typing import Any

import trio

__all__ = ["INSTANCE_HEADER", "KEEPALIVE_COMMENT", "WORKER_HEADER", "RouterFacing",
           "ServingInfo", "default_instance_id", "serving_info"]

INSTANCE_HEADER = b"x-trioserve-instance"
WORKER_HEADER = b"x-trioserve-worker"
KEEPALIVE_COMMENT = b": keep-alive\n\n"


@dataclass
class ServingInfo:
    """Per request: which worker served it (set by the route; read when headers go out)."""

    worker: int = 0


_serving: contextvars.ContextVar[ServingInfo] = contextvars.ContextVar("trioserve_serving_info")


def serving_info() -> ServingInfo:
    """The current request's :class:`ServingInfo` (a detached one outside a request)."""
    try:
        return _serving.get()
    except LookupError:
        return ServingInfo()


def default_instance_id(scope: dict) -> str:
    """``<hostname>:<port>`` of the listening socket the request came in on (the port tells
    replicas on one host apart; on Kubernetes the hostname is the pod's name)."""
    server = scope.get("server")
    port = server[1] if server and len(server) > 1 and server[1] is not None else 0
    return f"{socket.gethostname()}:{port}"


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    return next((value for key, value in headers if key.lower() == name), None)


class RouterFacing:
    """ASGI middleware: instance/worker headers, SSE unbuffering and keep-alives (module
    docstring). ``keepalive`` seconds of silence before a comment; 0 disables them."""

    def __init__(self, app: Any, *, instance_id: str = "", keepalive: float = 15.0) -> None:
        self.app = app
        self.instance_id = instance_id
        self.keepalive = keepalive

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        instance = (self.instance_id or default_instance_id(scope)).encode("latin-1", "replace")
        info = ServingInfo()
        token = _serving.set(info)
        stream = _Stream(lock=trio.Lock(), last_write=trio.current_time())

        async def send_wrapper(message: dict) -> None:
            starts_sse = False
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), (INSTANCE_HEADER, instance),
                           (WORKER_HEADER, str(info.worker).encode())]
                content_type = _header(headers, b"content-type") or b""
                if content_type.split(b";")[0].strip().lower() == b"text/event-stream":
                    starts_sse = True
                    if _header(headers, b"x-accel-buffering") is None:
                        headers.append((b"x-accel-buffering", b"no"))
                message = {**message, "headers": headers}
            final = message["type"] == "http.response.body" and not message.get("more_body", False)
            if not final and _took(stream.lock):
                # The common case, a body chunk with no keep-alive write under way: no
                # scheduler trip for the lock, no cancel scope (the shield below is for
                # the last write only).
                try:
                    await send(message)
                    stream.last_write = trio.current_time()
                    stream.sse = stream.sse or starts_sse
                finally:
                    stream.lock.release()
                return
            # The last body write is shielded by the layer outside (app.AsgiWrapper); waiting
            # here for a keep-alive write to finish must not lose it either.
            with trio.CancelScope(shield=final):
                async with stream.lock:
                    stream.ended = stream.ended or final
                    await send(message)
                    stream.last_write = trio.current_time()
                    # Only once the start is out may the keep-alive task write body bytes:
                    # flagged before it, a comment could go out ahead of the start (the
                    # server then refuses the body message and the stream is cut).
                    stream.sse = stream.sse or starts_sse

        try:
            if self.keepalive <= 0:
                return await self.app(scope, receive, send_wrapper)
            failure: Exception | None = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_alive, stream, send)
                try:
                    await self.app(scope, receive, send_wrapper)
                except Exception as exc:
                    # Re-raised below as itself, not inside the nursery's ExceptionGroup:
                    # the layers around (hypercorn, the access log) expect plain exceptions.
                    failure = exc
                nursery.cancel_scope.cancel()
            if failure is not None:
                raise failure
        finally:
            _serving.reset(token)

    async def _keep_alive(self, stream: _Stream, send: Any) -> None:
        """Until cancelled: a comment after each ``keepalive`` seconds without a body write,
        once an SSE response has started and while it has not ended."""
        while True:
            await trio.sleep_until(stream.last_write + self.keepalive)
            async with stream.lock:
                due = stream.last_write + self.keepalive <= trio.current_time()
                if due and stream.sse and not stream.ended:
                    await send({"type": "http.response.body", "body": KEEPALIVE_COMMENT,
                                "more_body": True})
                    stream.last_write = trio.current_time()
                elif due:
                    stream.last_write = trio.current_time()  # nothing to keep alive yet


def _took(lock: trio.Lock) -> bool:
    """Take ``lock`` without a checkpoint if it is free; whether it was taken."""
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        return False
    return True


@dataclass
class _Stream:
    lock: trio.Lock
    last_write: float
    sse: bool = False
    ended: bool = False
