"""The per-model records :class:`~trioserve.worker.lifecycle.ModelLifecycle` keeps: each
model's :class:`ModelEntry` (state, leases, memory, backoff), one load's
:class:`LoadAttempt`, and :class:`LoadRefused` for a load refused before it started. Plain
state, owned and changed by the lifecycle alone (its module docstring has the rules)."""

from __future__ import annotations

import math
from typing import Generic, TypeVar

import trio

from trioserve.errors import APIError
from trioserve.worker.model_loader import ModelPolicy

__all__ = ["FAILED_LOAD_BACKOFF_MAX_S", "FAILED_LOAD_BACKOFF_S", "LOADED", "LOADING",
           "LoadAttempt", "LoadRefused", "ModelEntry", "NOT_LOADED", "UNLOADING"]

T = TypeVar("T")

NOT_LOADED, LOADING, LOADED, UNLOADING = "not_loaded", "loading", "loaded", "unloading"

# A failed load's first backoff, and its bound (worker/lifecycle.py, "Backoff"): long enough
# that a client's retries (Claude Code: 8 in 90 s) start no load, short enough that a fix
# outside the model's files (memory freed, a driver) is picked up without a restart.
FAILED_LOAD_BACKOFF_S = 60.0
FAILED_LOAD_BACKOFF_MAX_S = 600.0


class LoadRefused(Exception):
    """A load refused before it started; carries the client's error and the load's outcome
    (``too_large``: it can never fit; ``no_room``: its last load failed and it does not fit
    without unloading a working model)."""

    def __init__(self, error: APIError, outcome: str = "too_large") -> None:
        super().__init__(error.message)
        self.error = error
        self.outcome = outcome


class LoadAttempt:
    """One load of one model: its waiters wait on ``done``; ``error`` is set when it failed."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        self.done = trio.Event()
        self.error: APIError | None = None
        self.placing = True  # still waiting for memory (the loader has not been started)
        self.started_at = trio.current_time()

    def finish(self, error: APIError | None) -> None:
        if not self.done.is_set():
            self.error = error
            self.done.set()


class ModelEntry(Generic[T]):
    def __init__(self, model_id: str, policy: ModelPolicy) -> None:
        self.id = model_id
        self.policy = policy
        self.state = NOT_LOADED
        self.handle: T | None = None
        self.leases = 0
        self.waiters = 0
        self.last_used = -math.inf  # trio clock, for idle unloads
        self.use_order = 0  # the lifecycle's use counter at its last use, for LRU order
        self.measured_cost: int | None = None
        self.charged = 0  # bytes counted against the budget now
        self.attempt: LoadAttempt | None = None
        self.scope: trio.CancelScope | None = None
        self.stopped = trio.Event()
        self.stopped.set()
        self.unload_reason = ""
        self.last_error: str | None = None
        # Its last load failed before it served (cleared when a load serves): such a model
        # is loaded again only into free memory, never in place of a working one.
        self.load_failed = False
        # Backoff after failed loads (module docstring): consecutive failures, when the next
        # demand load may start, and the loader's identity of the model at the last failure.
        self.failures = 0
        self.retry_at = -math.inf
        self.failed_identity: object = None
