"""SessionRuntime: admission, multiplexing and cancellation over one worker.

The runtime turns "generate this prompt" into an async stream of text and a final
``Done``, and guarantees, whatever the caller does:

* **Up to ``capacity`` generations run at once** (the worker's ready record says how
  many); beyond that, requests wait in a FIFO queue of at most ``queue_depth``; one more
  fails at once with ``server_busy``. ``queue_depth`` 0 means "no waiting room": requests
  are still admitted while a slot is free.
* **A bad request fails only itself.** ``submit`` encodes the request before queueing it;
  one that cannot be encoded (text that is not valid Unicode, a line longer than the
  worker accepts) raises GenerationError and never reaches the worker. An error record
  for one id fails only that generation, whatever its code.
* **Leaving early frees only your own slot.** ``Generation.cancel()`` is synchronous and
  idempotent, so a handler calls it from ``finally`` without awaiting (a cancelled
  handler must not await there). A queued generation is dropped before it reaches the
  worker; a running one gets a cancel frame on the out-of-band pipe, and the worker has
  ``cancel_grace`` seconds to send that id's terminal record (counted from the last
  progress of the step that was running when the frame was sent, while that step keeps
  computing: the cancel takes effect at its end); past it the worker is hung.
* **Nothing waits forever, and a slow step is not a hung worker.** While generations are
  in flight and the worker shows no progress for ``stall_timeout`` seconds (idle:
  ``health_interval``), it is pinged; no pong and no progress within ``health_timeout``
  means hung. Progress is any record, and a progress record (spec §4.4: the worker's
  heartbeat from inside a long step) whose step or work counter moved; one whose counter
  stands still is not progress, so a stuck step is still found. A request line the worker
  does not take for ``health_timeout`` means hung. A dead, hung or garbled worker fails
  every in-flight and queued generation with a retryable ``worker_unavailable``; ``serve``
  then raises WorkerError (WorkerHung names the stalled step and for how long) and the
  supervisor replaces the worker.

Concurrency shape: handlers run in hypercorn's per-request tasks and only call
``submit``, iterate a ``Generation`` and call ``cancel``. ``serve(client)`` runs in the
supervisor's nursery for one worker incarnation and holds three tasks: the *dispatcher*
(sends queued generates while slots are free, without waiting for their results), the
*reader* (the only task that reads records; it routes each by id to its generation's
mailbox and never blocks on anything but the worker's stdout) and the *watchdog* (cancel
grace deadlines, stall and idle health pings). Writes to the worker's stdin come from
the dispatcher, the watchdog and ``call``; WorkerClient serializes them under a FIFO lock.

The mailbox coalesces: when the client is slower than the model, text accumulates
(bounded by the context window) and is taken in one piece; when the client keeps up,
every token is delivered as it arrives. It never blocks the reader, so a slow client
cannot stall other generations, the worker's stdout or admission.

No OpenAI knowledge here: prompts are already rendered, errors carry worker codes.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from typing import Any, Callable, Iterator

import trio

from trioserve.worker.tokenize_gate import TokenizeGate
from trioserve.worker.client import WorkerClient
from trioserve.worker.generation import Generation, GenerationError
from trioserve.worker.work_queue import WorkQueue
from trioserve.worker.worker_link import CANCELLABLE_CALLS, GATHER_WINDOW, WorkerLink, only_cancelled
from trioserve.worker.protocol import (
    Done,
    Generate,
    GenerateParams,
    PreparedRequest,
    Record,
    Request,
    RequestRejected,
    SessionClose,
    WorkerError,
    WorkerHung,
    prepare,
)

log = logging.getLogger("trioserve.worker.runtime")

__all__ = ["SessionRuntime", "Arrival", "GATHER_WINDOW", "Generation", "GenerationError",
           "GenerateParams", "Done", "WorkerHung", "WorkerError"]

# Such a call's deadline: the health timeout plus one second per this many bytes of its line
# (llama.cpp tokenized 4.1 MB of spaces in 10-30 s on 2 busy cores).
TOKENIZE_DEADLINE_BYTES_PER_S = 64 * 1024




class Arrival:
    """A request the HTTP layer has begun to receive and may soon submit (see
    ``SessionRuntime.arrival``). ``done()`` is idempotent."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self._queue: WorkQueue[Generation] | None = runtime.work_queue
        runtime.work_queue.arrival_started()

    def done(self) -> None:
        if self._queue is not None:
            self._queue.arrival_ended()  # a gathering dispatcher re-checks
            self._queue = None


class SessionRuntime:
    """Admission queue and multiplexer over one worker at a time.

    ``submit`` and ``call`` are used by request handlers. ``serve(client)`` is run by the
    supervisor for each worker incarnation; it returns never, and raises WorkerError when
    the worker has to go (died, hung, broke the protocol) after failing every pending
    generation. Settings: ``queue_depth`` requests may wait beyond the worker's capacity;
    ``cancel_grace`` s for a cancelled generation's terminal record; ``stall_timeout`` s
    without progress with generations in flight (``health_interval`` s of silence when idle)
    before a ping; ``health_timeout`` s without progress for the pong (and for any call's
    reply) and for each piece of a request line to be taken; ``null_id_limit`` unattributable id-less error records before the worker is
    replaced (see ``NullIdErrors``); ``prompt_encoder`` rewrites generate/tokenize prompts
    as ids for a worker that does not tokenize (the ExecuTorch engine).
    """

    def __init__(self, *, queue_depth: int = 16, cancel_grace: float = 2.0,
                 stall_timeout: float = 30.0, health_interval: float = 30.0,
                 health_timeout: float = 10.0, null_id_limit: int = 2,
                 prompt_encoder: Callable[[Request], Request] | None = None) -> None:
        self.queue_depth = queue_depth
        # Rewrites prompts as token ids before they are encoded for a worker that does not
        # tokenize (the ExecuTorch engine: trioserve/worker/prompt_encoder.py); None: sent as text.
        self.prompt_encoder = prompt_encoder
        self.cancel_grace = cancel_grace
        self.stall_timeout = stall_timeout
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self.null_id_limit = null_id_limit
        # Clients' tokenizer requests: bounded like the generation queue (tokenize_gate.py).
        self.tokenize_gate = TokenizeGate(waiting=queue_depth)
        # The waiting generations, the dispatcher's wake-up and the open Arrivals: shared
        # with the serving WorkerLink (work_queue.py), which takes what it dispatches.
        self.work_queue: WorkQueue[Generation] = WorkQueue()
        self._link: WorkerLink | None = None
        self._unavailable_reason = "worker is loading"
        # Observability (tests, /health, benchmarks): generations that reached the worker,
        # and the terminal records of the most recent ones.
        self.dispatched = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.last_terminal_time = 0.0  # trio clock when the last terminal record arrived

    # -- handler side ----------------------------------------------------------------

    @contextlib.contextmanager
    def arrival(self) -> Iterator[Arrival]:
        """Mark a request that is being received and will probably ``submit`` soon; the mark
        ends at that submit (``submit(..., arrival=)``) or when the block exits.

        Why: a burst of requests reaches ``submit`` a few milliseconds apart (each handler
        validates and renders in turn). A worker that is idle when the first one arrives
        would prefill it alone and the others a step later, a whole prefill behind. While
        requests are marked, a dispatcher that finds the worker idle waits for them, at most
        ``GATHER_WINDOW`` s, and then sends every queued generate back to back, so the worker
        admits them into one step. A lone request is never delayed: its own mark ends
        before its generate is dispatched.
        """
        token = Arrival(self)
        try:
            yield token
        finally:
            token.done()

    def submit(self, params: GenerateParams, *, arrival: Arrival | None = None) -> Generation:
        """Admit a generation, or raise GenerationError without admitting it.

        Codes: ``worker_unavailable`` (no ready worker; retryable), an encoding code from
        ``RequestRejected`` (``invalid_unicode``, ``invalid_request``, ``line_too_long``;
        not retryable, nothing was sent), ``server_busy`` (every slot taken and
        ``queue_depth`` requests already waiting; retryable).
        """
        if arrival is not None:
            arrival.done()  # admitted or refused below: either way no longer arriving
        link = self._serving_link()
        if params.session_id is not None and link.capacity <= 1:
            # A one-slot worker hosts no named sessions (worker protocol §6): run anonymously
            # (it still reuses the slot's common prefix).
            params = dataclasses.replace(params, session_id=None, retention=None)
        prepared = _prepare(Generate(params), link.client, self.prompt_encoder)
        waiting = len(self.work_queue)
        if link.occupied + waiting >= link.capacity + self.queue_depth:
            raise GenerationError(
                "server_busy", f"all {link.capacity} slots are busy and {waiting} "
                "requests are already waiting", retryable=True)
        gen = Generation(self.work_queue, params, prepared)
        self.work_queue.put(gen)
        return gen

    async def call(self, request: Request, *, timeout: float | None = None) -> Record:
        """Send a non-generate request (tokenize, session op, ping) and return its reply.

        Raises GenerationError: the worker's error record for it (its code), an encoding
        code, or ``worker_unavailable`` when there is no worker, it failed meanwhile, or it
        did not answer within ``timeout`` (default ``health_timeout``) s after its last
        progress (a worker inside a long step answers at the step's end; its heartbeats
        extend the wait). Cancellation abandons the wait (a tokenize or detokenize the worker
        holds is cancelled there too: worker protocol §7); a late reply is dropped. A tokenize
        or detokenize gets one more second per ``TOKENIZE_DEADLINE_BYTES_PER_S`` bytes of its
        line by default. Clients' tokenizer requests pass ``tokenize_gate`` first
        (worker/tokenize_gate.py).
        """
        if isinstance(request, Generate):
            raise TypeError("use submit() for generations")
        link = self._serving_link()
        prepared = _prepare(request, link.client, self.prompt_encoder)
        if timeout is None:
            timeout = self.health_timeout
            if prepared.op in CANCELLABLE_CALLS:
                # Tokenizing megabytes is seconds of work, not a hang (the worker's call
                # thread does it while the loop answers pings): the deadline grows with it.
                timeout += len(prepared.body) / TOKENIZE_DEADLINE_BYTES_PER_S
        return await link.call(prepared, timeout)

    async def close_session(self, session_id: str) -> bool:
        """Free named session ``session_id`` in the worker (its slot binding and any spilled
        state). Returns whether the worker had it (bound or spilled).

        Raises GenerationError ``session_busy`` (retryable) when a generation of that session
        is running or queued, ``worker_unavailable`` as ``call`` does.
        """
        self.check_session_idle(session_id)
        reply = await self.call(SessionClose(session_id))
        return bool(getattr(reply, "found", False))

    def check_session_idle(self, session_id: str) -> None:
        """Raise GenerationError ``session_busy`` (retryable) when a generation of
        ``session_id`` is running or queued, ``worker_unavailable`` when no worker serves."""
        link = self._serving_link()
        if session_id in link.busy_sessions() or any(
                gen.params.session_id == session_id for gen in self.work_queue):
            raise GenerationError("session_busy", f"session {session_id!r} has a generation "
                                  "running or queued", retryable=True,
                                  details={"session_id": session_id})

    @property
    def queued(self) -> int:
        return len(self.work_queue)

    @property
    def in_flight(self) -> int:
        """Generations taken from the queue whose terminal record has not arrived."""
        return self._link.occupied if self._link is not None else 0

    @property
    def calls_in_flight(self) -> int:
        """Calls (tokenize, session ops, pings) sent to the worker and not yet answered,
        abandoned ones included until the worker's reply (tests, diagnostics)."""
        return len(self._link.calls) if self._link is not None else 0

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def capacity(self) -> int:
        """Slots of the serving worker (0 while none serves)."""
        return self._link.capacity if self._link is not None else 0

    @property
    def serving(self) -> bool:
        """A worker is serving: ``submit`` and ``call`` reach it (no ``worker_unavailable``)."""
        return self._link is not None and self._link.failure is None

    @property
    def client(self) -> WorkerClient | None:
        """The worker being served, if any (tests and diagnostics)."""
        return self._link.client if self._link is not None else None

    def _serving_link(self) -> WorkerLink:
        link = self._link
        if link is None or link.failure is not None:
            raise GenerationError("worker_unavailable", self._unavailable_reason, retryable=True)
        return link

    # -- supervisor side -------------------------------------------------------------

    def set_unavailable(self, reason: str) -> None:
        """Record why no worker is serving (reported by ``submit``'s errors)."""
        self._unavailable_reason = reason

    async def serve(self, client: WorkerClient) -> None:
        """Run ``client``'s worker until it fails; never returns normally.

        Raises the WorkerError that ended it (WorkerHung when a deadline passed) after
        failing every in-flight, starting and queued generation and every pending call
        with a retryable ``worker_unavailable``. Cancellation (shutdown) fails them the
        same way and propagates. Any other exception is a bug of ours and propagates as is.
        """
        link = WorkerLink(self, client)
        self._link = link
        try:
            await link.run()
        except BaseException as exc:
            if only_cancelled(exc):
                reason = "server is shutting down"
            elif isinstance(exc, WorkerError):
                reason = str(exc)
            else:
                reason = f"internal error: {exc!r}"
            self._unavailable_reason = reason
            self._link = None
            error = GenerationError("worker_unavailable", reason, retryable=True)
            link.fail_everything(error)
            for gen in self.work_queue.take_all():
                gen.fail(error)
            raise
        finally:
            self._link = None

    # -- link side ---------------------------------------------------------------------

    def record_terminal(self, entry: dict[str, Any]) -> None:
        """The serving link got a generation's terminal record (``entry``: its fields)."""
        self.history.append(entry)
        self.last_terminal_time = trio.current_time()


def _prepare(request: Request, client: WorkerClient,
             encoder: Callable[[Request], Request] | None = None) -> PreparedRequest:
    try:
        if encoder is not None:
            request = encoder(request)
        return prepare(request, max_line_bytes=client.max_line_bytes)
    except RequestRejected as exc:
        raise GenerationError(exc.code, exc.message, details={"field": exc.field}) from exc
