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
import enum
import logging
from typing import Any, AsyncIterator, Callable, Iterator

import trio

from trioserve.worker.tokenize_gate import TokenizeGate
from trioserve.worker.client import WorkerClient
from trioserve.worker.protocol import (
    Ack,
    Detokenized,
    Done,
    Error,
    Generate,
    GenerateParams,
    Ping,
    Pong,
    PreparedRequest,
    Progress,
    ProtocolViolation,
    Ready,
    Record,
    Request,
    RequestRejected,
    SessionClose,
    Token,
    Tokens,
    WorkerError,
    WorkerHung,
    prepare,
)

log = logging.getLogger("trioserve.worker.runtime")

__all__ = ["SessionRuntime", "Generation", "GenerationError", "GenerateParams", "Done",
           "WorkerHung", "WorkerError"]

# Worker error codes that say "not now" rather than "never": the same request may succeed
# once another generation or session has finished.
_RETRYABLE_CODES = frozenset({"capacity_exhausted", "session_busy"})
# Calls the worker runs on its call thread and stops on a cancel frame (worker protocol §7).
_CANCELLABLE_CALLS = frozenset({"tokenize", "detokenize"})
# Such a call's deadline: the health timeout plus one second per this many bytes of its line
# (llama.cpp tokenized 4.1 MB of spaces in 10-30 s on 2 busy cores).
TOKENIZE_DEADLINE_BYTES_PER_S = 64 * 1024


class GenerationError(Exception):
    """A generation (or a ``call``) failed. ``code`` is a worker error code, an encoding
    code of ``worker_protocol.RequestRejected`` or one of the runtime's:

    ``server_busy`` (slots and queue full), ``worker_unavailable`` (no ready worker, or it
    died or was killed during this request), ``cancelled`` (cancelled while queued).
    ``retryable`` says whether the same request may succeed later; ``details`` carries
    extra fields of the worker's error record (or ``field`` for an encoding error).
    """

    def __init__(self, code: str, message: str, *, retryable: bool = False,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details or {}


class _State(enum.Enum):
    QUEUED = "queued"  # in the runtime's FIFO queue
    STARTING = "starting"  # taken by the dispatcher, waiting for the write lock
    RUNNING = "running"  # has an id; its line is (being) written; no terminal record yet
    FINISHED = "finished"  # terminal: done, failed or cancelled while queued


class Generation:
    """One submitted generation, as seen by the request handler.

    Iterate it (``async for piece in gen``) to get text pieces; ``gen.done`` holds the
    ``Done`` once iteration ends. Iteration raises GenerationError on failure. Call
    ``cancel()`` when leaving early — always safe, never blocks.
    """

    def __init__(self, runtime: SessionRuntime, params: GenerateParams,
                 prepared: PreparedRequest) -> None:
        self.params = params
        self.request_id: int | None = None
        self.done: Done | None = None
        # The pool index of the worker serving it (set by WorkerPool.submit; 0 with one
        # worker): the stats carry it so each worker's KV-cache gauge stays its own.
        self.worker = 0
        self._runtime = runtime
        self._prepared = prepared
        self._state = _State.QUEUED
        self._link: _WorkerLink | None = None  # the incarnation running it
        self._parts: list[str] = []
        self.text_parts: list[str] = []  # every piece pushed, in order (session replay reads it)
        self._error: GenerationError | None = None
        self._wakeup: trio.Event | None = None
        self._cancel_requested = False
        self._heard = False  # the worker wrote at least one record for it
        self._grace_deadline = float("inf")  # set by cancel() while running
        self._cancel_sent_at = float("inf")  # when cancel() sent its frame

    # -- consumer side ---------------------------------------------------------------

    def __aiter__(self) -> AsyncIterator[str]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[str]:
        while True:
            piece = await self.receive()
            if piece is None:
                return
            yield piece

    async def receive(self) -> str | None:
        """Wait for the next text piece; None once the generation finished normally.

        Raises GenerationError if it failed. Cancelling the caller leaves the generation
        running: the caller must still call ``cancel()`` (handlers do so in ``finally``).
        """
        while True:
            if self._parts:
                parts = self._parts
                self._parts = []
                return parts[0] if len(parts) == 1 else "".join(parts)
            if self._error is not None:
                raise self._error
            if self.done is not None:
                return None
            self._wakeup = trio.Event()
            await self._wakeup.wait()

    def cancel(self) -> None:
        """Stop this generation; synchronous, idempotent, safe from any task or finally.

        Queued: it is removed and never reaches the worker. Running: a cancel frame for its
        id goes to the worker (other generations are untouched) and the worker has the
        runtime's cancel grace to end it. Finished: nothing happens.
        """
        if self._cancel_requested or self._state is _State.FINISHED:
            return
        self._cancel_requested = True
        if self._state is _State.QUEUED:
            self._runtime._drop_queued(self)
            self._fail(GenerationError("cancelled", "generation cancelled before it started"))
        elif self._state is _State.RUNNING and self._link is not None:
            self._link.cancel(self)
        # STARTING: the dispatcher sends the cancel frame as soon as the id is chosen.

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    # -- runtime side ----------------------------------------------------------------

    def _push(self, text: str) -> None:
        self._parts.append(text)
        self.text_parts.append(text)
        self._wake()

    def _finish(self, done: Done) -> None:
        self._state = _State.FINISHED
        self.done = done
        self._wake()

    def _fail(self, error: GenerationError) -> None:
        self._state = _State.FINISHED
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


class _Call:
    """A non-generate request (ping, tokenize, session op) waiting for its one reply."""

    def __init__(self) -> None:
        self.request_id: int | None = None
        self.reply: Record | None = None
        self.error: GenerationError | None = None
        self.answered = trio.Event()
        self.abandoned = False  # the caller stopped waiting; the reply is dropped

    def resolve(self, reply: Record | None = None, error: GenerationError | None = None) -> None:
        self.reply, self.error = reply, error
        self.answered.set()


# How long a dispatcher that finds the worker idle waits for requests that are still
# arriving (see SessionRuntime.arrival). Long enough for a burst's handlers to validate and
# render (1-4 ms each on the 2-core reference host), short against a prefill.
GATHER_WINDOW = 0.010


class Arrival:
    """A request the HTTP layer has begun to receive and may soon submit (see
    ``SessionRuntime.arrival``). ``done()`` is idempotent."""

    def __init__(self, runtime: SessionRuntime) -> None:
        self._runtime: SessionRuntime | None = runtime
        runtime._arriving += 1

    def done(self) -> None:
        if self._runtime is not None:
            self._runtime._arriving -= 1
            self._runtime._work.set()  # a gathering dispatcher re-checks
            self._runtime = None


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
    replaced (see ``_NullIdErrors``); ``prompt_encoder`` rewrites generate/tokenize prompts
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
        self._queue: collections.deque[Generation] = collections.deque()
        self._work = trio.Event()  # set when the dispatcher may have something to do
        self._arriving = 0  # open Arrivals: requests being received that may submit soon
        self._link: _WorkerLink | None = None
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
        if link.occupied + len(self._queue) >= link.capacity + self.queue_depth:
            raise GenerationError(
                "server_busy", f"all {link.capacity} slots are busy and {len(self._queue)} "
                "requests are already waiting", retryable=True)
        gen = Generation(self, params, prepared)
        self._queue.append(gen)
        self._work.set()
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
            if prepared.op in _CANCELLABLE_CALLS:
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
                gen.params.session_id == session_id for gen in self._queue):
            raise GenerationError("session_busy", f"session {session_id!r} has a generation "
                                  "running or queued", retryable=True,
                                  details={"session_id": session_id})

    @property
    def queued(self) -> int:
        return len(self._queue)

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

    def _serving_link(self) -> _WorkerLink:
        link = self._link
        if link is None or link.failure is not None:
            raise GenerationError("worker_unavailable", self._unavailable_reason, retryable=True)
        return link

    def _drop_queued(self, gen: Generation) -> None:
        try:
            self._queue.remove(gen)
        except ValueError:
            pass

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
        link = _WorkerLink(self, client)
        self._link = link
        try:
            await link.run()
        except BaseException as exc:
            if _only_cancelled(exc):
                reason = "server is shutting down"
            elif isinstance(exc, WorkerError):
                reason = str(exc)
            else:
                reason = f"internal error: {exc!r}"
            self._unavailable_reason = reason
            self._link = None
            error = GenerationError("worker_unavailable", reason, retryable=True)
            link.fail_everything(error)
            while self._queue:
                self._queue.popleft()._fail(error)
            raise
        finally:
            self._link = None

    # -- link side ---------------------------------------------------------------------

    def _record_terminal(self, entry: dict[str, Any]) -> None:
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


class _NullIdErrors:
    """Attribution of error records whose ``id`` is null.

    The worker writes ``id: null`` only for a line it could not parse far enough to find
    an id. The codec makes every line valid, so only a parent bug causes it — and the
    request behind that line then never gets any record. Rule:

    1. Log it. Never fail a generation that could not have been that line.
    2. The line is one of the *silent* requests: sent, with no record heard yet. Every
       request that is not broken eventually writes a record (a token, its terminal
       record) and so drops out of the suspects; the broken one never does. Once the
       suspects are exactly as many as the id-less errors still owed, each is broken:
       fail them (with the worker's code) and forget them — at once when only one
       request was silent, later otherwise. A suspect whose cancel grace runs out while
       an error is owed is taken to be that broken line rather than a hung worker (the
       stall ping still catches a hung one).
    3. An id-less error when fewer requests are silent than errors owed cannot be
       attributed to anything: it is logged and counted. After ``limit`` of those in one
       worker's life the parent and worker no longer agree on the line stream, and the
       worker is replaced (ProtocolViolation), failing everything as for a crash.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.suspects: set[int] = set()
        self.owed: list[Error] = []
        self.unattributable = 0

    def on_error(self, error: Error, silent: set[int]) -> list[tuple[int, Error]]:
        """An id-less error arrived while ``silent`` requests had no record yet; returns
        the (id, error) pairs to fail now. Raises ProtocolViolation past the limit."""
        log.error("worker could not read a request line: %s: %s", error.code, error.message)
        self.suspects = set(silent)
        self.owed.append(error)
        if len(self.owed) > len(self.suspects):
            self.owed.pop()
            self.unattributable += 1
            log.error("the error above matches no silent request (%d of %d allowed)",
                      self.unattributable, self.limit)
            if self.unattributable >= self.limit:
                raise ProtocolViolation(
                    f"worker reported {self.unattributable} errors that match no request "
                    f"(last: {error.code}: {error.message})")
        return self._settle()

    def heard(self, request_id: int) -> list[tuple[int, Error]]:
        """``request_id`` wrote a record (or ended): it is not broken."""
        if request_id not in self.suspects:
            return []
        self.suspects.discard(request_id)
        return self._settle()

    def claim(self, request_id: int) -> Error | None:
        """``request_id`` missed its cancel grace: if an error is owed and it is a suspect,
        it is that broken line (returns the error) rather than proof of a hung worker."""
        if request_id in self.suspects and self.owed:
            self.suspects.discard(request_id)
            return self.owed.pop(0)
        return None

    def _settle(self) -> list[tuple[int, Error]]:
        if not self.owed or len(self.suspects) > len(self.owed):
            return []
        blamed = list(zip(sorted(self.suspects), self.owed))
        self.suspects.clear()
        self.owed.clear()
        return blamed


class _WorkerLink:
    """The runtime's state for one worker incarnation: in-flight generations by id,
    pending calls by id, liveness clock. Lives exactly as long as ``SessionRuntime.serve``.

    Invariant: an id is in ``running`` or ``calls`` from the moment it is allocated (before
    its line is written) until its terminal record (or reply) arrives or the link fails.
    """

    def __init__(self, runtime: SessionRuntime, client: WorkerClient) -> None:
        self.runtime = runtime
        self.client = client
        ready: Ready = client.ready
        self.capacity = ready.capacity
        self.running: dict[int, Generation] = {}
        self.starting: Generation | None = None
        self.calls: dict[int, _Call] = {}
        self.forgotten: set[int] = set()  # ids failed by attribution; late records dropped
        self.null_ids = _NullIdErrors(runtime.null_id_limit)
        self.failure: WorkerError | None = None
        # Since when the worker owes us output: its last sign of progress, or the moment it
        # went from idle to busy (an idle worker owes nothing, so idle time must not count as
        # a stall).
        self.quiet_since = trio.current_time()
        # The worker's last sign of progress (any record but a progress record whose counter
        # stood still), and its last progress record: the running step, for the stall log.
        self.progress_at = trio.current_time()
        self.last_progress: Progress | None = None
        self.last_progress_time = float("-inf")  # when last_progress arrived
        # The last progress record that showed progress: when it came, and when its step
        # began (estimated: its arrival less its elapsed time), for _grace_due.
        self.step_progress_at = float("-inf")
        self.step_started_at = float("inf")
        self.stall_logged = False
        self.changed = trio.Event()  # wakes the watchdog: deadlines or in-flight set changed
        self.probing = False
        self._nursery: trio.Nursery | None = None

    @property
    def occupied(self) -> int:
        return len(self.running) + (self.starting is not None)

    # -- lifetime ------------------------------------------------------------------------

    async def run(self) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._guarded, self._read_records)
            nursery.start_soon(self._guarded, self._dispatch)
            nursery.start_soon(self._guarded, self._watch)
        assert self.failure is not None, "the link's tasks only end by failing"
        raise self.failure

    async def _guarded(self, task: Any) -> None:
        try:
            await task()
        except WorkerError as exc:
            self.fail(exc)

    def fail(self, exc: WorkerError) -> None:
        """The worker must go: remember the first reason and stop every link task."""
        if self.failure is None:
            self.failure = exc
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    def fail_everything(self, error: GenerationError) -> None:
        for gen in list(self.running.values()):
            gen._fail(error)
        self.running.clear()
        if self.starting is not None:
            self.starting._fail(error)
            self.starting = None
        for call in self.calls.values():
            call.resolve(error=error)
        self.calls.clear()

    # -- dispatcher ----------------------------------------------------------------------

    def busy_sessions(self) -> set[str]:
        """Named sessions with a generation taken from the queue and not yet finished."""
        busy = {gen.params.session_id for gen in self.running.values()}
        if self.starting is not None:
            busy.add(self.starting.params.session_id)
        busy.discard(None)
        return busy  # type: ignore[return-value]

    def _next_dispatchable(self) -> Generation | None:
        """The first queued generation the worker can start now, or None.

        CONTRACT (worker protocol §6): a named session runs one generation at a time, so a
        generation whose session is busy waits in the queue behind it (never a
        ``session_busy`` error); at most ``capacity - 1`` named generations run at once, so
        a new named session always finds an idle slot or an idle session to evict. Later
        generations (anonymous, other sessions) pass the waiting ones; each session's own
        generations keep their order.
        """
        if self.occupied >= self.capacity:
            return None
        busy = self.busy_sessions()
        named_limit = max(1, self.capacity - 1)
        named_running = len(busy)
        for gen in self.runtime._queue:
            sid = gen.params.session_id
            if sid is None:
                return gen
            if sid in busy or named_running >= named_limit:
                busy.add(sid)  # later generations of this session wait behind this one
                continue
            return gen
        return None

    async def _dispatch(self) -> None:
        """Send queued generates while slots are free; never waits for their records."""
        runtime = self.runtime
        while True:
            while (gen := self._next_dispatchable()) is None:
                runtime._work = trio.Event()
                await runtime._work.wait()
            if not self.running and runtime._arriving:
                # Idle worker, more requests on their way in: let them queue so the worker
                # admits them together (SessionRuntime.arrival). FIFO still holds: the oldest
                # dispatchable generation goes first.
                with trio.move_on_after(GATHER_WINDOW):
                    while runtime._arriving:
                        runtime._work = trio.Event()
                        await runtime._work.wait()
                if (gen := self._next_dispatchable()) is None:
                    continue
            runtime._queue.remove(gen)
            gen._state = _State.STARTING
            self.starting = gen

            def register(rid: int, gen: Generation = gen) -> None:
                if not self.running:  # idle until now: the worker owed nothing before
                    self.quiet_since = self.progress_at = trio.current_time()
                gen.request_id = rid
                gen._state = _State.RUNNING
                gen._link = self
                self.starting = None
                self.running[rid] = gen
                runtime.dispatched += 1
                self.changed.set()
                if gen.cancel_requested:
                    # Cancelled while waiting for the write lock: the frame may precede the
                    # line; the worker latches frames for ids it has not read yet.
                    self.cancel(gen)

            await self.client.send_request(gen._prepared, progress_timeout=runtime.health_timeout,
                                           register=register)

    def cancel(self, gen: Generation) -> None:
        assert gen.request_id is not None
        self.client.cancel(gen.request_id)
        now = trio.current_time()
        gen._grace_deadline = min(gen._grace_deadline, now + self.runtime.cancel_grace)
        gen._cancel_sent_at = min(gen._cancel_sent_at, now)
        self.changed.set()

    def _grace_due(self, gen: Generation) -> float:
        """When ``gen``'s cancel grace runs out. A cancel that cannot abort the running step
        (a decode sharing it with other generations' work, spec §7) takes effect at the step's
        end; while that step keeps computing (progress records, spec §4.4) the grace counts
        from its last progress, so a long step on a loaded CPU is not taken for a worker that
        ignores cancels."""
        due = gen._grace_deadline
        if (due != float("inf") and self.step_progress_at >= gen._cancel_sent_at
                and self.step_started_at <= gen._cancel_sent_at + _STEP_START_SLACK):
            due = max(due, self.step_progress_at + self.runtime.cancel_grace)
        return due

    # -- calls ---------------------------------------------------------------------------

    async def call(self, prepared: PreparedRequest, timeout: float, *, shield: bool = True) -> Record:
        """Send one non-generate request and wait for its reply (see SessionRuntime.call).

        ``shield``: a caller from outside the link (a request handler) must not tear the
        request stream by being cancelled mid-line, so its write is shielded (it is bounded
        by the progress timeout). The link's own probe is not shielded: the link's tasks are
        cancelled only when the worker is being discarded anyway.
        """
        call = _Call()

        def register(rid: int) -> None:
            call.request_id = rid
            self.calls[rid] = call

        try:
            # Shielded: a caller cancelled halfway through the line would leave stdin torn
            # and cost the worker; the write is bounded by the progress timeout anyway.
            with trio.CancelScope(shield=shield):
                await self.client.send_request(
                    prepared, progress_timeout=self.runtime.health_timeout, register=register)
        except WorkerError as exc:
            self.fail(exc)  # a torn or refused write ends the worker, not just this call
            raise GenerationError("worker_unavailable", str(exc), retryable=True) from exc
        try:
            # The deadline is ``timeout`` after the later of the write and the worker's last
            # progress: the worker answers between steps, and a step on a loaded CPU may run
            # for minutes while its heartbeats show it computing.
            deadline = trio.current_time() + timeout
            while not call.answered.is_set() and deadline > trio.current_time():
                with trio.move_on_at(deadline):
                    await call.answered.wait()
                deadline = max(deadline, self.progress_at + timeout)
        finally:
            if not call.answered.is_set():
                call.abandoned = True
                if prepared.op in _CANCELLABLE_CALLS and call.request_id is not None:
                    # No abandoned work: the worker stops it and answers `cancelled`, which
                    # ends the id's bookkeeping here (the reply is dropped).
                    self.client.cancel(call.request_id)
        if not call.answered.is_set():
            raise GenerationError("worker_unavailable",
                                  f"worker did not answer {prepared.op!r} within {timeout:g} s "
                                  "and made no progress meanwhile", retryable=True)
        if call.error is not None:
            raise call.error
        assert call.reply is not None
        return call.reply

    # -- reader --------------------------------------------------------------------------

    async def _read_records(self) -> None:
        """The only reader of the worker's stdout; routing never blocks. One wake-up per
        read: every record of it is routed before the next wait, so a generation's consumer
        is woken once for all the tokens it got (``Generation.receive`` joins them)."""
        receive_batch = self.client.receive_batch
        route = self._route
        while True:
            batch = await receive_batch()
            now = trio.current_time()
            for record in batch:
                if type(record) is Progress:
                    self._note_progress(record)
                    continue
                self.quiet_since = self.progress_at = now
                route(record)

    def _note_progress(self, record: Progress) -> None:
        """A heartbeat from inside a step: progress when its step or work counter moved since
        the previous one (spec §4.4); one that stood still leaves the stall clock running."""
        advanced = record.advanced_since(self.last_progress)
        self.last_progress = record
        self.last_progress_time = trio.current_time()
        if not advanced:
            return
        self.quiet_since = self.progress_at = self.step_progress_at = trio.current_time()
        self.step_started_at = self.step_progress_at - record.elapsed_ms / 1000
        self.changed.set()  # a cancel grace may have moved
        if self.stall_logged:
            self.stall_logged = False
            log.warning("worker is making progress again in step %d (%s), after %.1f s without",
                        record.step, record.describe(), record.stalled_ms / 1000)

    def stall_description(self, now: float) -> str:
        """``no progress for 61 s in step 17 (2 prefill pieces (...); 513 tokens), running
        for 75 s`` — or only the silence when the worker reported no step."""
        text = f"no progress for {now - self.progress_at:.0f} s"
        last = self.last_progress
        # The step of the last heartbeat is still the running one unless some other record
        # (which the worker writes between steps) came after it.
        if last is not None and self.progress_at <= self.last_progress_time:
            running = last.elapsed_ms / 1000 + (now - self.last_progress_time)
            text += f" in step {last.step} ({last.describe()}), running for {running:.0f} s"
        return text

    def _route(self, record: Record) -> None:
        if isinstance(record, Error) and record.id is None:
            silent = {rid for rid, gen in self.running.items() if not gen._heard}
            silent |= {rid for rid, call in self.calls.items() if not call.answered.is_set()}
            self._blame(self.null_ids.on_error(record, silent))
            return
        if isinstance(record, Ready):
            raise ProtocolViolation("worker sent a second ready record")
        assert not isinstance(record, Progress)  # taken by _read_records
        rid = record.id
        assert rid is not None  # only an error record may lack an id (handled above)
        gen = self.running.get(rid)
        if gen is not None:
            if not gen._heard:
                gen._heard = True
                self._blame(self.null_ids.heard(rid))  # may blame others, never this one
            if isinstance(record, Token):
                gen._push(record.text)
            elif isinstance(record, Done):
                self._end(rid)
                self.runtime._record_terminal(dict(record.record))
                gen._finish(record)
            elif isinstance(record, Error):
                self._end(rid)
                self.runtime._record_terminal(_error_entry(record))
                gen._fail(GenerationError(record.code, record.message or "worker error",
                                          retryable=record.code in _RETRYABLE_CODES,
                                          details=dict(record.details)))
            else:
                raise ProtocolViolation(f"{type(record).__name__.lower()} record for generation {rid}")
            return
        call = self.calls.pop(rid, None)
        if call is not None:
            self._blame(self.null_ids.heard(rid))
            if isinstance(record, Error):
                call.resolve(error=GenerationError(record.code, record.message or "worker error",
                                                   retryable=record.code in _RETRYABLE_CODES,
                                                   details=dict(record.details)))
            elif isinstance(record, (Pong, Ack, Tokens, Detokenized)):
                call.resolve(reply=record)
            else:
                raise ProtocolViolation(f"{type(record).__name__.lower()} record answers call {rid}")
            return
        if rid in self.forgotten:
            log.warning("dropping a %s record for request %d, failed earlier by attribution",
                        type(record).__name__.lower(), rid)
            if isinstance(record, (Done, Error)):
                self.forgotten.discard(rid)
            return
        raise ProtocolViolation(f"{type(record).__name__.lower()} record for unknown request {rid}")

    def _end(self, rid: int) -> None:
        """``rid`` got its terminal record: free its slot."""
        del self.running[rid]
        self.runtime._work.set()
        self.changed.set()

    def _blame(self, blamed: list[tuple[int, Error]]) -> None:
        """Fail the requests attribution found broken; nothing else is touched."""
        for rid, error in blamed:
            message = f"the worker could not read this request ({error.code}: {error.message})"
            failure = GenerationError(error.code, message, details=dict(error.details))
            gen = self.running.pop(rid, None)
            if gen is not None:
                self.client.cancel(rid)  # in case attribution was wrong: free its slot too
                self.forgotten.add(rid)
                self.runtime._record_terminal(_error_entry(error, rid))
                gen._fail(failure)
                self.runtime._work.set()
                self.changed.set()
            call = self.calls.pop(rid, None)
            if call is not None:
                self.forgotten.add(rid)
                call.resolve(error=failure)

    # -- watchdog ------------------------------------------------------------------------

    async def _watch(self) -> None:
        """Cancel grace deadlines, and stall/idle pings (the watchdog never reads records)."""
        runtime = self.runtime
        while self.failure is None:  # once failed, the link's tasks are being cancelled
            now = trio.current_time()
            for rid, gen in list(self.running.items()):
                if self._grace_due(gen) <= now:
                    error = self.null_ids.claim(rid)
                    if error is None:
                        raise WorkerHung(f"worker did not stop request {rid} within the "
                                         f"{runtime.cancel_grace:g} s cancel grace")
                    self._blame([(rid, error)])
            quiet_limit = runtime.stall_timeout if self.occupied else runtime.health_interval
            if not self.probing and now - self.quiet_since >= quiet_limit:
                if self.occupied:
                    self.stall_logged = True
                    log.warning("worker stalled: %s; pinging it", self.stall_description(now))
                self.probing = True
                assert self._nursery is not None
                self._nursery.start_soon(self._guarded, self._probe)
            deadlines = [self._grace_due(gen) for gen in self.running.values()]
            if not self.probing:
                deadlines.append(self.quiet_since + quiet_limit)
            self.changed = trio.Event()
            with trio.move_on_at(min(deadlines, default=float("inf"))):
                await self.changed.wait()

    async def _probe(self) -> None:
        """Ping; no pong within ``health_timeout`` → WorkerHung."""
        timeout = self.runtime.health_timeout
        try:
            await self.call(prepare(Ping(), max_line_bytes=self.client.max_line_bytes), timeout,
                            shield=False)
        except GenerationError as exc:
            if self.failure is not None:
                return
            if exc.code == "worker_unavailable":  # no answer and no progress in time
                if self.occupied:
                    raise WorkerHung(f"worker stalled with generations in flight "
                                     f"({self.stall_description(trio.current_time())}) and did "
                                     f"not answer a ping within {timeout:g} s") from None
                raise WorkerHung(f"worker fell silent while idle and did not answer a ping "
                                 f"within {timeout:g} s") from None
            # An error record answering the ping: the worker is alive, if confused.
            log.warning("worker answered a ping with %s: %s", exc.code, exc.message)
        finally:
            self.probing = False
            self.changed.set()


# How much later than a cancel a step may seem to have begun and still count as the step that
# was running when the cancel was sent: its start is estimated from when its progress record
# was read, which a loaded parent may do late.
_STEP_START_SLACK = 1.0


def _only_cancelled(exc: BaseException) -> bool:
    """Cancelled, possibly inside (nested) exception groups of the link's nursery."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _error_entry(error: Error, rid: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "error", "id": error.id if rid is None else rid,
                             "code": error.code, "message": error.message}
    entry.update(error.details)
    return entry
