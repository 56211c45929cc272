"""Supervisor: owns the worker process — spawn, serve, kill, reap, restart.

The supervisor runs in the app nursery for the life of the server. Each worker
*incarnation* gets its own nursery holding the worker's stderr forwarder and the
runtime's dispatcher, so when an incarnation ends nothing of it outlives the nursery.

Health (``state``): ``loading`` while a worker starts, ``ready`` while one serves,
``unavailable`` (with ``reason``) after a failure, while waiting to restart, after a
crash loop and during shutdown.

Restart policy: a worker that dies, hangs or breaks the protocol is killed (SIGTERM,
bounded wait, SIGKILL, bounded wait, reap) and restarted after an exponential backoff.
``max_crashes`` failures inside ``crash_window`` seconds is a crash loop: the supervisor
stops restarting, stays ``unavailable`` and sets ``fatal`` so that a top-level server can
exit non-zero and let its orchestrator act.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import trio

from .runtime import SessionRuntime, WorkerHung
from .worker_client import ReadyInfo, WorkerClient, WorkerError

log = logging.getLogger("trioserve.supervisor")


class FatalStartupError(Exception):
    """The worker started but the server cannot use it (e.g. no chat template).

    Restarting would not help, so the supervisor gives up at once.
    """


@dataclass
class RestartPolicy:
    restart: bool = True
    backoff_initial: float = 0.5
    backoff_max: float = 15.0
    max_crashes: int = 5
    crash_window: float = 60.0


class Supervisor:
    """Keeps one worker serving ``runtime``.

    ``on_ready`` is called with each incarnation's ReadyInfo before it serves; raising
    FatalStartupError from it stops the supervisor for good.
    """

    def __init__(
        self,
        argv: list[str],
        runtime: SessionRuntime,
        *,
        on_ready: Callable[[ReadyInfo], None] = lambda info: None,
        env: dict[str, str] | None = None,
        ready_timeout: float = 300.0,
        stop_timeout: float = 2.0,
        kill_timeout: float = 2.0,
        policy: RestartPolicy | None = None,
    ) -> None:
        self.argv = argv
        self.runtime = runtime
        self.on_ready = on_ready
        self.env = env
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self.kill_timeout = kill_timeout
        self.policy = policy or RestartPolicy()
        self.state = "loading"
        self.reason = "worker is starting"
        self.fatal = trio.Event()
        self.worker_pid: int | None = None
        self.restarts = 0
        self.last_restart_ms: float | None = None  # failure detected → ready again
        self.last_stop: str | None = None  # how the last worker ended: exited/sigterm/sigkill
        self._crash_times: list[float] = []
        self._cancel_scope = trio.CancelScope()
        self._stopped = trio.Event()

    # -- lifecycle ---------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise until ``stop()`` or a fatal failure. Reports started at once: the
        first worker loads in the background while ``/health`` says ``loading``."""
        task_status.started()
        backoff = self.policy.backoff_initial
        try:
            with self._cancel_scope:
                while True:
                    failed_at = await self._run_incarnation()
                    if failed_at is None:  # fatal: reason already set
                        return
                    self._crash_times = [t for t in self._crash_times
                                         if failed_at - t < self.policy.crash_window] + [failed_at]
                    if not self.policy.restart:
                        self._give_up(f"{self.reason}; restarts are disabled")
                        return
                    if len(self._crash_times) >= self.policy.max_crashes:
                        self._give_up(f"crash loop: {len(self._crash_times)} worker failures in "
                                      f"{self.policy.crash_window:g} s; last: {self.reason}")
                        return
                    log.warning("restarting the worker in %.2f s (%s)", backoff, self.reason)
                    self._set("loading", f"restarting in {backoff:g} s after: {self.reason}")
                    await trio.sleep(backoff)
                    backoff = min(backoff * 2, self.policy.backoff_max)
                    self.restarts += 1
        finally:
            if not self.fatal.is_set():
                self._set("unavailable", "server is shutting down")
            self._stopped.set()

    async def stop(self) -> None:
        """Stop supervising: fail pending work, stop the worker (bounded), wait for it."""
        self._set("unavailable", "server is shutting down")
        self._cancel_scope.cancel()
        await self._stopped.wait()

    async def _run_incarnation(self) -> float | None:
        """Run one worker from spawn to exit. Returns the failure time (monotonic), or
        None after a fatal startup error."""
        self._set("loading", "worker is starting")
        self.runtime.set_unavailable("worker is loading")
        started_failure = self._crash_times[-1] if self._crash_times else None
        client: WorkerClient | None = None
        hung = False
        async with trio.open_nursery() as nursery:
            try:
                client = await WorkerClient.spawn(
                    self.argv, nursery=nursery, env=self.env, ready_timeout=self.ready_timeout)
                self.worker_pid = client.process.pid
                self.on_ready(client.ready)
                self._set("ready", "")
                if started_failure is not None:
                    self.last_restart_ms = (time.monotonic() - started_failure) * 1000
                log.info("worker %d ready (%s)", client.process.pid, client.ready.model_name)
                await self.runtime.serve(client)
            except FatalStartupError as exc:
                self._give_up(str(exc))
                return None
            except WorkerError as exc:
                hung = isinstance(exc, WorkerHung)
                self._set("unavailable", str(exc))
                self.runtime.set_unavailable(str(exc))
                log.error("worker failed: %s", exc)
            except Exception as exc:
                # A bug on our side: report it through /health and the exit status rather
                # than let it escape into the app nursery (which would only disable the
                # lifespan and leave the server answering with no worker behind it).
                log.exception("supervisor failed")
                self._give_up(f"internal error: {exc!r}")
                return None
            finally:
                if client is not None:
                    with trio.CancelScope(shield=True):
                        await self._stop_worker(client, hung=hung)
        return time.monotonic()

    async def _stop_worker(self, client: WorkerClient, *, hung: bool) -> None:
        if hung:
            how = await client.stop(exit_wait=0, term_wait=self.kill_timeout)
        else:
            how = await client.stop(exit_wait=self.stop_timeout, term_wait=self.kill_timeout)
        log.info("worker %d stopped (%s, exit status %s)", client.process.pid, how,
                 client.process.returncode)
        self.last_stop = how

    # -- state -----------------------------------------------------------------------

    def _give_up(self, reason: str) -> None:
        log.error("giving up on the worker: %s", reason)
        self._set("unavailable", reason)
        self.runtime.set_unavailable(reason)
        self.fatal.set()

    def _set(self, state: str, reason: str) -> None:
        self.state = state
        self.reason = reason


__all__ = ["FatalStartupError", "RestartPolicy", "Supervisor", "WorkerHung"]
