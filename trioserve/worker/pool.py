"""WorkerPool: several workers under one control plane (``--workers N``).

Each worker is a (SessionRuntime, Supervisor) pair, exactly what one server ran before
pools existed: its own process, admission queue, multiplexer, watchdog and restart policy.
The pool puts a router in front of them (worker/routing.py) and presents the surface the
serving core, the API adapters and the app already used on one runtime and one supervisor
(``submit``, ``call``, ``close_session``, ``arrival``, counters; ``run``, ``stop``,
``state``, ``fatal``, ...). With one worker that surface returns the one worker's values
and every request goes to it: the single-worker server IS the N = 1 pool, not a second path.

Isolation: pairs share nothing but the pool's routing state. A worker that dies, hangs or
restarts fails only the generations its own runtime holds (its runtime's contract); the
other runtimes never see it. A pool is ``ready`` while any worker is ready, ``loading``
while none is but one may come, ``unavailable`` when none will; ``fatal`` is set only when
every worker's supervisor gave up (one crash-looping worker does not stop the server).

Cancellation: ``run`` runs every supervisor in one nursery and reports started at once
(each worker loads in the background); ``stop`` stops them all concurrently, each bounded
by its supervisor's own stop deadlines. ``submit`` never awaits.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import trio

from trioserve.worker.runtime import Arrival, Generation, SessionRuntime
from trioserve.worker.supervisor import Supervisor, public_reason
from trioserve.worker.protocol import GenerateParams, Record, Request
from trioserve.worker.routing import (Load, ResidentPrefixes, choose_anonymous, key_order, prompt_text,
                                     routing_key)
from trioserve.worker.tokenize_gate import TokenizeGate

__all__ = ["PoolArrival", "PoolWorker", "WorkerPool"]


@dataclass
class PoolWorker:
    """One worker of a pool: its index (the ``worker`` label and response header), the
    runtime that multiplexes it and the supervisor that keeps it alive."""

    index: int
    runtime: SessionRuntime
    supervisor: Supervisor
    prefixes: ResidentPrefixes = field(default_factory=ResidentPrefixes)

    @property
    def load(self) -> Load:
        return Load(self.index, self.runtime.in_flight + self.runtime.queued,
                    self.runtime.capacity)

    def health(self) -> dict[str, Any]:
        """This worker's public /health entry (no pids, paths or worker messages)."""
        entry: dict[str, Any] = {"worker": self.index, "status": self.supervisor.state}
        if self.supervisor.state != "ready":
            entry["reason"] = public_reason(self.supervisor)
            crash = getattr(self.supervisor, "crash", None)  # the signal in words (spec §13)
            if crash:
                entry["crash"] = crash
        entry.update(queued=self.runtime.queued, running=self.runtime.in_flight,
                     restarts=self.supervisor.restarts)
        return entry


class PoolArrival:
    """An ``Arrival`` on every worker's runtime: the worker a request goes to is known only
    once its body is parsed. ``done()`` (idempotent) ends all of them."""

    def __init__(self, runtimes: list[SessionRuntime]) -> None:
        self._arrivals = [Arrival(runtime) for runtime in runtimes]

    def done(self) -> None:
        for arrival in self._arrivals:
            arrival.done()


class WorkerPool:
    """Routes requests over ``workers`` and supervises them (module docstring)."""

    def __init__(self, workers: list[PoolWorker], *,
                 on_route: Callable[[int], None] | None = None) -> None:
        # The app appends its workers after building the core (their readiness callback
        # needs it); a pool serves once it holds at least one.
        self.workers = workers
        # Told the chosen worker's index in the submitting task (the HTTP layer turns it into
        # the response's x-trioserve-worker header); the pool knows nothing of HTTP.
        self._on_route = on_route
        self.fatal = trio.Event()
        # Clients' tokenizer requests, for the whole pool (tokenize_gate.py); the app sizes it
        # once it knows the workers and the queue depth (configure_tokenize_gate).
        self.tokenize_gate = TokenizeGate()
        self._cancel_scope = trio.CancelScope()
        self._stopped = trio.Event()

    def configure_tokenize_gate(self, queue_depth: int) -> None:
        """Size the tokenizer gate: each worker's call thread runs one call at a time, so
        two per worker are at the workers (one running, one ready behind it) and
        ``queue_depth`` more may wait."""
        self.tokenize_gate = TokenizeGate(in_flight=2 * max(1, len(self.workers)), waiting=queue_depth)

    # -- routing -----------------------------------------------------------------------

    def route(self, params: GenerateParams) -> PoolWorker:
        """The worker for a generation (worker/routing.py). A worker that is not serving is
        chosen only when none is, and then its runtime refuses with ``worker_unavailable``."""
        serving = [w for w in self.workers if w.runtime.serving]
        if params.session_id is not None:
            order = [self.workers[i] for i in key_order(routing_key(params.session_id),
                                                        len(self.workers))]
            return next((w for w in order if w.runtime.serving), order[0])
        if not serving:
            return self.workers[0]
        if len(serving) == 1:
            return serving[0]
        prompt = prompt_text(params)
        shared = {w.index: w.prefixes.longest(prompt) for w in serving}
        return self.workers[choose_anonymous([w.load for w in serving], shared)]

    def key_worker(self, session_id: str) -> PoolWorker:
        """The worker a session key is routed to now (diagnostics and tests)."""
        return self.route(GenerateParams(session_id=session_id))

    # -- the runtime surface (serving core, API adapters, app) ----------------------------

    @contextlib.contextmanager
    def arrival(self) -> Iterator[PoolArrival]:
        """``SessionRuntime.arrival`` for the pool: marks the request on every worker."""
        token = PoolArrival([w.runtime for w in self.workers])
        try:
            yield token
        finally:
            token.done()

    def submit(self, params: GenerateParams, *, arrival: Any = None) -> Generation:
        """Admit a generation on its worker (``SessionRuntime.submit``'s contract and errors);
        the worker's index goes to the response's ``x-trioserve-worker`` header."""
        if arrival is not None:
            arrival.done()
        worker = self.route(params)
        gen = worker.runtime.submit(params)
        gen.worker = worker.index
        if self._on_route is not None:
            self._on_route(worker.index)
        if params.session_id is None:
            worker.prefixes.add(prompt_text(params))
        return gen

    async def call(self, request: Request, *, timeout: float | None = None) -> Record:
        """``SessionRuntime.call`` on the least loaded serving worker (tokenize and the like:
        every worker serves the same model)."""
        serving = [w for w in self.workers if w.runtime.serving] or self.workers[:1]
        worker = min(serving, key=lambda w: (w.load.ratio, w.index))
        return await worker.runtime.call(request, timeout=timeout)

    async def close_session(self, session_id: str) -> bool:
        """Free ``session_id`` on every serving worker (a key may have moved while its worker
        restarted). ``session_busy`` when any worker has it running or queued (checked on all
        before any is closed); ``worker_unavailable`` when no worker serves."""
        serving = [w for w in self.workers if w.runtime.serving]
        if not serving:
            return await self.workers[0].runtime.close_session(session_id)
        for worker in serving:
            worker.runtime.check_session_idle(session_id)
        found = False
        for worker in serving:
            found = await worker.runtime.close_session(session_id) or found
        return found

    @property
    def queued(self) -> int:
        return sum(w.runtime.queued for w in self.workers)

    @property
    def in_flight(self) -> int:
        return sum(w.runtime.in_flight for w in self.workers)

    @property
    def calls_in_flight(self) -> int:
        return sum(w.runtime.calls_in_flight for w in self.workers)

    @property
    def busy(self) -> bool:
        return self.in_flight > 0

    @property
    def capacity(self) -> int:
        return sum(w.runtime.capacity for w in self.workers)

    @property
    def dispatched(self) -> int:
        return sum(w.runtime.dispatched for w in self.workers)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Recent terminal records, worker by worker (each worker's in order)."""
        return list(itertools.chain.from_iterable(w.runtime.history for w in self.workers))

    @property
    def last_terminal_time(self) -> float:
        return max(w.runtime.last_terminal_time for w in self.workers)

    @property
    def client(self) -> Any:
        """The first serving worker's client (diagnostics; one worker: its client)."""
        return next((w.runtime.client for w in self.workers if w.runtime.client is not None), None)

    # -- the supervisor surface (app lifespan, /health, cli) ------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise every worker until ``stop()`` or until all have given up. Reports
        started once every supervisor has (at once: workers load in the background)."""
        try:
            with self._cancel_scope:
                async with trio.open_nursery() as nursery:
                    for worker in self.workers:
                        worker.supervisor.on_give_up = self._worker_gave_up
                        await nursery.start(worker.supervisor.run)
                    task_status.started()
        finally:
            self._stopped.set()

    def _worker_gave_up(self) -> None:
        # Runs inside the supervisor's give-up, so the pool's state and ``fatal`` change in
        # the same step. The pool is fatal only when no worker is left.
        if all(w.supervisor.fatal.is_set() for w in self.workers):
            self.fatal.set()

    async def stop(self) -> None:
        """Stop every worker concurrently (each bounded by its supervisor), then wait for
        ``run`` to end."""
        async with trio.open_nursery() as nursery:
            for worker in self.workers:
                nursery.start_soon(worker.supervisor.stop)
        self._cancel_scope.cancel()
        await self._stopped.wait()

    @property
    def state(self) -> str:
        states = {w.supervisor.state for w in self.workers}
        for state in ("ready", "loading"):
            if state in states:
                return state
        return "unavailable"

    @property
    def public_reason(self) -> str:
        """Why the pool is not ready, from its most hopeful worker (``""`` while ready)."""
        state = self.state
        if state == "ready":
            return ""
        worker = next(w for w in self.workers if w.supervisor.state == state)
        return public_reason(worker.supervisor)

    @property
    def reason(self) -> str:
        """The detailed reasons (log and tests only), worker by worker."""
        if len(self.workers) == 1:
            return self.workers[0].supervisor.reason
        return "; ".join(f"worker {w.index}: {w.supervisor.reason}" for w in self.workers
                         if w.supervisor.reason)

    @property
    def crash(self) -> str | None:
        """The signal (in words) that killed the last worker of the worker that speaks for a
        pool that is not ready (the same one as ``public_reason``); None while ready."""
        state = self.state
        if state == "ready":
            return None
        worker = next(w for w in self.workers if w.supervisor.state == state)
        return getattr(worker.supervisor, "crash", None)

    @property
    def kernel_path(self) -> dict[str, Any] | None:
        """A ready worker's kernel_path (the workers run the same build and settings)."""
        return next((w.supervisor.kernel_path for w in self.workers
                     if getattr(w.supervisor, "kernel_path", None) is not None), None)

    @property
    def restarts(self) -> int:
        return sum(w.supervisor.restarts for w in self.workers)

    @property
    def worker_pid(self) -> int | None:
        """The first worker's process id (one worker: its pid; see ``workers`` for all)."""
        return self.workers[0].supervisor.worker_pid

    @property
    def last_stop(self) -> str | None:
        return self.workers[0].supervisor.last_stop

    @property
    def last_restart_ms(self) -> float | None:
        return self.workers[0].supervisor.last_restart_ms

    def health(self) -> list[dict[str, Any]]:
        """Per-worker /health entries."""
        return [w.health() for w in self.workers]
