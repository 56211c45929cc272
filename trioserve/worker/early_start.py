"""Workers started before the HTTP stack is imported (``trioserve serve``, issue #51).

WHY: the control plane imports about a second of Python (Quart, the API models, pydantic)
before its lifespan spawns the first worker, and that worker then spends seconds loading its
model. Started first, the worker loads while Python imports, so the server is ready about
that second sooner. Only a server of one model starts early: that model is pinned and
preloaded (worker/lifecycle.py), so its workers start at once in any case, with exactly the
command line and environment computed here (worker/launch.py, the same functions).

Ownership: an :class:`EarlyStarts` owns every process it started until a worker's supervisor
takes it (``spawn_for``: its first start takes the process and waits for the ready record as
for any spawn; later restarts spawn afresh). ``close`` kills and reaps the ones nobody took
(a startup error after the early start, an interrupted start); the CLI holds it in a ``with``
around the whole serve. A process started with another command line or environment than the
supervisor's is killed, never adopted.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import trio

from trioserve.config import Settings
from trioserve.registry import ModelRegistry
from trioserve.worker.client import StartedWorker, WorkerClient, WorkerError, start_worker_process
from trioserve.worker.launch import worker_argv, worker_env
from trioserve.worker.model_cost import estimate_settings_cost

if TYPE_CHECKING:
    from trioserve.worker.supervisor import SpawnWorker

log = logging.getLogger("trioserve.worker")

__all__ = ["EarlyStarts"]


class EarlyStarts:
    """Worker processes started ahead of the server, by (model id, worker index)."""

    def __init__(self) -> None:
        self._started: dict[tuple[str, int], tuple[list[str], dict[str, str], StartedWorker]] = {}

    @classmethod
    def start(cls, registry: ModelRegistry, settings: Settings) -> EarlyStarts:
        """Start the workers of a server of one model whose cost fits the memory budget (the
        startup check of worker/lifecycle.py would refuse it otherwise, and a model that does
        not fit must not begin to load). Anything else starts nothing here: the server starts
        its workers as it always does. Never raises for the OS refusing a process: the
        supervisor's own spawn then meets the same refusal and reports it."""
        early = cls()
        if len(registry.specs) != 1:
            return early
        spec = registry.specs[0]
        model = spec.settings(settings)
        try:
            if estimate_settings_cost(model).expected > settings.resolved_memory_budget():
                return early
            argv = worker_argv(spec, settings)
            for index in range(model.workers):
                env = {**os.environ, **worker_env(spec, settings, index)}
                early._started[(spec.id, index)] = (argv, env, start_worker_process(argv, env))
        except (OSError, ValueError, WorkerError):
            early.close()
        except BaseException:
            early.close()
            raise
        return early

    @property
    def pids(self) -> list[int]:
        """The processes started and not yet taken (tests, logs)."""
        return [started.pid for _, _, started in self._started.values()]

    def take(self, model_id: str, index: int, argv: list[str], env: dict[str, str]) -> StartedWorker | None:
        """The process started for worker ``index`` of ``model_id``, now the caller's; None when
        none was (or it was taken). One started with another ``argv`` or ``env`` is killed."""
        entry = self._started.pop((model_id, index), None)
        if entry is None:
            return None
        started_argv, started_env, started = entry
        if started_argv != argv or started_env != env:
            log.warning("worker %d of %s: the process started at launch ran another command line "
                        "or environment; killed, a new one starts", index, model_id)
            started.kill()
            return None
        return started

    def spawn_for(self, model_id: str, index: int) -> SpawnWorker:
        """A ``WorkerClient.spawn`` for worker ``index``'s supervisor that takes the early process
        on its first call."""
        async def spawn(argv: list[str], *, nursery: trio.Nursery, env: dict[str, str] | None = None,
                        ready_timeout: float = 120.0) -> WorkerClient:
            started = self.take(model_id, index, argv, dict(os.environ if env is None else env))
            if started is not None:
                log.info("worker %d of %s: taking the process started at launch (pid %d)",
                         index, model_id, started.pid)
            return await WorkerClient.spawn(argv, nursery=nursery, env=env, ready_timeout=ready_timeout,
                                            started=started)
        return spawn

    def close(self) -> None:
        """Kill and reap every process nobody took (synchronous; the event loop need not run)."""
        while self._started:
            _, (_, _, started) = self._started.popitem()
            started.kill()

    def __enter__(self) -> EarlyStarts:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
