"""One generation as its request handler sees it, and one call waiting for its reply.

A :class:`Generation` is the mailbox between the runtime's reader (which pushes the text of
each token record, then the terminal record) and the handler that iterates it. The mailbox
coalesces: when the client is slower than the model, text accumulates (bounded by the context
window) and is taken in one piece; when the client keeps up, every token is delivered as it
arrives. Pushing never blocks, so a slow client cannot stall the reader. Admission,
multiplexing and cancellation are ``trioserve.worker.runtime``'s.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, AsyncIterator

import trio

from trioserve.worker.protocol import Done, GenerateParams, PreparedRequest, Record

if TYPE_CHECKING:
    from trioserve.worker.runtime import SessionRuntime
    from trioserve.worker.worker_link import WorkerLink

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
        self._state = GenerationState.QUEUED
        self._link: WorkerLink | None = None  # the incarnation running it
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
        if self._cancel_requested or self._state is GenerationState.FINISHED:
            return
        self._cancel_requested = True
        if self._state is GenerationState.QUEUED:
            self._runtime._drop_queued(self)
            self._fail(GenerationError("cancelled", "generation cancelled before it started"))
        elif self._state is GenerationState.RUNNING and self._link is not None:
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
        self._state = GenerationState.FINISHED
        self.done = done
        self._wake()

    def _fail(self, error: GenerationError) -> None:
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
