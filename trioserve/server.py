"""Serving the app over TCP with a connection cap and JSON bodies on HTTP parser errors.

``serve`` is what ``trioserve serve`` and the in-process test server run. It is
hypercorn's trio server with one change of layer: trioserve owns the accept loop, so it
can cap the connections served at once. Hypercorn has no such setting, and its
``hypercorn.trio.serve`` builds its listeners and accept loop internally. So ``serve``
runs the same parts hypercorn's trio worker runs — ``Lifespan`` for startup/shutdown,
``TCPServer`` for each connection (HTTP/1.1 and h2c parsing, keep-alive, graceful close)
— and accepts connections itself:

* **Connection cap.** Before each ``accept()`` the loop takes a slot of a
  ``trio.Semaphore(max_connections)``; the connection's task gives it back when the
  connection closes. At the cap the server stops accepting: new connections wait in the
  kernel's listen backlog (``backlog``) and are served as slots free up — no file
  descriptor or task is spent on them meanwhile. Hypercorn closes idle keep-alive
  connections after ``keep_alive_timeout``, which frees slots held by idle clients.
* **Shutdown** (``shutdown_trigger`` returns): listeners close at once, idle keep-alive
  connections close, in-flight requests get ``graceful_timeout`` seconds, then the
  lifespan shutdown runs (which stops the model worker).

The bare ``hypercorn trioserve.app:app`` entry point runs hypercorn's own accept loop,
where no cap applies (spec §17).

``install_protocol_error_bodies`` gives the responses of hypercorn's HTTP/1.1 parser
errors (400 malformed request, 431 headers too large, 501 unsupported transfer coding)
the JSON error envelope instead of an empty body; see its docstring for how and why.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
from itertools import chain
from typing import Any, Awaitable, Callable

import h11
import trio
from hypercorn.config import Config
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr, wrap_app

from .guard import protocol_error

log = logging.getLogger("trioserve.server")

# accept() errors that mean "out of resources now", not "this listener is broken": wait
# and retry instead of crashing the server (the same set trio.serve_listeners retries).
_RETRYABLE_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


async def serve(app: Any, config: Config, *, max_connections: int,
                shutdown_trigger: Callable[[], Awaitable[Any]],
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on ``config.bind`` (plain TCP) until ``shutdown_trigger``
    returns; ``task_status`` gets the bound URLs once listening (``["http://host:port"]``).

    Cancellation: cancelling the caller cancels every connection and the lifespan at once
    (no graceful phase); use ``shutdown_trigger`` for an orderly stop.
    """
    if config.ssl_enabled:
        raise ValueError("trioserve's server does not terminate TLS; put a TLS proxy in front")
    install_protocol_error_bodies()
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)
    slots = trio.Semaphore(max_connections)

    async def serve_connection(stream: trio.SocketStream) -> None:
        try:
            await TCPServer(asgi, config, context, lifespan_state.copy(), stream)
        finally:
            slots.release()
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        sockets = config.create_sockets().insecure_sockets
        listeners = []
        binds = []
        for sock in sockets:
            sock.listen(config.backlog)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(sock)))
            binds.append(f"http://{repr_socket_addr(sock.family, sock.getsockname())}")
        async with trio.open_nursery() as connections:
            try:
                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(_accept_loop, listener, slots, connections,
                                             serve_connection, max_connections)
                    log.info("listening on %s (at most %d connections)", ", ".join(binds),
                             max_connections)
                    task_status.started(binds)
                    await shutdown_trigger()
                    accepting.cancel_scope.cancel()
            finally:
                for listener in listeners:
                    await trio.aclose_forcefully(listener)
                # Idle keep-alive connections watch `terminated` and close; in-flight
                # requests get the graceful timeout.
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + config.graceful_timeout
        await lifespan.wait_for_shutdown()
        lifespan_nursery.cancel_scope.cancel()


async def _accept_loop(listener: trio.SocketListener, slots: trio.Semaphore,
                       nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]],
                       max_connections: int) -> None:
    """Accept forever, one connection per free slot (the handler releases the slot)."""
    at_cap = False  # log once per stretch of time spent at the cap
    while True:
        try:
            slots.acquire_nowait()
            at_cap = False
        except trio.WouldBlock:
            if not at_cap:
                log.warning("connection limit reached (%d open): new connections wait in the "
                            "listen backlog", max_connections)
                at_cap = True
            await slots.acquire()
        try:
            stream = await listener.accept()
        except OSError as exc:
            slots.release()
            if exc.errno not in _RETRYABLE_ACCEPT_ERRORS:
                raise
            log.error("accept() failed (%s): retrying in 0.1 s", errno.errorcode.get(exc.errno, exc.errno))
            await trio.sleep(0.1)
            continue
        except BaseException:
            slots.release()
            raise
        nursery.start_soon(handler, stream)


def bind_address(host: str, port: int) -> str:
    """hypercorn's bind syntax: IPv6 literals go in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


# -- JSON bodies for HTTP parser errors ------------------------------------------------

_original_send_error_response = H11Protocol._send_error_response


async def _send_json_error_response(self: H11Protocol, status_code: int) -> None:
    body = json.dumps(protocol_error(status_code).envelope(), separators=(",", ":")).encode()
    await self._send_h11_event(h11.Response(
        status_code=status_code,
        headers=list(chain(
            [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
             (b"connection", b"close")],
            self.config.response_headers("h11")))))
    await self._send_h11_event(h11.Data(data=body))
    await self._send_h11_event(h11.EndOfMessage())


def install_protocol_error_bodies() -> bool:
    """Make hypercorn's HTTP/1.1 parser errors answer with the JSON error envelope.

    When h11 cannot parse a request, hypercorn answers from
    ``H11Protocol._send_error_response(status)`` with ``content-length: 0`` — before any
    ASGI app runs, so no middleware can change it, and hypercorn has no setting for it.
    The only way short of a fork is to replace that one private method; this does it,
    process-wide and idempotently, keeping its behaviour (status, ``connection: close``,
    hypercorn's standard headers) and adding ``content-type: application/json`` and the
    body. It checks that the method still has the signature this was written against
    (hypercorn 0.17–0.18) and otherwise leaves hypercorn alone and returns False (the
    tests then fail loudly rather than the server breaking).
    """
    current = H11Protocol._send_error_response
    if current is _send_json_error_response:
        return True
    params = list(inspect.signature(_original_send_error_response).parameters)
    if current is not _original_send_error_response or params != ["self", "status_code"] \
            or not hasattr(H11Protocol, "_send_h11_event"):
        log.warning("hypercorn's HTTP error path is not the one trioserve knows: parser "
                    "errors keep hypercorn's empty bodies")
        return False
    H11Protocol._send_error_response = _send_json_error_response  # type: ignore[method-assign]
    return True


__all__ = ["bind_address", "install_protocol_error_bodies", "serve"]
