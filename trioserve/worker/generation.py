"""One generation as its request handler sees it, and one call waiting for its reply.

A :class:`Generation` is the mailbox between the runtime's reader (which pushes the text of
each token record, then the terminal record) and the handler that iterates it. The mailbox
coalesces: when the client is slower than the model, text accumulates (bounded by the context
window) and is taken in one piece; when the client keeps up, every token is delivered as it
arrives. Pushing never blocks, so a slow client cannot stall the reader. Admission,
multiplexing and cancellation are ``trioserve.worker.runtime``'s.

A Generation owns its state: the runtime and the worker link move it through its states
(:class:`GenerationState`) and feed it only through its methods (``start_dispatch``,
``start_running``, ``hear``, ``push``, ``finish``, ``fail``, ``note_cancel_sent``), and
``cancel`` reaches back only through what it was given: the queue it waits in
(``work_queue.WorkQueue``) and, once running, the link's cancel for it.
"""

from __future__ import annotations

import enum
from typing import Any, AsyncIterator, Callable

import trio

from trioserve.worker.protocol import Done, GenerateParams, PreparedRequest, Record
from trioserve.worker.work_queue import WorkQueue

__all__ = ["GenerationError", "Generation", "PendingCall", "GenerationState"]


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


class GenerationState(enum.Enum):
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

    def __init__(self, queue: WorkQueue[Generation], params: GenerateParams,
                 prepared: PreparedRequest) -> None:
        self.params = params
        self.request_id: int | None = None
        self.done: Done | None = None
        # The pool index of the worker serving it (set by WorkerPool.submit; 0 with one
        # worker): the stats carry it so each worker's KV-cache gauge stays its own.
        self.worker = 0
        self._queue = queue  # where it waits while QUEUED
        self._prepared = prepared
        self._state = GenerationState.QUEUED
        self._send_cancel: Callable[[], None] | None = None  # the running link's cancel for it
        self._parts: list[str] = []
        self.text_parts: list[str] = []  # every piece pushed, in order (session replay reads it)
        self._error: GenerationError | None = None
        self._wakeup: trio.Event | None = None
        self._cancel_requested = False
        self._heard = False  # the worker wrote at least one record for it
        self._grace_deadline = float("inf")  # set when the link sends its cancel frame
        self._cancel_sent_at = float("inf")  # when the link sent its cancel frame

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
        if self._cancel_requested or self._state is GenerationState.FINISHED:
            return
        self._cancel_requested = True
        if self._state is GenerationState.QUEUED:
            self._queue.drop(self)
            self.fail(GenerationError("cancelled", "generation cancelled before it started"))
        elif self._state is GenerationState.RUNNING and self._send_cancel is not None:
            self._send_cancel()
        # STARTING: the dispatcher sends the cancel frame as soon as the id is chosen.

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    # -- runtime side: the dispatcher, the reader and the watchdog --------------------------

    @property
    def prepared(self) -> PreparedRequest:
        """The encoded request line (the dispatcher writes it)."""
        return self._prepared

    def start_dispatch(self) -> None:
        """Taken from the queue by the dispatcher: STARTING until its id is chosen."""
        assert self._state is GenerationState.QUEUED, self._state
        self._state = GenerationState.STARTING

    def start_running(self, request_id: int, send_cancel: Callable[[], None]) -> None:
        """Its id is chosen and its line is being written: RUNNING. ``send_cancel`` (the
        link's cancel for this id; synchronous) is what ``cancel`` calls from now on."""
        assert self._state is GenerationState.STARTING, self._state
        self.request_id = request_id
        self._send_cancel = send_cancel
        self._state = GenerationState.RUNNING

    @property
    def heard(self) -> bool:
        """The worker wrote at least one record for it."""
        return self._heard

    def hear(self) -> bool:
        """A record for it arrived; whether it was the first."""
        first = not self._heard
        self._heard = True
        return first

    def note_cancel_sent(self, now: float, grace: float) -> None:
        """The link sent its cancel frame at ``now``: the worker owes its terminal record
        within ``grace`` s (the earliest deadline stands when it is sent again)."""
        self._grace_deadline = min(self._grace_deadline, now + grace)
        self._cancel_sent_at = min(self._cancel_sent_at, now)

    @property
    def grace_deadline(self) -> float:
        """When the cancel grace runs out (inf: no cancel sent)."""
        return self._grace_deadline

    @property
    def cancel_sent_at(self) -> float:
        """When the first cancel frame was sent (inf: none)."""
        return self._cancel_sent_at

    def push(self, text: str) -> None:
        """Text of a token record; wakes the consumer. Never blocks."""
        self._parts.append(text)
        self.text_parts.append(text)
        self._wake()

    def finish(self, done: Done) -> None:
        """The terminal ``done`` record: FINISHED."""
        self._state = GenerationState.FINISHED
        self.done = done
        self._wake()

    def fail(self, error: GenerationError) -> None:
        """Failed (an error record, the worker gone, cancelled while queued): FINISHED."""
        self._state = GenerationState.FINISHED
        self._error = error
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None


class PendingCall:
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
