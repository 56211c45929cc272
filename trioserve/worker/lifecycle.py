"""ModelLifecycle: several models under one server, each loaded on demand within a memory budget.

Generic over what a "model" is: a :class:`ModelLoader` starts one (for the server: its worker
pool, supervisors and serving core), reports when it serves and what it costs in bytes, and
keeps it running until cancelled. The lifecycle decides *when* each model runs (spec/README.md
§16 "Models: states, loads and unloads"):

States: ``not_loaded`` → ``loading`` (waiting for memory, then the loader starting it) →
``loaded`` → ``unloading`` (its scope cancelled, the loader's own bounded stop running) →
``not_loaded``. Memory is counted from the moment a load is placed until its unload finished.

Leases: ``async with lifecycle.lease(model_id) as handle`` enters at once when the model is
loaded, waits for a load in progress, starts one when it is not loaded, and waits for an
unload in progress to finish first. The wait is bounded by ``load_timeout`` (503
``model_loading``, or ``model_memory_busy`` while it waited for memory) and cancellable. A
held lease (and a waiting one) marks the model in use: it is never unloaded for memory or
idleness while any is held. A client that leaves while waiting leaves only itself: a load the
loader already started completes (the model is then idle and may be unloaded for memory or
idleness later); a load still waiting for memory when its last waiter leaves is abandoned
(nothing was started, so nothing is wasted and no idle model is evicted for a load nobody
wants).

Budget: before a load, its expected cost (the loader's estimate before the model's first
load, its measured cost after) must fit the budget beside every model counted now (loaded,
loading, unloading). When it does not, idle models (loaded, no lease held or awaited, not
pinned) are unloaded least recently used first, as many as the load needs and only when that
suffices; the load starts once their memory is free. Not for a model whose last load failed
(and is not pinned): it may fail again, so it loads only into free memory and is otherwise
refused at once (``model_load_failed``, outcome ``no_room``), never costing a working model
its place on every request for it. When nothing can be freed now, the load
waits (bounded by ``load_timeout``) for leases to end. A model whose cost exceeds the budget
alone, or beside the pinned models, is refused at once with ``model_too_large`` (it never
would fit). A model whose measured cost exceeds the budget alone is unloaded right after its
load and refused the same way (its next request fails at once).

Pinned models load at startup and are never unloaded (admin unload is ``model_pinned``);
preloaded ones load at startup and are unloaded like any other. ``idle_unload_s`` > 0 unloads
a loaded, unpinned model no lease has held for that long.

Isolation: each model runs in its own task; a failed load fails that load's waiters with
``model_load_failed`` (500, not to be retried: ``errors.model_cannot_load``), a model whose
loader ends or raises after it served is ``not_loaded`` again (reason ``failed``), and neither
touches any other model.

Backoff: a model whose load failed (its loader raised before it served) is not loaded again
on demand for :data:`FAILED_LOAD_BACKOFF_S` seconds, doubled with each consecutive failure up
to :data:`FAILED_LOAD_BACKOFF_MAX_S`, unless the loader's ``identity`` of it (its files' sizes
and modification times) changed since: a lease meanwhile fails at once with the same reason,
and no load starts (a client retrying a model that cannot start would otherwise start a load
per request). An admin load always tries. A load that timed out is not backed off (a slow
disk may be faster next time); the free-memory rule below applies to both.

Cancellation: ``run`` owns the nursery every model runs in; cancelling it (``stop``) unloads
every model, each through its loader's own bounded stop. ``lease`` waits are cancellable at
every await; ``unload`` waits (bounded by the loader) for the model's task to end.
"""

from __future__ import annotations

import logging
import math
from contextlib import asynccontextmanager
from typing import AsyncIterator, Callable, Generic, Mapping, TypeVar

import trio

from trioserve import errors
from trioserve.errors import APIError
from trioserve.worker.lifecycle_entries import (
    FAILED_LOAD_BACKOFF_MAX_S,
    FAILED_LOAD_BACKOFF_S,
    LOADED,
    LOADING,
    NOT_LOADED,
    UNLOADING,
    LoadAttempt,
    LoadRefused,
    ModelEntry,
)
from trioserve.worker.model_loader import (
    LoadOutcome,
    Loaded,
    ModelLoader,
    ModelPolicy,
    ModelState,
)

__all__ = ["FAILED_LOAD_BACKOFF_MAX_S", "FAILED_LOAD_BACKOFF_S", "ModelLifecycle"]

log = logging.getLogger("trioserve.models")

T = TypeVar("T")



class ModelLifecycle(Generic[T]):
    """Loads, serves and unloads models on demand within ``budget_bytes`` (module docstring).

    Args:
        loader: starts a model (:class:`ModelLoader`).
        models: every model id and its policy.
        budget_bytes: the memory the models may take together; None: unlimited.
        load_timeout: seconds a load (memory wait + start) and a lease's wait may take.
        idle_unload_s: unload an unpinned model unused this long; 0: never.
        on_load, on_unload: metrics callbacks (a finished load attempt; an unload and its
            reason: ``lru``, ``idle``, ``admin``, ``failed``, ``too_large``, ``shutdown``).
        busy: how many uses of a loaded model's handle are in flight, the leases' own or not
            (a response that streams after its lease ended holds the model itself); any is
            "in use", and ``model_busy`` reports the larger of it and the leases. Whoever
            ends such a use calls :meth:`notify`.
    """

    def __init__(self, loader: ModelLoader[T], models: Mapping[str, ModelPolicy], *,
                 budget_bytes: int | None, load_timeout: float, idle_unload_s: float = 0.0,
                 on_load: Callable[[LoadOutcome], None] = lambda outcome: None,
                 on_unload: Callable[[str, str], None] = lambda model_id, reason: None,
                 busy: Callable[[T], int] = lambda handle: 0) -> None:
        self._loader = loader
        self._models: dict[str, ModelEntry[T]] = {i: ModelEntry(i, p) for i, p in models.items()}
        self.budget_bytes = budget_bytes
        self.load_timeout = load_timeout
        self.idle_unload_s = idle_unload_s
        self._on_load = on_load
        self._on_unload = on_unload
        self._busy = busy
        self._change = trio.Event()
        self._uses = 0  # counts lease ends and loads: the LRU order (clock ties are common)
        self._nursery: trio.Nursery | None = None
        self._stopping = False
        self._stopped = trio.Event()

    # -- the server's side: run and stop ------------------------------------------------

    def check_pinned_fit(self) -> None:
        """Raise ValueError when the pinned models' expected costs exceed the budget together
        (the server cannot keep the promise; a startup error, not a later refusal)."""
        if self.budget_bytes is None:
            return
        pinned = [m for m in self._models.values() if m.policy.pinned]
        total = sum(self._expected_cost(m)[0] for m in pinned)
        if total > self.budget_bytes:
            names = ", ".join(m.id for m in pinned)
            raise ValueError(f"the pinned models ({names}) need about {_size(total)} together, "
                             f"more than the memory budget of {_size(self.budget_bytes)}")

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every model's task until ``stop``. Starts the pinned and preloaded models' loads
        (in the background) and reports started at once."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for model in self._models.values():
                    if model.policy.pinned or model.policy.preload:
                        self._start_load(model, "preload")
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            self._stopped.set()

    async def stop(self) -> None:
        """Unload every model (each bounded by its loader's stop) and end ``run``."""
        self._stopping = True
        for model in self._models.values():
            self._begin_unload(model, "shutdown")
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            await self._stopped.wait()

    # -- requests' side -----------------------------------------------------------------

    def state(self, model_id: str) -> str:
        """``not_loaded``, ``loading``, ``loaded`` or ``unloading``."""
        return self._model(model_id).state

    def failure(self, model_id: str) -> str | None:
        """Why ``model_id``'s last load failed, while it is not loaded and no load that could
        end it runs (``GET /v1/models`` shows it ``failed``); None otherwise."""
        model = self._model(model_id)
        if model.state != NOT_LOADED or not model.load_failed:
            return None
        return model.last_error or "unknown error"

    def snapshot(self) -> list[ModelState]:
        return [ModelState(m.id, m.state, m.policy.pinned, m.charged, m.measured_cost, m.leases,
                           m.waiters, m.last_error) for m in self._models.values()]

    @property
    def waiting(self) -> int:
        """Leases waiting for a load now, over all models."""
        return sum(m.waiters for m in self._models.values())

    @property
    def used_bytes(self) -> int:
        return sum(m.charged for m in self._models.values())

    @asynccontextmanager
    async def lease(self, model_id: str, *, reason: str = "demand") -> AsyncIterator[T]:
        """Hold ``model_id`` loaded for the body (module docstring: waits, bounds, errors).
        Raises the APIErrors of the failed wait; ``model_not_found`` for an unknown id."""
        model = self._model(model_id)
        handle = await self._acquire(model, reason)
        try:
            yield handle
        finally:
            model.leases -= 1
            self._used(model)
            self._changed()

    async def load(self, model_id: str) -> str:
        """Load ``model_id`` (as a lease would, reason ``admin``) and return its state."""
        async with self.lease(model_id, reason="admin"):
            pass
        return self._model(model_id).state

    async def unload(self, model_id: str) -> str:
        """Unload ``model_id`` and wait until it stopped (bounded by its loader's stop).

        Raises 409 ``model_pinned`` for a pinned model and 409 ``model_busy`` while a lease is
        held or awaited (requests in flight are never cut; the caller retries). A model not
        loaded is left as it is. Returns the state after (``not_loaded``)."""
        model = self._model(model_id)
        if model.policy.pinned:
            raise errors.model_pinned(model_id)
        if self._in_use(model):
            # A stream outlives its lease (it holds the model itself): count it in flight.
            holds = self._busy(model.handle) if model.handle is not None else 0
            raise errors.model_busy(model_id, max(model.leases, holds), model.waiters)
        self._begin_unload(model, "admin")
        await model.stopped.wait()
        return model.state

    # -- leases ---------------------------------------------------------------------------

    async def _acquire(self, model: ModelEntry[T], reason: str) -> T:
        if model.state == LOADED:
            return self._take(model)
        model.waiters += 1
        waited_for: LoadAttempt | None = None
        try:
            with trio.move_on_after(self.load_timeout):
                while True:
                    if model.state == LOADED:
                        return self._take(model)
                    if model.state == UNLOADING:
                        await model.stopped.wait()
                        continue
                    if model.state == NOT_LOADED:
                        if reason != "admin":
                            self._refuse_backed_off(model)
                        self._start_load(model, reason)
                    waited_for = model.attempt
                    assert waited_for is not None
                    await waited_for.done.wait()
                    if waited_for.error is not None:
                        raise waited_for.error
            raise self._wait_timed_out(model, waited_for)
        finally:
            model.waiters -= 1
            self._changed()

    def _refuse_backed_off(self, model: ModelEntry[T]) -> None:
        """Raise the last failure's error while ``model``'s loads are backed off and its
        files did not change (module docstring, "Backoff"); nothing otherwise."""
        now = trio.current_time()
        if model.failures == 0 or now >= model.retry_at:
            return
        if self._loader.identity(model.id) != model.failed_identity:
            log.info("model %s changed on disk since its failed load: loading it again", model.id)
            return
        raise errors.model_cannot_load(model.id, model.last_error or "unknown error",
                                       model.retry_at - now)

    def _used(self, model: ModelEntry[T]) -> None:
        self._uses += 1
        model.use_order = self._uses
        model.last_used = trio.current_time()

    def _take(self, model: ModelEntry[T]) -> T:
        model.leases += 1
        self._used(model)
        assert model.handle is not None
        return model.handle

    def _wait_timed_out(self, model: ModelEntry[T], attempt: LoadAttempt | None) -> APIError:
        """The error of a lease whose wait ran out: its load's own failure when that ended in
        the same moment, else what the load was doing."""
        if attempt is not None and attempt.error is not None:
            return attempt.error
        if attempt is not None and attempt.placing:
            return errors.model_memory_busy(model.id, self._in_use_names(model), self.load_timeout)
        return errors.model_loading(model.id, self.load_timeout)

    def _load_timed_out(self, model: ModelEntry[T], attempt: LoadAttempt) -> APIError:
        if attempt.placing:
            return errors.model_memory_busy(model.id, self._in_use_names(model), self.load_timeout)
        model.last_error = f"it did not load within {self.load_timeout:g} s"
        return errors.model_load_failed(model.id, model.last_error)

    # -- loads ----------------------------------------------------------------------------

    def _start_load(self, model: ModelEntry[T], reason: str) -> None:
        if self._nursery is None or self._stopping:
            raise errors.worker_unavailable("the server is not running")
        model.state = LOADING
        model.attempt = LoadAttempt(reason)
        model.stopped = trio.Event()
        model.unload_reason = ""
        model.scope = trio.CancelScope()
        self._nursery.start_soon(self._run_model, model, model.attempt)
        self._changed()

    async def _run_model(self, model: ModelEntry[T], attempt: LoadAttempt) -> None:
        """One life of ``model``: placement, load, service, unload. Always ends ``not_loaded``."""
        assert model.scope is not None
        outcome = "cancelled"
        try:
            with model.scope:
                with trio.move_on_after(self.load_timeout) as load_deadline:
                    if not await self._place(model, attempt):
                        outcome = "abandoned"
                        return
                    attempt.placing = False
                    async with trio.open_nursery() as nursery:
                        loaded = await nursery.start(self._run_loader, model, nursery.cancel_scope)
                        load_deadline.deadline = math.inf  # it serves: no longer a load
                        outcome = self._loaded(model, attempt, loaded)
                        if outcome == "loaded":
                            nursery.start_soon(self._unload_when_idle, model)
                        else:
                            nursery.cancel_scope.cancel()
                if load_deadline.cancelled_caught:
                    outcome = "timeout"
                    attempt.finish(self._load_timed_out(model, attempt))
        except LoadRefused as refused:
            outcome = refused.outcome
            if outcome == "too_large":
                model.last_error = refused.error.message
            attempt.finish(refused.error)
        except Exception as exc:  # the loader failed, or the model stopped on its own
            if outcome != "loaded":
                outcome = "failed"
            self._model_failed(model, attempt, exc)
        except BaseExceptionGroup as group:  # a failure beside the shutdown's cancellation
            failure, rest = group.split(Exception)
            if failure is not None:  # reported like any failure: the shutdown goes on clean
                outcome = "failed" if outcome != "loaded" else outcome
                self._model_failed(model, attempt, failure)
            if rest is not None:
                raise rest
        finally:
            self._ended(model, attempt, outcome)

    async def _run_loader(self, model: ModelEntry[T], serving_scope: trio.CancelScope, *,
                          task_status: trio.TaskStatus[Loaded[T]]) -> None:
        await self._loader.run(model.id, task_status=task_status)
        # Returned after it served: the model stopped on its own.
        model.unload_reason = model.unload_reason or "failed"
        model.last_error = "the model stopped"
        serving_scope.cancel()

    def _loaded(self, model: ModelEntry[T], attempt: LoadAttempt, loaded: Loaded[T]) -> str:
        """The loader reports ``model`` serving at ``loaded.cost_bytes``; returns the outcome."""
        model.measured_cost = loaded.cost_bytes
        if self.budget_bytes is not None and loaded.cost_bytes > self.budget_bytes:
            model.unload_reason = "too_large"
            model.state = UNLOADING
            error = errors.model_too_large(model.id, loaded.cost_bytes, self.budget_bytes)
            model.last_error = error.message
            attempt.finish(error)
            return "too_large"
        model.charged = loaded.cost_bytes
        model.handle = loaded.handle
        model.state = LOADED
        self._used(model)
        model.last_error = None
        model.load_failed = False
        model.failures = 0
        attempt.finish(None)
        seconds = trio.current_time() - attempt.started_at
        log.info("model %s loaded in %.2f s (%s)", model.id, seconds, _size(loaded.cost_bytes))
        self._on_load(LoadOutcome(model.id, attempt.reason, "loaded", seconds))
        # The measured cost may exceed the estimate: free idle models to get back within.
        if self.budget_bytes is not None and not self._free_for(model, 0):
            log.warning("model %s measured %s, more than estimated: the models use %s of a "
                        "%s budget until idle ones can be unloaded", model.id,
                        _size(loaded.cost_bytes), _size(self.used_bytes), _size(self.budget_bytes))
        self._changed()
        return "loaded"

    def _model_failed(self, model: ModelEntry[T], attempt: LoadAttempt, exc: Exception) -> None:
        text = _describe(exc)
        model.last_error = text
        if attempt.done.is_set():
            log.error("model %s stopped: %s", model.id, text)
            model.unload_reason = model.unload_reason or "failed"
        else:
            backoff = min(FAILED_LOAD_BACKOFF_S * 2 ** model.failures, FAILED_LOAD_BACKOFF_MAX_S)
            model.failures += 1
            model.retry_at = trio.current_time() + backoff
            model.failed_identity = self._loader.identity(model.id)
            log.error("model %s failed to load: %s (not loaded again on demand for %.0f s "
                      "unless its files change)", model.id, text, backoff)
            attempt.finish(errors.model_cannot_load(model.id, text, backoff))

    def _ended(self, model: ModelEntry[T], attempt: LoadAttempt, outcome: str) -> None:
        """The model's task is over: free its memory and tell whoever waits (never awaits)."""
        was_loaded = outcome == "loaded"
        if outcome == "abandoned":
            attempt.finish(None)  # a waiter that came meanwhile starts a new load
        elif not attempt.done.is_set():
            attempt.finish(errors.worker_unavailable(
                "the server is shutting down" if self._stopping else
                f"model '{model.id}' was unloaded before it finished loading"))
        if outcome in ("failed", "timeout") and not was_loaded:
            model.load_failed = True  # (test_a_model_that_cannot_load_never_evicts_a_working_one)
        if not was_loaded:  # a load that served was reported when it did
            self._on_load(LoadOutcome(model.id, attempt.reason, outcome,
                                      trio.current_time() - attempt.started_at))
        else:
            reason = model.unload_reason or ("shutdown" if self._stopping else "failed")
            # Every model is unloaded at shutdown: that is no news.
            log.log(logging.DEBUG if reason == "shutdown" else logging.INFO,
                    "model %s unloaded (%s)", model.id, reason)
            self._on_unload(model.id, reason)
        model.state = NOT_LOADED
        model.handle = None
        model.charged = 0
        model.scope = None
        model.stopped.set()
        self._changed()

    # -- memory ---------------------------------------------------------------------------

    async def _place(self, model: ModelEntry[T], attempt: LoadAttempt) -> bool:
        """Wait until ``model``'s expected cost fits, unloading idle models LRU first. Charges
        the cost and returns True; False when the last waiter left while it waited (abandoned).
        Raises ``model_too_large`` when it can never fit."""
        logged = False
        while True:
            cost, at_least = self._expected_cost(model)
            if self.budget_bytes is None:
                model.charged = cost
                return True
            pinned = sum(m.charged or self._pinned_cost(m) for m in self._models.values()
                         if m.policy.pinned and m is not model)
            room = self.budget_bytes - (0 if model.policy.pinned else pinned)
            if at_least > room:
                raise LoadRefused(errors.model_too_large(model.id, at_least, self.budget_bytes,
                                                      pinned_bytes=pinned))
            cost = min(cost, room)  # an unmeasured upper bound: take what there is, then measure
            if model.load_failed and not model.policy.pinned \
                    and not self._free_for(model, cost, evict=False):
                # It may fail again: it never costs a working model its place (it would, on
                # every request for it). Free memory only, now. (A pinned model keeps its
                # promised place: it may still unload idle ones.)
                raise LoadRefused(errors.model_load_failed_no_room(
                    model.id, model.last_error or "unknown error", self._in_use_names(model, True)),
                    "no_room")
            if self._free_for(model, cost):
                model.charged = cost
                self._changed()
                return True
            if model.waiters == 0 and attempt.reason != "preload":
                return False
            change = self._change
            if not logged:
                logged = True
                log.info("model %s waits for memory (%s needed; in use: %s)", model.id,
                         _size(cost), ", ".join(self._in_use_names(model)) or "nothing")
            await change.wait()

    def _free_for(self, model: ModelEntry[T], cost: int, *, evict: bool = True) -> bool:
        """True when ``cost`` more bytes fit now. Otherwise, when ``evict`` and unloading idle
        models (LRU first) would make room, starts unloading just enough of them; False
        meanwhile."""
        assert self.budget_bytes is not None
        others = [m for m in self._models.values() if m is not model]
        excess = sum(m.charged for m in others) + model.charged + cost - self.budget_bytes
        if excess <= 0:
            return True
        if not evict:
            return False
        idle = sorted((m for m in others if self._evictable(m)), key=lambda m: m.use_order)
        victims: list[ModelEntry[T]] = []
        for victim in idle:
            if excess <= 0:
                break
            victims.append(victim)
            excess -= victim.charged
        if excess <= 0:
            for victim in victims:
                self._begin_unload(victim, "lru")
        return False

    def _in_use(self, model: ModelEntry[T]) -> bool:
        """A lease held or awaited, or its handle busy (``busy``)."""
        if model.leases > 0 or model.waiters > 0:
            return True
        return model.handle is not None and self._busy(model.handle) > 0

    def _evictable(self, model: ModelEntry[T]) -> bool:
        return model.state == LOADED and not model.policy.pinned and not self._in_use(model)

    def _expected_cost(self, model: ModelEntry[T]) -> tuple[int, int]:
        """(expected, at least) bytes: its measured cost once it was loaded, else the loader's
        estimate."""
        if model.measured_cost is not None:
            return model.measured_cost, model.measured_cost
        estimate = self._loader.estimate(model.id)
        return estimate.expected, estimate.at_least

    def _pinned_cost(self, model: ModelEntry[T]) -> int:
        """A pinned model not loaded now still holds its place (it failed and will be retried)."""
        try:
            return self._expected_cost(model)[0]
        except Exception:
            return 0

    def _in_use_names(self, model: ModelEntry[T], idle_too: bool = False) -> list[str]:
        """The other models holding memory: those in use, loading, unloading or pinned (with
        ``idle_too``: every one)."""
        return [m.id for m in self._models.values()
                if m is not model and m.charged > 0
                and (idle_too or self._in_use(m) or m.state != LOADED or m.policy.pinned)]

    # -- unloads --------------------------------------------------------------------------

    def _begin_unload(self, model: ModelEntry[T], reason: str) -> None:
        """Cancel ``model``'s task (its loader stops it, bounded); its memory stays counted
        until the task ended. A model not loaded or already unloading is left alone."""
        if model.scope is None or model.state == UNLOADING:
            return
        model.unload_reason = reason
        if model.state == LOADED:
            model.state = UNLOADING
        model.scope.cancel()
        self._changed()

    async def _unload_when_idle(self, model: ModelEntry[T]) -> None:
        if self.idle_unload_s <= 0 or model.policy.pinned:
            return
        while True:
            change = self._change
            if self._in_use(model):
                await change.wait()
                continue
            deadline = model.last_used + self.idle_unload_s
            if trio.current_time() >= deadline:
                self._begin_unload(model, "idle")
                return
            with trio.move_on_at(deadline):
                await change.wait()

    # -- helpers --------------------------------------------------------------------------

    def _model(self, model_id: str) -> ModelEntry[T]:
        try:
            return self._models[model_id]
        except KeyError:
            raise errors.model_not_found(model_id) from None

    def notify(self, model_id: str) -> None:
        """A use of ``model_id`` outside the leases ended (``busy`` may have turned false): it
        counts as a use (LRU order, idle time), and waiting loads and idle timers look again.
        Synchronous; for any task of this run."""
        model = self._models.get(model_id)
        if model is not None:
            self._used(model)
        self._changed()

    def _changed(self) -> None:
        """Wake everything that waits for memory, leases or idleness to change."""
        self._change.set()
        self._change = trio.Event()


def _describe(exc: BaseException) -> str:
    """An exception in words; a group's members joined (nurseries wrap a loader's error)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_describe(e) for e in exc.exceptions)
    return str(exc) or type(exc).__name__


def _size(n: int) -> str:
    return f"{n / (1 << 20):.0f} MiB" if n >= 1 << 20 else f"{n} bytes"
