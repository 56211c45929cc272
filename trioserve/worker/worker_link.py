"""One worker incarnation serving a SessionRuntime: dispatcher, reader and watchdog.

``SessionRuntime.serve(client)`` runs a :class:`WorkerLink` for as long as the worker lives
(see ``trioserve.worker.runtime`` for the guarantees). The *dispatcher* sends queued
generates while slots are free, the *reader* is the only task reading records (one wake-up
per read of stdout: it routes every record of the read by id and never blocks on anything
but the worker's stdout), the *watchdog* keeps cancel grace deadlines and pings a worker
that shows no progress. Error records with a null id are attributed by :class:`NullIdErrors`.

What the link shares with the runtime is the work queue (``work_queue.WorkQueue``: the waiting
generations, the dispatcher's wake-up, the arrivals) and the settings and logs of
:class:`LinkOwner`; it moves each Generation through its states only by the Generation's own
methods.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Protocol

import trio

from trioserve.worker.client import WorkerClient
from trioserve.worker.generation import Generation, GenerationError, PendingCall
from trioserve.worker.protocol import (
    Ack,
    Detokenized,
    Done,
    Error,
    Ping,
    Pong,
    PreparedRequest,
    Progress,
    ProtocolViolation,
    Ready,
    Record,
    Token,
    Tokens,
    WorkerError,
    WorkerHung,
    prepare,
)
from trioserve.worker.work_queue import WorkQueue

# The runtime's logger: these are its messages (operators and tests filter on it).
log = logging.getLogger("trioserve.worker.runtime")

# Worker error codes that say "not now" rather than "never": the same request may succeed
# once another generation or session has finished.
_RETRYABLE_CODES = frozenset({"capacity_exhausted", "session_busy"})
# Calls the worker runs on its call thread and stops on a cancel frame (worker protocol §7).
CANCELLABLE_CALLS = frozenset({"tokenize", "detokenize"})
# How long a dispatcher that finds the worker idle waits for requests that are still
# arriving (see SessionRuntime.arrival). Long enough for a burst's handlers to validate and
# render (1-4 ms each on the 2-core reference host), short against a prefill.
GATHER_WINDOW = 0.010


class NullIdErrors:
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


class LinkOwner(Protocol):
    """What a link needs of the runtime that runs it (``SessionRuntime``): its settings, the
    work queue both share (work_queue.py), the dispatch counter and the terminal-record log."""

    work_queue: WorkQueue[Generation]
    cancel_grace: float
    stall_timeout: float
    health_interval: float
    health_timeout: float
    null_id_limit: int
    dispatched: int  # generations that reached the worker; the link counts them

    def record_terminal(self, entry: dict[str, Any]) -> None: ...


class WorkerLink:
    """The runtime's state for one worker incarnation: in-flight generations by id,
    pending calls by id, liveness clock. Lives exactly as long as ``SessionRuntime.serve``.

    Invariant: an id is in ``running`` or ``calls`` from the moment it is allocated (before
    its line is written) until its terminal record (or reply) arrives or the link fails.
    """

    def __init__(self, runtime: LinkOwner, client: WorkerClient) -> None:
        self.runtime = runtime
        self.client = client
        ready: Ready = client.ready
        self.capacity = ready.capacity
        self.running: dict[int, Generation] = {}
        self.starting: Generation | None = None
        self.calls: dict[int, PendingCall] = {}
        self.forgotten: set[int] = set()  # ids failed by attribution; late records dropped
        self.null_ids = NullIdErrors(runtime.null_id_limit)
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
            gen.fail(error)
        self.running.clear()
        if self.starting is not None:
            self.starting.fail(error)
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
        for gen in self.runtime.work_queue:
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
        queue = runtime.work_queue
        while True:
            while (gen := self._next_dispatchable()) is None:
                await queue.wait_for_change()
            if not self.running and queue.arriving:
                # Idle worker, more requests on their way in: let them queue so the worker
                # admits them together (SessionRuntime.arrival). FIFO still holds: the oldest
                # dispatchable generation goes first.
                with trio.move_on_after(GATHER_WINDOW):
                    while queue.arriving:
                        await queue.wait_for_change()
                if (gen := self._next_dispatchable()) is None:
                    continue
            queue.take(gen)
            gen.start_dispatch()
            self.starting = gen

            def register(rid: int, gen: Generation = gen) -> None:
                if not self.running:  # idle until now: the worker owed nothing before
                    self.quiet_since = self.progress_at = trio.current_time()
                gen.start_running(rid, partial(self.cancel, gen))
                self.starting = None
                self.running[rid] = gen
                runtime.dispatched += 1
                self.changed.set()
                if gen.cancel_requested:
                    # Cancelled while waiting for the write lock: the frame may precede the
                    # line; the worker latches frames for ids it has not read yet.
                    self.cancel(gen)

            await self.client.send_request(gen.prepared, progress_timeout=runtime.health_timeout,
                                           register=register)

    def cancel(self, gen: Generation) -> None:
        assert gen.request_id is not None
        self.client.cancel(gen.request_id)
        gen.note_cancel_sent(trio.current_time(), self.runtime.cancel_grace)
        self.changed.set()

    def _grace_due(self, gen: Generation) -> float:
        """When ``gen``'s cancel grace runs out. A cancel that cannot abort the running step
        (a decode sharing it with other generations' work, spec §7) takes effect at the step's
        end; while that step keeps computing (progress records, spec §4.4) the grace counts
        from its last progress, so a long step on a loaded CPU is not taken for a worker that
        ignores cancels."""
        due = gen.grace_deadline
        sent_at = gen.cancel_sent_at
        if (due != float("inf") and self.step_progress_at >= sent_at
                and self.step_started_at <= sent_at + _STEP_START_SLACK):
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
        call = PendingCall()

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
                if prepared.op in CANCELLABLE_CALLS and call.request_id is not None:
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
        running = self.running
        while True:
            batch = await receive_batch()
            now = trio.current_time()
            for record in batch:
                if type(record) is Progress:
                    self._note_progress(record)
                    continue
                self.quiet_since = self.progress_at = now
                if type(record) is Token:
                    # The hot path (one per token per stream): a generation already heard
                    # from takes its text; anything else is _route's (first record, ids
                    # that are not running generations).
                    gen = running.get(record.id)
                    if gen is not None and gen.heard:
                        gen.push(record.text)
                        continue
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
            silent = {rid for rid, gen in self.running.items() if not gen.heard}
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
            if gen.hear():
                self._blame(self.null_ids.heard(rid))  # may blame others, never this one
            if isinstance(record, Token):
                gen.push(record.text)
            elif isinstance(record, Done):
                self._end(rid)
                self.runtime.record_terminal(dict(record.record))
                gen.finish(record)
            elif isinstance(record, Error):
                self._end(rid)
                self.runtime.record_terminal(_error_entry(record))
                gen.fail(GenerationError(record.code, record.message or "worker error",
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
        self.runtime.work_queue.wake()
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
                self.runtime.record_terminal(_error_entry(error, rid))
                gen.fail(failure)
                self.runtime.work_queue.wake()
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


def only_cancelled(exc: BaseException) -> bool:
    """Cancelled, possibly inside (nested) exception groups of the link's nursery."""
    if isinstance(exc, BaseExceptionGroup):
        return all(only_cancelled(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)


def _error_entry(error: Error, rid: int | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {"type": "error", "id": error.id if rid is None else rid,
                             "code": error.code, "message": error.message}
    entry.update(error.details)
    return entry
