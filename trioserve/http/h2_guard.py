"""HTTP/2 (h2c) streams bounded per connection: the rapid-reset mitigations (spec §17.2).

Over HTTP/2 one connection carries many requests (streams). The connection cap bounds
connections, not streams, and hypercorn starts an app task for every stream a client opens.
A client that opens a stream and resets it at once (RST_STREAM; CVE-2023-44487, "rapid
reset") frees its place in the advertised ``MAX_CONCURRENT_STREAMS`` immediately, so it can
make the server start thousands of requests a second on one connection while never having
more than one open: measured here, 400 such streams per connection at ~3,000 a second for
20 s left the server working off the backlog for minutes. The mitigations other servers
adopted, per connection:

* **Concurrent streams** are advertised and enforced at ``MAX_CONCURRENT_STREAMS`` (the h2
  library refuses more), and the app tasks still running for this connection's streams —
  also those of streams the client already reset, whose handlers are finishing — may not
  exceed twice that (the slack covers a handler still returning after its stream ended): a
  new stream beyond that ends the connection.
* **Resets** are a budget: ``RESET_BURST`` at once, refilled at ``RESETS_PER_S`` a second.
  Cancelling a request now and then costs nothing; a connection that resets faster ends.

One more fix of hypercorn's HTTP/2 handler: **data for an answered stream is drained.** A
response may be sent before the whole request body arrived (a 404 or 413 that needs no body);
hypercorn then forgets the stream, and the client's next DATA frame for it raised ``KeyError``
in the connection's reading task, which ended the connection with every other request on it. A
forgotten stream's data is now dropped and its flow-control credit handed back (or the
connection's window would shrink for the other streams), so the client finishes sending and
reads its answer. Dropped bytes are parsed, never buffered, and each restarts the keep-alive
timer: a connection whose client still uploads an answered body is not idle (before, a client
whose upload to a 404 path lasted past the 5 s timeout had the connection closed under it, and
never read the answer).

A connection that exceeds either bound gets ``GOAWAY`` with ``ENHANCE_YOUR_CALM`` and is closed at
once: the frames it still had in flight are never parsed, its streams' handlers are cancelled
(the client left), and other connections are not affected. A well-behaved client (one that
keeps within the advertised limit and cancels occasionally) never meets these limits.

**Every send ends** (found by a hostile test: an h2c client that set its flow-control window to 0,
asked for ``/health`` and closed, held its connection slot forever, and SIGTERM could not stop the
server). hypercorn's handler sends a response body through a per-stream buffer that its send task
empties as the client grants window; the handler's last send waits (shielded, ``AsgiWrapper``)
until the buffer is empty, and nothing woke it when the connection closed. Here:

* **A closed transport ends every waiting send**: when the connection closes (the client left,
  reset the socket, sent GOAWAY; or trioserve closed it) every stream buffer is closed, which
  wakes every handler waiting on one (``end_all_sends``; ``connection.IsolatedTCPServer`` also
  calls it when the connection is cancelled: evicted, or past the drain timeout at shutdown).
* **A response that gets no window is abandoned**: a send that waits for window longer than
  ``WINDOW_TIMEOUT_S`` resets its stream (``CANCEL``); its handler is told the client left.
* **Streams count for the connection's eviction**: ``waiting_since`` says since when no stream
  of the connection is being answered (a stream is answered once its request is complete or its
  response started, until it closes), as for an HTTP/1.1 connection waiting for its request.

``install_h2_guard`` puts ``GuardedH2Protocol`` where hypercorn's protocol switch creates its
HTTP/2 handler (``hypercorn.protocol.H2Protocol``: prior-knowledge h2c and the
``Upgrade: h2c`` path); ``check_h2_internals`` verifies the hypercorn internals this relies on.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import h2.errors
import h2.events
import h2.exceptions
import hypercorn.protocol as hypercorn_protocol
import priority
import trio
from hypercorn.events import Closed, Updated
from hypercorn.protocol.events import Body, Data, EndBody, EndData, Response, Trailers
from hypercorn.protocol.h2 import H2Protocol

log = logging.getLogger("trioserve.http.h2_guard")

__all__ = ["MAX_CONCURRENT_STREAMS", "RESET_BURST", "RESETS_PER_S", "WINDOW_TIMEOUT_S",
           "GuardedH2Protocol", "HandlerTaskGroup", "ResetBudget", "check_h2_internals",
           "install_h2_guard"]

# Streams (and their running handlers) one connection may have at once. A client multiplexing
# more requests than the worker has slots plus queue gains nothing from more.
MAX_CONCURRENT_STREAMS = 32
# Client resets one connection may make at once, and per second after that.
RESET_BURST = 64
RESETS_PER_S = 16.0
# A send that waits this long for the client to grant flow-control window abandons its
# response (the stream is reset). The same bound as a socket send (connection.SEND_TIMEOUT_S):
# a client that takes no bytes of a response for this long is gone (or hostile).
WINDOW_TIMEOUT_S = 30.0
# How long telling a closed stream's handler that the client left may wait (its message queue
# is bounded; a handler that no longer reads it must not hold the connection).
DISCONNECT_TIMEOUT_S = 2.0

# Stream events whose send waits for the stream's buffer (for window): bounded by WINDOW_TIMEOUT_S.
_BUFFERED = (Body, Data, EndBody, EndData, Trailers)


class ResetBudget:
    """A token bucket of ``burst`` resets refilled at ``rate`` a second (trio clock)."""

    def __init__(self, burst: int = RESET_BURST, rate: float = RESETS_PER_S) -> None:
        self.burst = burst
        self.rate = rate
        self._tokens = float(burst)
        self._at: float | None = None

    def spend(self, count: int, now: float) -> bool:
        """Take ``count`` resets at time ``now``; False (nothing taken) when the budget has
        fewer."""
        if self._at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._at) * self.rate)
        self._at = now
        if count > self._tokens:
            return False
        self._tokens -= count
        return True


class HandlerTaskGroup:
    """The connection's task group, counting the app tasks it runs for streams (each ends by
    sending ``None``: hypercorn's ``_handle`` does so in ``finally``).

    It also ends every put into an app task's message queue once that task has ended. The
    connection's reading task hands a stream's body to its handler through a bounded queue
    (``max_app_queue_size``) and waits while it is full; a handler that answered without
    reading the body (a 404) and returned never empties it, so the reading task waited forever
    and the whole connection stood still (the body's frames only have to outrun the 404 by
    ``max_app_queue_size`` messages). A put for an ended task is dropped, as it would be for a
    stream hypercorn has already forgotten.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.running = 0

    async def spawn_app(self, app: Any, config: Any, scope: Any,
                        send: Callable[[Any], Awaitable[None]]) -> Any:
        self.running += 1
        ended = False
        waiting_puts: set[trio.CancelScope] = set()

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.running -= 1
                for waiting in waiting_puts:
                    waiting.cancel()

        async def counted_send(message: Any) -> None:
            if message is None:
                end()
            await send(message)

        try:
            put = await self._inner.spawn_app(app, config, scope, counted_send)
        except BaseException:
            end()
            raise

        async def put_while_running(message: Any) -> None:
            if ended:
                return
            with trio.CancelScope() as waiting:
                waiting_puts.add(waiting)
                try:
                    await put(message)
                finally:
                    waiting_puts.discard(waiting)

        return put_while_running

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class _DrainedStream:
    """Stands in for a stream hypercorn has forgotten: what arrives for it is dropped."""

    async def handle(self, event: Any) -> None:
        pass


class _Streams(dict[int, Any]):
    """hypercorn's ``streams`` map, where a stream it has forgotten (answered and closed while
    the client still sends its body) reads as a ``_DrainedStream`` instead of a ``KeyError``.
    hypercorn then acknowledges the dropped data as for any stream. Membership (``in``),
    ``get`` and ``pop`` are those of a plain dict."""

    def __missing__(self, stream_id: int) -> _DrainedStream:
        return _DRAINED


_DRAINED = _DrainedStream()


class GuardedH2Protocol(H2Protocol):
    """hypercorn's HTTP/2 protocol with the per-connection stream bounds and the drained
    answered streams (module docstring)."""

    def __init__(self, app: Any, config: Any, context: Any, task_group: Any, *args: Any,
                 **kwargs: Any) -> None:
        self._apps = HandlerTaskGroup(task_group)
        self.max_streams = min(int(config.h2_max_concurrent_streams), MAX_CONCURRENT_STREAMS)
        if self.max_streams != config.h2_max_concurrent_streams:
            # hypercorn advertises (and h2 enforces) the config's value: pass it ours.
            config = copy.copy(config)
            config.h2_max_concurrent_streams = self.max_streams
        super().__init__(app, config, context, self._apps, *args, **kwargs)
        self.streams = _Streams()
        self._resets = ResetBudget()
        self.refused: str | None = None  # why the connection was ended, once it was
        # Streams being answered: request complete or response started, until closed. While
        # there are none, the connection waits for requests, since `waiting_since` (trio clock).
        self._answering: set[int] = set()
        self.waiting_since: float | None = trio.current_time()

    @property
    def running_handlers(self) -> int:
        """App tasks running for this connection's streams (reset ones included)."""
        return self._apps.running

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        if self.refused is not None:
            return
        resets = sum(isinstance(e, h2.events.StreamReset) and e.remote_reset for e in events)
        if resets and not self._resets.spend(resets, trio.current_time()):
            await self._refuse(f"more than {RESET_BURST} stream resets at once or "
                               f"{RESETS_PER_S:g} a second")
            return
        handlers = self._apps.running
        for event in events:
            if isinstance(event, h2.events.RequestReceived):
                handlers += 1
                if handlers > 2 * self.max_streams:
                    await self._refuse(f"more than {2 * self.max_streams} stream handlers "
                                       "running at once")
                    return
        await super()._handle_events(events)
        restart_timer = False
        for event in events:
            if isinstance(event, h2.events.StreamEnded) and event.stream_id in self.streams:
                self._answering.add(event.stream_id)  # the request is complete: being answered
            # hypercorn forgets a reset stream without saying whether the connection is now
            # idle, so its keep-alive timer would never start again. A drained stream's data
            # restarts it too: keep-alive counts from the last byte of an answered request, not
            # from its answer (a client still uploading the body past the timeout had the
            # connection closed under it, and never read the answer).
            restart_timer = restart_timer or isinstance(event, h2.events.StreamReset) or (
                isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams)
        self._answering_changed()
        if restart_timer and not self.closed:
            await self.send(Updated(idle=self.idle))

    async def initiate(self, headers: Any = None, settings: Any = None) -> None:
        await super().initiate(headers, settings)
        if headers is not None and 1 in self.streams:
            # Upgrade: h2c: stream 1 is the HTTP/1.1 request, already complete.
            self._answering.add(1)
            self._answering_changed()

    # -- every send ends -------------------------------------------------------------------

    async def handle(self, event: Any) -> None:
        if isinstance(event, Closed):
            # The transport is gone: wake every handler waiting for its stream's buffer first
            # (hypercorn's close leaves them waiting for window that never comes).
            await self.end_all_sends()
        await super().handle(event)

    async def end_all_sends(self) -> None:
        """Close every stream buffer: each send waiting on one returns at once, later ones
        are dropped. Never blocks (safe in a cancelled task under a shield)."""
        for buffer in list(self.stream_buffers.values()):
            await buffer.close()

    async def stream_send(self, event: Any) -> None:
        if isinstance(event, _BUFFERED):
            with trio.move_on_after(WINDOW_TIMEOUT_S) as waiting:
                await super().stream_send(event)
            if waiting.cancelled_caught:
                await self._abandon(event.stream_id)
            return
        if isinstance(event, Response) and event.stream_id in self.streams:
            self._answering.add(event.stream_id)
            self._answering_changed()
        await super().stream_send(event)

    async def _abandon(self, stream_id: int) -> None:
        """Give up a response the client grants no window for: reset the stream, drop what
        its buffer holds (the send task then forgets it), tell its handler the client left."""
        log.info("HTTP/2 connection %s: stream %d reset: no flow-control window granted for "
                 "%g s", _peer(self.client), stream_id, WINDOW_TIMEOUT_S)
        try:
            self.connection.reset_stream(stream_id, error_code=h2.errors.ErrorCodes.CANCEL)
        except h2.exceptions.ProtocolError:  # already closed
            pass
        buffer = self.stream_buffers.get(stream_id)
        if buffer is not None:
            await buffer.close()
            try:
                self.priority.unblock(stream_id)
            except priority.MissingStreamError:
                pass
            await self.has_data.set()
        await self._flush()
        await self._close_stream(stream_id)
        if not self.closed:
            await self.send(Updated(idle=self.idle))

    async def _close_stream(self, stream_id: int) -> None:
        self._answering.discard(stream_id)
        self._answering_changed()
        # hypercorn tells the stream's handler through its bounded message queue; a handler
        # that stopped reading it would make this wait forever.
        with trio.move_on_after(DISCONNECT_TIMEOUT_S):
            await super()._close_stream(stream_id)

    def _answering_changed(self) -> None:
        if self._answering:
            self.waiting_since = None
        elif self.waiting_since is None:
            self.waiting_since = trio.current_time()

    async def _refuse(self, why: str) -> None:
        """GOAWAY (ENHANCE_YOUR_CALM), then close the connection; its handlers are cancelled
        as for a client that left."""
        self.refused = why
        log.warning("HTTP/2 connection %s closed: %s", _peer(self.client), why)
        try:
            self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM)
            await self._flush()
        except Exception:  # the connection may be beyond a GOAWAY; closing is what matters
            log.debug("could not send GOAWAY", exc_info=True)
        await self.send(Closed())


def _peer(client: Any) -> str:
    try:
        return f"{client[0]}:{client[1]}"
    except Exception:
        return "?"


def check_h2_internals() -> None:
    """Raise RuntimeError if hypercorn's HTTP/2 protocol is not the one the guard was written
    against (the protocol switch's global, the constructor, ``_handle_events``/``_flush``,
    how ``_handle_events`` passes on and acknowledges data, the task group's ``spawn_app``)."""
    problems = []
    params = list(inspect.signature(H2Protocol.__init__).parameters)
    if params[:5] != ["self", "app", "config", "context", "task_group"]:
        problems.append(f"H2Protocol.__init__{params}")
    for name in ("_handle_events", "_flush", "handle", "initiate", "stream_send", "_close_stream"):
        if not inspect.iscoroutinefunction(getattr(H2Protocol, name, None)):
            problems.append(f"H2Protocol.{name}")
    for name in ("stream_buffers", "priority", "has_data", "closed"):
        if name not in inspect.getsource(H2Protocol.__init__):
            problems.append(f"H2Protocol.{name}")
    send_data = inspect.getsource(H2Protocol._send_data)
    if "await self.stream_buffers[stream_id].pop(" not in send_data or "except (" not in send_data:
        problems.append("H2Protocol._send_data")
    buffer = __import__("hypercorn.protocol.h2", fromlist=["StreamBuffer"]).StreamBuffer
    if not inspect.iscoroutinefunction(getattr(buffer, "close", None)):
        problems.append("StreamBuffer.close")
    handle_events = inspect.getsource(H2Protocol._handle_events)
    if ("self.streams[event.stream_id].handle(" not in handle_events
            or "acknowledge_received_data" not in handle_events):
        problems.append("H2Protocol._handle_events: DataReceived")
    if "self.task_group.spawn_app" not in inspect.getsource(
            __import__("hypercorn.protocol.http_stream", fromlist=["HTTPStream"]).HTTPStream):
        problems.append("HTTPStream: self.task_group.spawn_app")
    if "H2Protocol(" not in inspect.getsource(hypercorn_protocol.ProtocolWrapper):
        problems.append("ProtocolWrapper: H2Protocol(")
    if problems:
        raise RuntimeError("trioserve's HTTP/2 guard does not match the installed hypercorn; "
                           f"changed: {', '.join(problems)}. Install a verified hypercorn version.")


def install_h2_guard() -> None:
    """Make hypercorn's protocol switch create ``GuardedH2Protocol``; idempotent. Raises
    RuntimeError (``check_h2_internals``) when hypercorn differs."""
    check_h2_internals()
    hypercorn_protocol.H2Protocol = GuardedH2Protocol  # type: ignore[misc]
