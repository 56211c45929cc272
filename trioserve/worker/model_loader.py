"""The contract between :mod:`trioserve.worker.lifecycle` and what it runs: a
:class:`ModelLoader` starts one model and reports it :class:`Loaded` (with its cost) or its
:class:`CostEstimate` before a first load; the lifecycle reports :class:`LoadOutcome` and
:class:`ModelState` snapshots for metrics and ``/v1/models``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import trio

__all__ = ["CostEstimate", "LoadOutcome", "Loaded", "ModelLoader", "ModelPolicy", "ModelState"]

T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Loaded(Generic[T_co]):
    """What a loader reports once its model serves: the handle leases hand out and the
    model's cost in bytes (weights + KV cache, as its workers' ready records report them)."""

    handle: T_co
    cost_bytes: int


@dataclass(frozen=True)
class CostEstimate:
    """A model's cost before it was ever loaded: ``expected`` bytes (weights + an estimate of
    its KV cache, which may be an upper bound) and ``at_least`` bytes it certainly takes (its
    weights). Only ``at_least`` over the budget refuses a model unmeasured: an ``expected``
    over the budget makes the load take the whole budget, and its measured cost decides."""

    expected: int
    at_least: int


class ModelLoader(Protocol[T_co]):
    """Starts one model and keeps it running.

    ``estimate(model_id)``: the :class:`CostEstimate` before the model was ever loaded (may
    raise: the load then fails with that reason).

    ``identity(model_id)``: what on disk a load of the model depends on (e.g. its files'
    paths, sizes and modification times), compared for equality: a failed load's backoff
    ends early when it changed (worker/lifecycle.py). Never raises.

    ``run(model_id, task_status=...)``: start the model; call ``task_status.started(Loaded)``
    once it serves; then keep it running until cancelled, and on cancellation stop it (bounded,
    shielded as needed) before returning. Raising before ``started`` fails the load; returning
    or raising after it means the model stopped on its own.
    """

    def estimate(self, model_id: str) -> CostEstimate: ...

    def identity(self, model_id: str) -> object: ...

    async def run(self, model_id: str, *, task_status: trio.TaskStatus[Loaded[T_co]]) -> None: ...


@dataclass(frozen=True)
class ModelPolicy:
    """``pinned``: loaded at startup, never unloaded. ``preload``: loaded at startup."""

    pinned: bool = False
    preload: bool = False


@dataclass(frozen=True)
class LoadOutcome:
    """One finished load attempt, for metrics: ``reason`` (``demand``, ``preload``,
    ``admin``), ``outcome`` (``loaded``, ``failed``, ``too_large``, ``timeout``, ``cancelled``,
    ``abandoned``, ``no_room``) and how long it took (placement and the loader's start)."""

    model_id: str
    reason: str
    outcome: str
    seconds: float


@dataclass(frozen=True)
class ModelState:
    """A snapshot of one model for ``/v1/models`` and ``/metrics``."""

    model_id: str
    state: str
    pinned: bool
    cost_bytes: int  # counted against the budget now (0 when not loaded)
    expected_cost_bytes: int | None  # the measured cost of its last load, else None
    leases: int
    waiting: int
    last_error: str | None
