"""SessionRuntime: admission, serialization and cancellation over one worker.

The runtime turns "generate this prompt" into an async stream of text and a final
``Done``, and guarantees three things whatever the caller does:

* **One generation in flight per worker.** Requests wait in a FIFO queue of bounded
  depth; past it, ``submit`` fails at once with ``server_busy``.
* **Leaving early frees the worker.** ``Generation.cancel()`` is synchronous and
  idempotent, so a handler calls it from ``finally`` without awaiting (a cancelled
  handler must not await there). A queued generation is dropped before it reaches the
  worker; a running one gets a cancel frame on the out-of-band pipe, and the dispatcher
  waits for its terminal record at most ``cancel_grace`` seconds before declaring the
  worker hung (the supervisor then kills it).
* **Nothing waits forever.** A dead or hung worker fails the running generation and
  every queued one with a retryable ``worker_unavailable`` error.

Concurrency shape: handlers run in hypercorn's per-request tasks; the dispatcher
(``serve``) runs in the supervisor's nursery, under the app nursery. They meet only
through ``Generation`` objects: the dispatcher pushes text into a generation's mailbox,
the handler drains it. The mailbox coalesces: when the client is slower than the model,
text accumulates (bounded by the context window) and is taken in one piece; when the
client keeps up, every token is delivered as it arrives. It never blocks the dispatcher,
so a slow client cannot stall the decode loop or other requests' admission.

No OpenAI knowledge here: prompts are already rendered, errors carry worker codes.
"""

from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import trio

from .worker_client import ProtocolViolation, WorkerClient, WorkerError

log = logging.getLogger("trioserve.runtime")


@dataclass(frozen=True)
class GenerateParams:
    """A fully rendered generation request (worker protocol §4 fields)."""

    prompt: str
    max_new_tokens: int = -1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    session_id: str | None = None
    # --- prompt segments (issue 9 item 2; worker protocol v2 §5) --- added by the profiles
    # branch. ``(text, special)`` pieces concatenating to ``prompt``: special=False text (client
    # content) is tokenized without parsing special tokens. When set, it is sent instead of
    # ``prompt``; ``prompt`` stays the full text for the control plane's own use.
    prompt_segments: tuple[tuple[str, bool], ...] | None = None
    # GBNF (root rule "root") the worker constrains sampling with; protocol v2 §6.
    grammar: str | None = None

    def to_wire(self, request_id: int) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "op": "generate",
            "id": request_id,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": list(self.stop),
        }
        if self.prompt_segments is not None:  # profiles branch: segments replace the prompt
            wire["prompt_segments"] = [{"text": t, "special": sp} for t, sp in self.prompt_segments]
        else:
            wire["prompt"] = self.prompt
        if self.grammar is not None:
            wire["grammar"] = self.grammar
        if self.seed is not None:
            wire["seed"] = self.seed
        if self.session_id is not None:
            wire["session_id"] = self.session_id
        return wire


@dataclass(frozen=True)
class Done:
    """The worker's terminal ``done`` record, typed."""

    finish_reason: str
    cancelled: bool
    prompt_tokens: int
    completion_tokens: int
    stop_string: str | None
    record: dict[str, Any] = field(repr=False)

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Done:
        return cls(
            finish_reason=record.get("finish_reason") or "stop",
            cancelled=bool(record.get("cancelled")),
            prompt_tokens=int(record.get("prompt_tokens") or 0),
            completion_tokens=int(record.get("completion_tokens") or 0),
            stop_string=record.get("stop_string"),
            record=record,
        )


class GenerationError(Exception):
    """A generation failed. ``code`` is a worker error code or one of the runtime's:

    ``server_busy`` (queue full), ``worker_unavailable`` (no ready worker, or it died or
    was killed during this request). ``retryable`` says whether the same request may
    succeed later; ``details`` carries extra fields of the worker's error record.
    """

    def __init__(self, code: str, message: str, *, retryable: bool = False,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.details = details or {}


class _State(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    FINISHED = "finished"


class Generation:
    """One submitted generation, as seen by the request handler.

    Iterate it (``async for piece in gen``) to get text pieces; ``gen.done`` holds the
    ``Done`` once iteration ends. Iteration raises GenerationError on failure. Call
    ``cancel()`` when leaving early — always safe, never blocks.
    """

    def __init__(self, runtime: SessionRuntime, params: GenerateParams) -> None:
        self.params = params
        self.request_id: int | None = None
        self.done: Done | None = None
        self._runtime = runtime
        self._state = _State.QUEUED
        self._parts: list[str] = []
        self._error: GenerationError | None = None
        self._wakeup: trio.Event | None = None
        self._cancel_requested = False
        # Set by the dispatcher while it waits for this generation's records; cancel()
        # pulls its deadline in to bound the wait for the terminal record.
        self._wait_scope: trio.CancelScope | None = None

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

        Queued: it is removed and never reaches the worker. Running: a cancel frame goes to
        the worker and the wait for its terminal record is bounded by the runtime's grace
        period. Finished: nothing happens.
        """
        if self._cancel_requested or self._state is _State.FINISHED:
            return
        self._cancel_requested = True
        if self._state is _State.QUEUED:
            self._runtime._drop_queued(self)
            self._fail(GenerationError("cancelled", "generation cancelled before it started"))
            return
        self._runtime._cancel_running(self)

    @property
    def cancel_requested(self) -> bool:
        return self._cancel_requested

    # -- dispatcher side -------------------------------------------------------------

    def _push(self, text: str) -> None:
        self._parts.append(text)
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


class WorkerHung(WorkerError):
    """The worker missed a deadline (cancel grace or health check) and must be killed."""


class SessionRuntime:
    """Admission queue and dispatcher for one worker at a time.

    ``submit`` is called by request handlers. ``serve(client)`` is run by the supervisor
    for each worker incarnation; it returns never, and raises WorkerError when the worker
    has to go (died, hung, broke the protocol) after failing every pending generation.
    """

    def __init__(self, *, queue_depth: int = 16, cancel_grace: float = 2.0,
                 health_interval: float = 30.0, health_timeout: float = 10.0) -> None:
        self.queue_depth = queue_depth
        self.cancel_grace = cancel_grace
        self.health_interval = health_interval
        self.health_timeout = health_timeout
        self._queue: collections.deque[Generation] = collections.deque()
        self._work = trio.Event()
        self._client: WorkerClient | None = None
        self._running: Generation | None = None
        self._unavailable_reason = "worker is loading"
        # Observability (tests, /health, benchmarks): generations that reached the worker,
        # and the terminal records of the most recent ones.
        self.dispatched = 0
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=256)
        self.last_terminal_time = 0.0  # trio clock when the last terminal record arrived

    # -- handler side ----------------------------------------------------------------

    def submit(self, params: GenerateParams) -> Generation:
        """Queue a generation. Raises GenerationError (``worker_unavailable`` when no
        ready worker, ``server_busy`` when the queue is full) without queueing."""
        if self._client is None:
            raise GenerationError("worker_unavailable", self._unavailable_reason, retryable=True)
        if len(self._queue) >= self.queue_depth:
            raise GenerationError(
                "server_busy", f"{len(self._queue)} requests are already waiting", retryable=True)
        gen = Generation(self, params)
        self._queue.append(gen)
        self._work.set()
        return gen

    @property
    def queued(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._running is not None

    def _drop_queued(self, gen: Generation) -> None:
        try:
            self._queue.remove(gen)
        except ValueError:
            pass

    def _cancel_running(self, gen: Generation) -> None:
        client = self._client
        if client is not None and gen.request_id is not None:
            client.cancel(gen.request_id)
        scope = gen._wait_scope
        if scope is not None:
            scope.deadline = min(scope.deadline, trio.current_time() + self.cancel_grace)

    # -- dispatcher side -------------------------------------------------------------

    def set_unavailable(self, reason: str) -> None:
        """Record why no worker is serving (reported by ``submit``'s errors)."""
        self._unavailable_reason = reason

    async def serve(self, client: WorkerClient) -> None:
        """Dispatch queued generations to ``client`` one at a time, forever.

        Raises WorkerError when the worker must be replaced; before raising, the running
        generation and all queued ones are failed with a retryable ``worker_unavailable``.
        Cancellation (shutdown) fails them the same way.
        """
        self._client = client
        try:
            while True:
                gen = await self._next_generation(client)
                await self._run(client, gen)
        except BaseException as exc:
            reason = _describe(exc)
            self._client = None
            self._unavailable_reason = reason
            self._fail_all(GenerationError("worker_unavailable", reason, retryable=True))
            raise
        finally:
            self._client = None

    async def _next_generation(self, client: WorkerClient) -> Generation:
        """Wait for queued work. While idle, watch the worker: an idle worker that exits or
        writes anything is a failure detected at once (not at the next request), and one
        that stays silent for ``health_interval`` gets a bounded ping."""
        while not self._queue:
            self._work = trio.Event()
            failure: WorkerError | None = None
            async with trio.open_nursery() as nursery:

                async def watch_worker() -> None:
                    nonlocal failure
                    try:
                        record = await client.receive()
                        failure = ProtocolViolation(f"unexpected record from an idle worker: {record!r:.200}")
                    except WorkerError as exc:
                        failure = exc
                    nursery.cancel_scope.cancel()

                async def wait_for_work() -> None:
                    with trio.move_on_after(self.health_interval):
                        await self._work.wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(watch_worker)
                nursery.start_soon(wait_for_work)
            if failure is not None:
                raise failure
            if not self._queue:
                await self._health_check(client)
        return self._queue.popleft()

    async def _health_check(self, client: WorkerClient) -> None:
        rid = client.next_request_id()
        with trio.move_on_after(self.health_timeout) as scope:
            await client.send({"op": "ping", "id": rid})
            record = await client.receive()
        if scope.cancelled_caught:
            raise WorkerHung(f"worker did not answer a health check within {self.health_timeout:g} s")
        if record.get("type") != "pong" or record.get("id") != rid:
            raise WorkerError(f"unexpected answer to a health check: {record!r:.200}")

    async def _run(self, client: WorkerClient, gen: Generation) -> None:
        rid = client.next_request_id()
        gen.request_id = rid
        gen._state = _State.RUNNING
        self._running = gen
        self.dispatched += 1
        try:
            await client.send(gen.params.to_wire(rid))
            with trio.CancelScope() as scope:
                gen._wait_scope = scope
                if gen.cancel_requested:  # cancelled between dequeue and send
                    self._cancel_running(gen)
                while True:
                    record = await client.receive()
                    kind = record["type"]
                    if record.get("id") != rid:
                        raise WorkerError(f"record for request {record.get('id')!r} while {rid} runs")
                    if kind == "token":
                        gen._push(record["text"])
                        continue
                    self.history.append(record)
                    self.last_terminal_time = trio.current_time()
                    if kind == "done":
                        gen._finish(Done.from_record(record))
                        return
                    elif kind == "error":
                        details = {k: v for k, v in record.items() if k not in ("type", "id", "code", "message")}
                        gen._fail(GenerationError(str(record.get("code") or "engine_error"),
                                                  str(record.get("message") or "worker error"),
                                                  details=details))
                        return
                    else:
                        raise WorkerError(f"unexpected record during generation: {kind!r}")
            # Only reachable when the cancel grace expired before the terminal record.
            raise WorkerHung(
                f"worker did not stop request {rid} within the {self.cancel_grace:g} s cancel grace")
        except BaseException as exc:
            if gen._state is not _State.FINISHED:
                gen._fail(GenerationError("worker_unavailable", _describe(exc), retryable=True))
            raise
        finally:
            gen._wait_scope = None
            self._running = None

    def _fail_all(self, error: GenerationError) -> None:
        while self._queue:
            self._queue.popleft()._fail(error)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, trio.Cancelled):
        return "server is shutting down"
    if isinstance(exc, WorkerError):
        return str(exc)
    return f"worker transport failed: {exc!r}"

