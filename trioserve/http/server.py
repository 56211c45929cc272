"""Serving the app over TCP with a connection cap and JSON bodies on HTTP parser errors.

``serve`` is what ``trioserve serve`` and the in-process test server run. It is
hypercorn's trio server with one change of layer: trioserve owns the accept loop, so it
can cap the connections served at once. Hypercorn has no such setting, and its
``hypercorn.trio.serve`` builds its listeners and accept loop internally. So ``serve``
runs the same parts hypercorn's trio worker runs — ``Lifespan`` for startup/shutdown, and
for each connection ``connection.IsolatedTCPServer`` (hypercorn's ``TCPServer`` with one
writer task and failure isolation: a connection's failure never reaches the accept loop)
— and accepts connections itself:

* **Connection cap.** Before each ``accept()`` the loop takes a slot of a
  ``trio.Semaphore(max_connections)``; the connection's task gives it back when the
  connection closes. At the cap new connections wait in the kernel's listen backlog
  (``backlog``), and while one waits there a connection waiting for a complete request
  is closed to make room: one whose bytes arrive slower than the minimum receive rate
  after a quarter of a second, any after a second (``eviction_victim``). The cap is checked
  against ``RLIMIT_NOFILE`` at startup (``fit_fd_limit``).
* **Shutdown** (``shutdown_trigger`` returns): listeners close at once, idle keep-alive
  connections close, in-flight requests get ``graceful_timeout`` seconds, then the
  lifespan shutdown runs (which stops the model worker).

The bare ``hypercorn trioserve.app:app`` entry point runs hypercorn's own trio worker:
``install_in_hypercorn_worker`` (called when ``app.py`` is imported) puts
``IsolatedTCPServer`` into it and makes its ``trio.serve_listeners`` call accept through
``accept_capped``, so the cap, the eviction and the open-file check apply there too.

``install_protocol_error_bodies`` gives the responses of hypercorn's HTTP/1.1 parser
errors (400 malformed request, 431 headers too large, 501 unsupported transfer coding)
the JSON error envelope instead of an empty body, and so the answers to WebSocket handshakes
hypercorn itself finds invalid; see its docstring for how and why.
"""

from __future__ import annotations

import errno
import gc
import inspect
import json
import logging
import resource
import select
import time
import types
from itertools import chain
from typing import Any, Awaitable, Callable, Iterable, Sequence

import h11
import trio
from hypercorn.config import Config
from hypercorn.protocol.events import Body, EndBody, Response, StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.ws_stream import WSStream
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.utils import repr_socket_addr, wrap_app

from trioserve.http import connection as connection_module
from trioserve.http.connection import IsolatedTCPServer, check_hypercorn_internals, reraise_unless_connection_failure
from trioserve.http.guard import protocol_error, websocket_protocol_error
from trioserve.http.chunked_body import install_chunked_body_fast_path
from trioserve.http.h2_guard import install_h2_guard
from trioserve.http.websocket import install_websocket_guard

log = logging.getLogger("trioserve.http.server")

# accept() errors that mean "out of resources now", not "this listener is broken": wait
# and retry instead of crashing the server (the same set trio.serve_listeners retries).
_RETRYABLE_ACCEPT_ERRORS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


async def serve(app: Any, config: Config, *, max_connections: int,
                shutdown_trigger: Callable[[], Awaitable[Any]], freeze_heap: bool = False,
                task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve the ASGI ``app`` on ``config.bind`` (plain TCP) until ``shutdown_trigger``
    returns; ``task_status`` gets the bound URLs once listening (``["http://host:port"]``).

    ``freeze_heap``: once the app has started, keep what it holds out of the garbage
    collector's passes (``freeze_startup_heap``). For a process that serves and does nothing
    else; a test process would freeze its own fixtures with it.

    ``max_connections`` may be lowered to what ``RLIMIT_NOFILE`` allows (``fit_fd_limit``).
    Raises RuntimeError before listening if hypercorn is not a version the connection
    isolation was verified with (``connection.check_hypercorn_internals``).

    Cancellation: cancelling the caller cancels every connection and the lifespan at once
    (no graceful phase); use ``shutdown_trigger`` for an orderly stop.
    """
    if config.ssl_enabled:
        raise ValueError("trioserve's server does not terminate TLS; put a TLS proxy in front")
    check_hypercorn_internals()
    install_protocol_error_bodies()
    install_h2_guard()  # HTTP/2 streams bounded per connection (h2_guard.py)
    install_websocket_guard()  # one answer per WebSocket handshake (websocket.py)
    install_chunked_body_fast_path()  # streamed chunks framed without h11 (chunked_body.py)
    max_connections = fit_fd_limit(max_connections)
    asgi = wrap_app(app, config.wsgi_max_body_size, "asgi")
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(asgi, config, lifespan_state)
    context = WorkerContext(None)

    def new_connection(stream: trio.SocketStream) -> IsolatedTCPServer:
        return IsolatedTCPServer(asgi, config, context, lifespan_state.copy(), stream)

    async with trio.open_nursery() as lifespan_nursery:
        await lifespan_nursery.start(lifespan.handle_lifespan)
        await lifespan.wait_for_startup()
        if freeze_heap:
            freeze_startup_heap()
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
                    accepting.start_soon(accept_capped, listeners, new_connection, connections,
                                         max_connections)
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


def freeze_startup_heap() -> None:
    """Move every object alive after start-up (modules, settings, templates, pydantic's
    validators: ~74,000 on the default model) out of the garbage collector's reach.

    They live as long as the server, yet each full collection walked all of them: 60-110 ms
    with every task stopped, 12-22 steps of a fleet decoding at 200 tok/s (docs/benchmarks.md,
    "The garbage collector's pause"). Frozen objects are never collected, so only what
    start-up keeps is frozen, once; cycles created later are collected as usual.
    """
    gc.collect()
    gc.freeze()
    log.info("start-up heap frozen: %d objects kept out of the garbage collector's passes",
             gc.get_freeze_count())


async def accept_capped(listeners: Sequence[trio.abc.Listener[Any]],
                        new_connection: Callable[[Any], IsolatedTCPServer],
                        connections: trio.Nursery, max_connections: int) -> None:
    """Accept on every listener until cancelled, serving each connection
    (``new_connection(stream)``, run in ``connections``) while at most ``max_connections``
    are open (the cap and eviction: ``_accept_loop``, ``_wait_for_slot``).

    A connection's failure ends that connection only. Cancellation stops accepting;
    connections already open live on in ``connections`` (the caller bounds them).
    """
    slots = trio.Semaphore(max_connections)
    live: set[IsolatedTCPServer] = set()

    async def serve_connection(stream: Any) -> None:
        # Never raises but Cancelled: a connection's failure ends that connection only.
        connection = None
        try:
            connection = new_connection(stream)
            live.add(connection)
            await connection.run()
        except BaseException as exc:
            reraise_unless_connection_failure(exc, connection.peer if connection else "?")
        finally:
            live.discard(connection)  # type: ignore[arg-type]
            slots.release()
            await trio.aclose_forcefully(stream)

    async with trio.open_nursery() as accepting:
        for listener in listeners:
            accepting.start_soon(_accept_loop, listener, slots, live, connections,
                                 serve_connection, max_connections)


# At the cap, while a newcomer waits in the listen backlog, a connection waiting for its
# request may be closed to make room: after EVICT_SLOW_AFTER_S when its bytes arrive slower
# than connection.MIN_RECEIVE_RATE (idle keep-alive, a trickled body), else after
# EVICT_AFTER_S (a client uploading at a normal speed gets a second to finish).
EVICT_SLOW_AFTER_S = 0.25
EVICT_AFTER_S = 1.0
# How often a full accept loop looks for a newcomer in the backlog and an evictable connection.
EVICTION_POLL_S = 0.1


async def _accept_loop(listener: trio.abc.Listener[Any], slots: trio.Semaphore,
                       live: set[IsolatedTCPServer], nursery: trio.Nursery,
                       handler: Callable[[trio.SocketStream], Awaitable[None]],
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
                            "listen backlog; connections waiting for a request are closed to "
                            "make room for them", max_connections)
                at_cap = True
            await _wait_for_slot(listener, slots, live)
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


async def _wait_for_slot(listener: trio.abc.Listener[Any], slots: trio.Semaphore,
                         live: set[IsolatedTCPServer]) -> None:
    """Take a slot at the cap: wait for one to free up, and meanwhile, whenever a newcomer
    waits in the listen backlog, evict a connection waiting for a complete request (an idle
    keep-alive connection, or one that trickles its request in; ``eviction_victim``).
    Connections whose request is being answered are never evicted. So clients that hold
    connections without sending requests cannot lock out one that sends its request at
    once (found by a hostile test: 300 slow-body connections)."""
    while True:
        if _has_pending_connection(listener):
            now = trio.current_time()
            victim = eviction_victim(live, now)
            if victim is not None:
                log.info("connection limit: closing %s (waiting %.1f s for a request, %s) for a "
                         "new connection", victim.peer, now - (victim.waiting_since or now),
                         "too slow" if victim.behind_receive_rate(now) else "still sending")
                victim.evict()  # its slot comes back as soon as its task has closed it
        with trio.move_on_after(EVICTION_POLL_S):
            await slots.acquire()
            return


def eviction_victim(live: Iterable[IsolatedTCPServer], now: float) -> IsolatedTCPServer | None:
    """The connection to close for a newcomer at the cap, or None: among those waiting for a
    request, the longest-waiting one that is behind the receive rate for at least
    ``EVICT_SLOW_AFTER_S``, else the longest-waiting one for at least ``EVICT_AFTER_S``."""
    waiting = [c for c in live if c.waiting_since is not None and not c.evicted]
    slow = [c for c in waiting
            if now - (c.waiting_since or now) >= EVICT_SLOW_AFTER_S and c.behind_receive_rate(now)]
    candidates = slow or [c for c in waiting if now - (c.waiting_since or now) >= EVICT_AFTER_S]
    return min(candidates, key=lambda c: c.waiting_since or 0.0, default=None)


def _has_pending_connection(listener: trio.abc.Listener[Any]) -> bool:
    """Whether a connection waits in ``listener``'s backlog (a zero-timeout poll); False
    for a listener without a socket of its own to poll (TLS: its transport's is polled)."""
    sock = getattr(listener, "socket", None)
    if sock is None:
        sock = getattr(getattr(listener, "transport_listener", None), "socket", None)
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


# -- the same cap under ``hypercorn trioserve.app:app --worker-class trio`` -----------------

class _TrioWithCappedAccept(types.ModuleType):
    """``trio`` as hypercorn's trio worker module sees it once ``install_in_hypercorn_worker``
    ran: trio itself, except that ``serve_listeners`` accepts through :func:`accept_capped`
    (the cap, the eviction and the open-file check of ``trioserve serve``)."""

    def __init__(self, max_connections: Callable[[], int]) -> None:
        super().__init__("trio")
        self.max_connections = max_connections

    def __getattr__(self, name: str) -> Any:
        return getattr(trio, name)

    async def serve_listeners(self, handler: Callable[[Any], Any], listeners: Sequence[Any], *,
                              handler_nursery: trio.Nursery | None = None,
                              task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        # hypercorn passes partial(TCPServer, app, config, context, state): with
        # IsolatedTCPServer installed as its TCPServer, handler(stream) is one connection.
        cap = fit_fd_limit(self.max_connections())
        log.info("accepting at most %d connections", cap)
        async with trio.open_nursery() as own:
            task_status.started(listeners)
            await accept_capped(listeners, handler, handler_nursery or own, cap)


def install_in_hypercorn_worker(max_connections: Callable[[], int]) -> None:
    """Make hypercorn's own trio worker (``hypercorn … --worker-class trio``) serve each
    connection with ``IsolatedTCPServer`` and accept under the connection cap
    (``max_connections()``, read when it starts listening), as ``serve`` does. Idempotent.
    Raises RuntimeError when hypercorn is not a verified version
    (``connection.check_hypercorn_internals``: it also checks that hypercorn's worker accepts
    through ``trio.serve_listeners`` with a handler nursery)."""
    connection_module.install_in_hypercorn_worker()
    current = hypercorn_trio_run.trio
    if isinstance(current, _TrioWithCappedAccept):
        current.max_connections = max_connections
    else:
        hypercorn_trio_run.trio = _TrioWithCappedAccept(max_connections)  # type: ignore[attr-defined]


# -- RLIMIT_NOFILE -----------------------------------------------------------------------

# File descriptors the server needs besides one per connection: listeners, the worker's
# pipes, the model file, logs, Python's and the libraries' own, with room for restarts.
FDS_RESERVED = 64


def plan_fd_limit(soft: int, hard: int, max_connections: int) -> tuple[int, int]:
    """``(soft limit to set, connection cap to use)`` for the current RLIMIT_NOFILE.

    Enough: unchanged. Too low: raise the soft limit as far as the hard one allows; if
    that is still short, lower the cap to what fits (at least 1).
    """
    need = max_connections + FDS_RESERVED
    if soft == resource.RLIM_INFINITY or soft >= need:
        return soft, max_connections
    new_soft = need if hard == resource.RLIM_INFINITY else min(hard, need)
    new_soft = max(new_soft, soft)
    return new_soft, max(1, min(max_connections, new_soft - FDS_RESERVED))


def fit_fd_limit(max_connections: int) -> int:
    """Check RLIMIT_NOFILE against the connection cap at startup (plan_fd_limit): raise
    the soft limit if needed and possible, else lower the cap; log what was done. Returns
    the cap to use. Why: a server out of file descriptors cannot even restart its worker
    (found by a hostile test: a crash at EMFILE became a crash loop)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    new_soft, cap = plan_fd_limit(soft, hard, max_connections)
    if new_soft != soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new_soft, hard))
            log.info("raised the open-file limit (RLIMIT_NOFILE) from %d to %d for %d "
                     "connections", soft, new_soft, max_connections)
        except (OSError, ValueError) as exc:
            log.warning("could not raise the open-file limit from %d: %s", soft, exc)
            new_soft, cap = soft, max(1, min(max_connections, soft - FDS_RESERVED))
    if cap < max_connections:
        log.warning("the open-file limit (RLIMIT_NOFILE %d, hard %d) is too low for %d "
                    "connections: serving at most %d at once (raise the limit with ulimit -n "
                    "to serve more)", new_soft, hard, max_connections, cap)
    return cap


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


_original_ws_send_error_response = WSStream._send_error_response


async def _send_json_ws_error_response(self: WSStream, status_code: int) -> None:
    # A WebSocket handshake hypercorn refuses itself (400: not a valid handshake, e.g. no
    # Sec-WebSocket-Key) never reaches the app; its answer gets the envelope too.
    body = json.dumps(websocket_protocol_error(status_code).envelope(), separators=(",", ":")).encode()
    await self.send(Response(
        stream_id=self.stream_id, status_code=status_code,
        headers=[(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                 (b"connection", b"close")]))
    await self.send(Body(stream_id=self.stream_id, data=body))
    await self.send(EndBody(stream_id=self.stream_id))
    await self.config.log.access(self.scope, {"status": status_code, "headers": []},
                                 time.time() - self.start_time)
    if self.app_put is None:
        # Refused before any app ran: hypercorn would leave the stream open, and with it
        # the connection (its "Connection: close" unhonoured) until the idle timeout. When
        # an app ran, its end closes the stream.
        await self.send(StreamClosed(stream_id=self.stream_id))


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
    ws_params = list(inspect.signature(_original_ws_send_error_response).parameters)
    if WSStream._send_error_response is _original_ws_send_error_response \
            and ws_params == ["self", "status_code"]:
        WSStream._send_error_response = _send_json_ws_error_response  # type: ignore[method-assign]
    return True


__all__ = ["accept_capped", "bind_address", "eviction_victim", "fit_fd_limit",
           "install_in_hypercorn_worker", "install_protocol_error_bodies", "plan_fd_limit", "serve"]
