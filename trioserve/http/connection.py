"""One client connection, isolated: whatever it sends ends at most that connection.

``IsolatedTCPServer`` is hypercorn's trio connection handler (``TCPServer``: HTTP/1.1 and
h2c parsing, keep-alive, graceful close) with its socket I/O replaced. hypercorn 0.18's
handler lets several tasks write one socket: the request's app task answers while the
reading task answers a parser error, and ``send_eof`` runs outside the send lock. Two
writers on one ``trio.SocketStream`` raise ``trio.BusyResourceError``, which escapes the
handler and, under both ``trio.serve_listeners`` and trioserve's accept loop, stops the
whole server (found by a hostile test: a 70-byte request with a bad chunk to ``/health`` did it). Here:

* **One writer task per connection.** Every byte, the EOF and the close go through one
  channel to one task (``_write_loop``), in order; nothing else touches the socket's send
  side while it holds bytes. A send that the client does not take within
  ``SEND_TIMEOUT_S`` closes the connection. After the close, further sends are dropped
  (the protocol sees ``Closed``). The one shortcut: while the writer holds nothing, bytes
  the kernel takes at once are written by the sending task itself, without waiting
  (``_write_now``): a streamed token costs one ``send`` instead of a hand-over to another
  task and two trips through the scheduler; whatever the socket does not take goes to the
  writer as before, so order, the timeout and backpressure (a sender waits while the
  writer holds bytes, which is what coalesces a slow client's stream) are unchanged.
* **Failures end the connection only.** An exception from the protocol or the app's
  tasks is logged with its traceback, answered with a 500 envelope if no response has
  started, and ends this connection; it never leaves ``run``.
* **Requests must arrive at a minimum rate.** From the moment a connection waits for a
  request (opened, or idle after a response) its bytes must arrive by
  ``REQUEST_GRACE_S + bytes_so_far / MIN_RECEIVE_RATE`` seconds; a request that falls
  behind is answered ``408 request_timeout`` (when still possible) and the connection is
  closed. A large body sent at a normal speed is never cut; one byte every few seconds is.
* **Evictable while waiting.** ``waiting_since`` says since when the connection has been
  waiting for a complete request (None while one is being served), ``behind_receive_rate``
  whether its bytes are arriving slower than ``MIN_RECEIVE_RATE``; the accept loop of
  ``trioserve serve`` closes such connections to make room for new ones at the connection
  cap (``server.py``). ``evict()`` ends it. Over HTTP/2 the connection waits while none of
  its streams is being answered (``h2_guard.GuardedH2Protocol.waiting_since``); there the
  receive rate is each stream's, held by the route that reads its body (``route_support``).
  A WebSocket handshake is being answered until the connection closes after its answer.
* **Every connection ends.** When the connection is cancelled (evicted, or still open past
  the drain timeout at shutdown) every send waiting on it ends at once, shielded or not:
  the writer's channel is closed, and so is every HTTP/2 stream buffer (``_end_all_sends``);
  otherwise a shielded last send waiting for a client's flow-control window kept the
  connection's task, its slot and the server's shutdown forever (found by a hostile test).

The handler relies on hypercorn internals (``TCPServer``'s method names and constructor,
``H11Protocol.connection``/``_send_error_response``): ``check_hypercorn_internals`` verifies
them and raises when they differ, so a hypercorn upgrade fails loudly at startup instead
of serving without isolation. Verified with hypercorn 0.18.0, h11 0.16.0, trio 0.35.0.
``install_in_hypercorn_worker`` puts the handler into hypercorn's own trio worker, for
``hypercorn trioserve.app:app --worker-class trio``.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from typing import Any

import h11
import trio
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.trio import run as hypercorn_trio_run
from hypercorn.trio.tcp_server import MAX_RECV, TCPServer

from trioserve.http.chunked_body import install_chunked_body_fast_path
from trioserve.http.h2_guard import GuardedH2Protocol, install_h2_guard
from trioserve.http.websocket import install_websocket_guard

log = logging.getLogger("trioserve.http.connection")

VERIFIED_WITH = "hypercorn 0.18.0, h11 0.16.0, trio 0.35.0"

# A client that takes no bytes of a response for this long is gone (or hostile).
SEND_TIMEOUT_S = 30.0
# A request (head and body) must arrive within this grace plus its size at MIN_RECEIVE_RATE.
REQUEST_GRACE_S = 10.0
MIN_RECEIVE_RATE = 4096  # bytes per second, averaged over the whole request
# How long a 408/500 answer may take to write before the connection is simply closed.
LAST_WORDS_TIMEOUT_S = 2.0

_WAITING_STATES = (h11.IDLE, h11.SEND_BODY)


class IsolatedTCPServer(TCPServer):
    """hypercorn's ``TCPServer`` with one writer task, failure isolation and a receive rate
    (module docstring). Constructed and awaited like ``TCPServer``.

    Cancellation: cancelling ``run`` (or ``evict()``) closes the socket at once; the
    connection's app tasks are cancelled with it.
    """

    def __init__(self, app: Any, config: Any, context: Any, state: Any, stream: Any) -> None:
        super().__init__(app, config, context, state, stream)
        self._outbox, self._outbox_reader = trio.open_memory_channel[bytes](0)
        self._writer_done = trio.Event()
        self._scope = trio.CancelScope()
        # Since when this connection waits for a complete request (trio clock), and how
        # many bytes of it arrived; None while a request is being answered (the property
        # `waiting_since`; over HTTP/2 the protocol's).
        self._waiting_since: float | None = trio.current_time()
        self._received = 0
        self.evicted = False
        self.peer = _peer_of(stream)
        self._response_progress = trio.Event()  # set whenever the protocol sends something
        self._reader_task: trio.lowlevel.Task | None = None
        # The socket's fd for _write_now (plain TCP only: TLS bytes need the SSL stream),
        # -1 once the outbox closed; bytes handed to the writer and not yet written.
        self._direct_fd = stream.socket.fileno() if isinstance(stream, trio.SocketStream) else -1
        self._handed_over = 0

    # -- lifetime ----------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until it closes; never raises (but Cancelled)."""
        with self._scope:
            try:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._write_loop)
                    watching = trio.CancelScope()
                    nursery.start_soon(self._end_sends_when_cancelled, watching)
                    try:
                        await super().run()
                    finally:
                        watching.cancel()
                        self._direct_fd = -1
                        self._outbox.close()  # the writer flushes what it holds, then closes
            except BaseException as exc:
                # Only Cancelled (and KeyboardInterrupt & co.) may leave: the caller's accept
                # loop must never see a connection's own failure.
                reraise_unless_connection_failure(exc, self.peer)
            finally:
                await trio.aclose_forcefully(self.stream)

    async def _end_sends_when_cancelled(self, watching: trio.CancelScope) -> None:
        """Sleep while the connection lives; once cancelled (evicted, shutdown past the drain
        timeout) or ended, end every send still waiting on it (``_end_all_sends``), so that
        no task of the connection outlives it waiting for bytes to leave."""
        with watching:
            try:
                await trio.sleep_forever()
            finally:
                with trio.CancelScope(shield=True):  # nothing in it blocks
                    await self._end_all_sends()

    async def _end_all_sends(self) -> None:
        """Make every send waiting on this connection return: a sender waiting for the writer
        gets ``ClosedResourceError`` (the protocol then sees ``Closed``), and every HTTP/2 stream
        buffer is closed. Never blocks."""
        self._direct_fd = -1
        self._outbox.close()
        h2 = self._h2_protocol()
        if h2 is not None:
            await h2.end_all_sends()

    @property
    def waiting_since(self) -> float | None:
        """Since when this connection waits for a complete request (trio clock); None while
        one is being answered. Over HTTP/2: since when none of its streams is being answered
        (the protocol keeps it; a new wait counts its bytes anew)."""
        h2 = self._h2_protocol()
        if h2 is not None and h2.waiting_since != self._waiting_since:
            self._waiting_since, self._received = h2.waiting_since, 0
        return self._waiting_since

    @waiting_since.setter
    def waiting_since(self, value: float | None) -> None:
        self._waiting_since = value

    def behind_receive_rate(self, now: float) -> bool:
        """Whether this connection waits for a request and its bytes so far arrived slower
        than ``MIN_RECEIVE_RATE`` on average (an idle keep-alive connection has received
        nothing: it is behind). A request being sent at a normal speed is not."""
        if self.waiting_since is None:
            return False
        return self._received < (now - self.waiting_since) * MIN_RECEIVE_RATE

    def evict(self) -> None:
        """End this connection now (it is waiting for a request: nothing is lost)."""
        self.evicted = True
        self._scope.cancel()


    # -- the send side: one task -------------------------------------------------------

    async def _write_loop(self) -> None:
        """The only task that writes the socket: bytes in order, then EOF and close."""
        try:
            async for data in self._outbox_reader:
                with trio.fail_after(SEND_TIMEOUT_S):
                    await self.stream.send_all(data)
                self._handed_over -= 1
            with trio.move_on_after(SEND_TIMEOUT_S):
                await self.stream.send_eof()
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.TooSlowError,
                AttributeError):  # AttributeError: an SSL stream has no send_eof
            pass
        except Exception:
            log.warning("connection %s: writing failed", self.peer, exc_info=True)
        finally:
            self._direct_fd = -1
            self._outbox_reader.close()  # later sends fail at once instead of waiting
            try:
                await trio.aclose_forcefully(self.stream)  # also wakes the reading task
            finally:  # (aclose_forcefully re-raises Cancelled when evicted)
                self._writer_done.set()

    async def protocol_send(self, event: Any) -> None:
        try:
            await self._protocol_send(event)
        finally:
            self._response_progress.set()  # the reader may be waiting for the response

    async def _protocol_send(self, event: Any) -> None:
        if isinstance(event, RawData):
            data = event.data
            if self._handed_over == 0 and self._direct_fd >= 0:
                data = self._write_now(data)
                if not data:
                    return
            try:
                # Shielded as in hypercorn: h11 has already counted these bytes as sent, so
                # a cancelled sender must not drop them. Bounded: the writer takes the next
                # item within SEND_TIMEOUT_S or closes the channel.
                self._handed_over += 1
                with trio.CancelScope(shield=True):
                    await self._outbox.send(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                await self.protocol.handle(Closed())
        else:
            if isinstance(event, Closed) and trio.lowlevel.current_task() is self._reader_task:
                await self._let_response_finish()
            if isinstance(event, Updated) and event.idle and self._h2_protocol() is None:
                # Between two requests on a keep-alive connection: waiting for the next.
                # (HTTP/2 keeps its own: h2_guard.)
                self.waiting_since = trio.current_time()
                self._received = 0
            await super().protocol_send(event)  # Closed → self._close(); Updated → idle timer

    def _write_now(self, data: bytes) -> bytes:
        """Write what the socket takes without blocking; the rest (``b""``: all written).
        Only while the writer holds nothing (module docstring), so bytes stay in order.
        A failing socket is left to the writer, which meets the same error and closes."""
        try:
            written = os.write(self._direct_fd, data)
        except OSError:  # BlockingIOError (buffer full), or the connection is broken
            return data
        return data[written:] if written < len(data) else b""

    async def _let_response_finish(self) -> None:
        """Before the reading task closes the connection for bytes h11 refuses (after a
        request whose response says ``Connection: close``, or garbage after a complete
        request), let the response already started be written whole (bounded): otherwise
        a 400 for an ambiguous request, say, would lose its body."""
        with trio.move_on_after(SEND_TIMEOUT_S):
            while (states := self._h11_states()) is not None and states[0] is h11.SEND_BODY:
                self._response_progress = trio.Event()
                await self._response_progress.wait()

    async def _close(self) -> None:
        """Flush what was sent, then EOF and close (by the writer); wait for it (bounded)."""
        self._direct_fd = -1
        self._outbox.close()
        with trio.CancelScope(shield=True), trio.move_on_after(SEND_TIMEOUT_S + 1):
            await self._writer_done.wait()

    async def _initiate_server_close(self) -> None:
        await self.protocol.handle(Closed())
        await self._close()

    # -- the receive side --------------------------------------------------------------

    async def _read_data(self) -> None:
        self._reader_task = trio.lowlevel.current_task()
        try:
            while True:
                try:
                    with trio.fail_at(self._receive_deadline()):
                        data = await self.stream.receive_some(MAX_RECV)
                except (trio.ClosedResourceError, trio.BrokenResourceError):
                    break
                except trio.TooSlowError:
                    log.info("connection %s: request not received in time (%d bytes in %.1f s)",
                             self.peer, self._received, trio.current_time() - (self.waiting_since or 0))
                    await self._last_words(408)
                    break
                if self.waiting_since is not None:  # (a new HTTP/2 wait first resets the count)
                    self._received += len(data)
                await self.protocol.handle(RawData(bytes(data)))
                self._track_request_state()
                if not data:
                    break
            await self.protocol.handle(Closed())
            states = self._h11_states()
            if states is not None and states[0] not in (h11.SEND_RESPONSE, h11.SEND_BODY):
                # The client is done sending and no response is under way: close now
                # rather than hold the connection for the keep-alive timeout.
                await self.idle_task.stop()
                await self._close()
        except Exception:
            # A failure of the protocol on this connection's input: answer if no response
            # started, then let run() log it and end the connection.
            await self._last_words(500)
            raise

    def _receive_deadline(self) -> float:
        if self.waiting_since is None or self._h2_protocol() is not None:
            # A request is being answered; keep-alive has its own timer. Over HTTP/2 each
            # stream's body is held to the rate by the route that reads it (and an idle
            # connection closes on the keep-alive timer): closing the connection for one
            # slow stream would end the others.
            return math.inf
        return self.waiting_since + REQUEST_GRACE_S + self._received / MIN_RECEIVE_RATE

    def _track_request_state(self) -> None:
        """Update ``waiting_since`` from h11's states after the protocol consumed bytes (HTTP/2
        keeps its own; a WebSocket handshake is being answered)."""
        if self._h2_protocol() is not None:
            return
        states = self._h11_states()
        waiting = states is not None and states[1] in _WAITING_STATES and states[0] is not h11.SEND_BODY
        if not waiting:
            self.waiting_since = None
        elif self.waiting_since is None:  # a new request begins (keep-alive)
            self.waiting_since = trio.current_time()
            self._received = 0

    def _h2_protocol(self) -> GuardedH2Protocol | None:
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        return protocol if isinstance(protocol, GuardedH2Protocol) else None

    def _h11_states(self) -> tuple[Any, Any] | None:
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        connection = getattr(protocol, "connection", None)
        if isinstance(connection, h11.Connection):
            return connection.our_state, connection.their_state
        return None  # h2, websocket: not tracked

    async def _last_words(self, status: int) -> None:
        """Answer ``status`` (JSON envelope, ``Connection: close``) if no response started."""
        protocol = getattr(getattr(self, "protocol", None), "protocol", None)
        states = self._h11_states()
        if not isinstance(protocol, H11Protocol) or states is None or states[0] not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(LAST_WORDS_TIMEOUT_S):
                await protocol._send_error_response(status)
        except Exception:  # the connection is beyond answering; closing is all that is left
            log.debug("connection %s: could not answer %d", self.peer, status, exc_info=True)


def _peer_of(stream: Any) -> str:
    try:
        socket = getattr(stream, "socket", None) or stream.transport_stream.socket
        host, port = socket.getpeername()[:2]
        return f"{host}:{port}"
    except Exception:  # already closed, or not an IP socket
        return "?"


def reraise_unless_connection_failure(exc: BaseException, peer: str) -> None:
    """Log a connection's own failure (any Exception, also inside exception groups) and
    swallow it; re-raise what must propagate (Cancelled, KeyboardInterrupt, SystemExit)."""
    if isinstance(exc, BaseExceptionGroup):
        failures, rest = exc.split(Exception)
        if failures is not None:
            log.warning("connection %s ended by an unexpected error", peer, exc_info=failures)
        if rest is not None:
            raise rest
        return
    if isinstance(exc, Exception):
        log.warning("connection %s ended by an unexpected error", peer, exc_info=exc)
        return
    raise exc


# -- hypercorn's internals this relies on -------------------------------------------------

def check_hypercorn_internals() -> None:
    """Raise RuntimeError if hypercorn's trio connection handler is not the one
    ``IsolatedTCPServer`` was written against (see ``VERIFIED_WITH``)."""
    problems = []
    params = list(inspect.signature(TCPServer.__init__).parameters)
    if params != ["self", "app", "config", "context", "state", "stream"]:
        problems.append(f"TCPServer.__init__{params}")
    for name in ("run", "protocol_send", "_close", "_read_data", "_initiate_server_close",
                 "_idle_timeout"):
        if not inspect.iscoroutinefunction(getattr(TCPServer, name, None)):
            problems.append(f"TCPServer.{name}")
    source = inspect.getsource(TCPServer)
    for needle in ("await self._read_data()", "await self._close()", "self._initiate_server_close()"):
        if needle not in source:
            problems.append(f"TCPServer: {needle!r}")
    if not inspect.iscoroutinefunction(getattr(H11Protocol, "_send_error_response", None)):
        problems.append("H11Protocol._send_error_response")
    if "self.connection" not in inspect.getsource(H11Protocol.__init__):
        problems.append("H11Protocol.connection")
    if getattr(hypercorn_trio_run, "TCPServer", None) not in (TCPServer, IsolatedTCPServer):
        problems.append("hypercorn.trio.run.TCPServer")
    # server.install_in_hypercorn_worker caps connections by giving this module a `trio`
    # whose serve_listeners is trioserve's accept loop.
    worker_source = inspect.getsource(getattr(hypercorn_trio_run, "worker_serve", lambda: None))
    for needle in ("trio.serve_listeners,", "handler_nursery=server_nursery"):
        if needle not in worker_source:
            problems.append(f"hypercorn.trio.run.worker_serve: {needle!r}")
    if getattr(getattr(hypercorn_trio_run, "trio", None), "__name__", None) != "trio":
        problems.append("hypercorn.trio.run.trio")
    if problems:
        raise RuntimeError(
            "trioserve's connection isolation does not match the installed hypercorn "
            f"(verified with {VERIFIED_WITH}); changed: {', '.join(problems)}. Install a "
            "verified hypercorn version.")


def install_in_hypercorn_worker() -> None:
    """Make hypercorn's own trio worker (``hypercorn … --worker-class trio``) serve each
    connection with ``IsolatedTCPServer``; idempotent. Raises RuntimeError (via
    ``check_hypercorn_internals``) when hypercorn is not a verified version."""
    check_hypercorn_internals()
    hypercorn_trio_run.TCPServer = IsolatedTCPServer  # type: ignore[misc]
    install_h2_guard()  # HTTP/2 streams bounded per connection there too
    install_websocket_guard()  # one answer per WebSocket handshake
    install_chunked_body_fast_path()


__all__ = ["IsolatedTCPServer", "VERIFIED_WITH", "check_hypercorn_internals",
           "install_in_hypercorn_worker", "reraise_unless_connection_failure"]
