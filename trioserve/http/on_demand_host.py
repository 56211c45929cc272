"""The load-on-demand model host: every served model loaded when a request needs it, within
the memory budget (spec/README.md §2.2; the rules are worker/lifecycle.py's).

:class:`OnDemandHost` is the routes' :class:`~trioserve.http.host.ModelHost` over a
:class:`~trioserve.worker.lifecycle.ModelLifecycle` whose loader (:class:`ServicesLoader`)
runs one model as one :class:`~trioserve.http.host.ModelServices`: its own worker pool,
supervisors, serving core and adapters, built afresh for every load (a pool's supervisors run
once), so a model's sessions, prefix caches and stored responses live as long as its load.

A load is done when every worker of the model is ready (or gave up, as long as one is
ready); its cost is the model file's size (weights, mapped once and shared by its workers)
plus every worker's ``kv_cache_bytes``, ``recurrent_state_bytes`` and ``attention_matrix_bytes``
(spec/worker-protocol.md §3). Before a model's first load its cost is estimated from the file
(worker/model_cost.py). A model whose every worker gave up is stopped and reported as failed,
with the reason its workers give (for a startup failure, the full text the log has); its loads
are then backed off until its files change (worker/lifecycle.py, "Backoff"; :meth:`ServicesLoader.identity`).

A model whose file's header shows it cannot start (a GGUF without a chat template and no
setting that gives one: http/model_preview.py) fails its load at once, before any worker is
started for it; a pinned one (a model served alone) is a startup error instead (exit status
2, ``RegistryError``).

Pinned models are supervised like a one-model server's model always was: loaded at startup,
never unloaded, their workers restarted by their supervisors, and a request for one whose
workers are not ready is answered by its pool (``503 worker_unavailable``, spec §14.1) rather
than waiting; one whose workers gave up stays down until an admin load. A server with one model pins it, so it behaves exactly as before; it is
``fatal`` when that model's workers give up for good (an orchestrator restarts it). With
several models, ``fatal`` is set when every pinned model's workers gave up (never, without
pinned models: a failed model is retried on demand).

Every model's parts are built once up front (nothing starts) and serve its first load; the
loader's ``current`` then holds each model's current or last parts.
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable

import trio

from trioserve.config import Settings
from trioserve.http.host import ModelServices
from trioserve.http.metrics import Metrics
from trioserve.http.model_metrics import ModelLifecycleMetrics
from trioserve.http.model_preview import ModelPreview, PreviewCache, model_identity
from trioserve.registry import ModelRegistry, ModelSpec, RegistryError
from trioserve.worker.lifecycle import ModelLifecycle
from trioserve.worker.model_loader import CostEstimate, Loaded, ModelPolicy
from trioserve.worker.model_cost import estimate_settings_cost, model_weights_bytes
from trioserve.worker.pool import WorkerPool

__all__ = ["OnDemandHost", "ServicesLoader", "measured_cost"]

log = logging.getLogger("trioserve.models")


class ModelGaveUp(Exception):
    """Every worker of a model gave up (crash loop, startup failure); the text is public."""


# What a ready record says a worker holds beside the weights (spec/worker-protocol.md §3).
_STATE_FIELDS = ("kv_cache_bytes", "recurrent_state_bytes", "attention_matrix_bytes")


def measured_cost(model: ModelServices) -> int:
    """Weights + state of a model whose workers are ready: the file its ready records name
    (once: every worker maps the same file) plus each ready worker's KV cache, recurrent
    state and attention matrix."""
    paths: set[str] = set()
    kv = 0
    for worker in model.pool.workers:
        client = worker.runtime.client
        if worker.supervisor.state != "ready" or client is None:
            continue
        raw = client.ready.raw
        for field in _STATE_FIELDS:
            value = raw.get(field)
            kv += value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0
        info = raw.get("model")
        path = info.get("path") if isinstance(info, dict) else None
        if isinstance(path, str) and path:
            paths.add(path)
    weights = 0
    for path in paths:
        try:
            weights += model_weights_bytes(path)
        except OSError:
            pass  # the worker loaded it; a file gone since costs nothing new
    return weights + kv


async def wait_serving(pool: WorkerPool) -> None:
    """Return once every worker of ``pool`` is ready, or gave up while another is ready. Woken
    by the workers' ready callbacks and their supervisors' ``fatal`` (no polling); the
    lifecycle bounds the wait (``--model-load-timeout``).

    Raises:
        ModelGaveUp: every worker gave up.
    """
    changed = [trio.Event()]

    def signal() -> None:
        changed[0].set()
        changed[0] = trio.Event()

    for worker in pool.workers:
        worker.supervisor.on_ready = _then(worker.supervisor.on_ready, signal)
    async with trio.open_nursery() as nursery:
        for worker in pool.workers:
            nursery.start_soon(_signal_when_set, worker.supervisor.fatal, signal)
        while not pool.fatal.is_set():
            supervisors = [w.supervisor for w in pool.workers]
            if any(s.state == "ready" for s in supervisors) and all(
                    s.state == "ready" or s.fatal.is_set() for s in supervisors):
                break
            await changed[0].wait()
        nursery.cancel_scope.cancel()
    if pool.fatal.is_set():
        raise ModelGaveUp(_start_failure(pool))


def _start_failure(pool: WorkerPool) -> str:
    """Why ``pool``'s workers did not start: a startup failure's own text (our refusal of the
    model, e.g. no chat template: the same text the log has), else the short public reason."""
    for worker in pool.workers:
        supervisor = worker.supervisor
        if supervisor.public_reason == "startup failed" and supervisor.reason:
            return supervisor.reason
    reason = next((w.supervisor.public_reason for w in pool.workers
                   if w.supervisor.public_reason), "its workers gave up")
    return f"its workers did not start ({reason})"


def _then(first: Callable[[Any], None], then: Callable[[], None]) -> Callable[[Any], None]:
    def both(value: Any) -> None:
        first(value)  # may raise (it refuses the worker); then nothing changed
        then()
    return both


async def _signal_when_set(event: trio.Event, signal: Callable[[], None]) -> None:
    await event.wait()
    signal()


class ServicesLoader:
    """The lifecycle's loader for :class:`ModelServices` (module docstring).

    Args:
        specs: the served models by id.
        settings: the server's settings (a model's own apply on top, ``ModelSpec.settings``).
        build: builds (does not start) one model's parts.
    """

    def __init__(self, specs: dict[str, ModelSpec], settings: Settings,
                 build: Callable[[ModelSpec], ModelServices],
                 current: dict[str, ModelServices]) -> None:
        self._specs = specs
        self._settings = settings
        self._build = build
        self._estimates: dict[str, CostEstimate] = {}
        # Each model's current (or last) parts; the ones built up front serve the first load.
        self.current = current
        self._unused = set(current)
        self.on_built: Callable[[str, ModelServices], None] = lambda model_id, model: None
        self.gave_up: set[str] = set()  # models whose last load ended with every worker gone
        self.gave_up_changed = trio.Event()
        self.previews = PreviewCache()

    def preview(self, model_id: str) -> ModelPreview | None:
        """``model_id``'s :class:`ModelPreview` from its file's header (None: no header)."""
        return self.previews.get(model_id, self._specs[model_id].settings(self._settings))

    def identity(self, model_id: str) -> object:
        """The model's files as (path, size, mtime): its failed loads' backoff ends when they
        change (worker/lifecycle.py)."""
        return model_identity(self._specs[model_id].settings(self._settings))

    def estimate(self, model_id: str) -> CostEstimate:
        if model_id not in self._estimates:
            self._estimates[model_id] = estimate_settings_cost(
                self._specs[model_id].settings(self._settings))
        return self._estimates[model_id]

    def _gave_up(self, model_id: str) -> None:
        self.gave_up.add(model_id)
        self.gave_up_changed.set()
        self.gave_up_changed = trio.Event()

    async def run(self, model_id: str, *,
                  task_status: trio.TaskStatus[Loaded[ModelServices]]) -> None:
        """Start ``model_id``'s pool, report it serving with its measured cost, keep it until
        cancelled (then stop its workers, bounded by their supervisors) or until every
        worker gave up (``ModelGaveUp``). A model whose header shows it cannot start fails
        at once (``ModelGaveUp``), no worker started."""
        preview = self.preview(model_id)
        if preview is not None and preview.problem is not None:
            self._gave_up(model_id)
            raise ModelGaveUp(preview.problem)
        if model_id in self._unused:  # built up front, never run
            self._unused.discard(model_id)
            model = self.current[model_id]
        else:  # a pool's supervisors run once: a new load gets new parts
            model = self._build(self._specs[model_id])
            self.on_built(model_id, model)
            self.current[model_id] = model
        self.gave_up.discard(model_id)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(model.pool.run)
                try:
                    await wait_serving(model.pool)
                except ModelGaveUp:
                    self._gave_up(model_id)
                    raise
                task_status.started(Loaded(model, measured_cost(model)))
                await model.pool.fatal.wait()
                self._gave_up(model_id)
                raise ModelGaveUp(f"its workers gave up ({model.pool.public_reason})")
        finally:
            if not model.pool.fatal.is_set():  # given up: its supervisors ended on their own
                with trio.CancelScope(shield=True):
                    await model.pool.stop()


class OnDemandHost:
    """The routes' model host over a :class:`ModelLifecycle` (module docstring).

    Args:
        registry: the served models.
        settings: the server's settings (budget, timeouts).
        metrics: the app's metrics (the lifecycle's series join its registry).
        build: builds (does not start) one model's parts.
    """

    def __init__(self, registry: ModelRegistry, settings: Settings, metrics: Metrics,
                 build: Callable[[ModelSpec], ModelServices]) -> None:
        self.registry = registry
        specs = {spec.id: spec for spec in registry.specs}
        models: dict[str, ModelServices] = {}
        for spec in registry.specs:
            models[spec.id] = build(spec)
            self._watch(spec.id, models[spec.id])
        self.loader = ServicesLoader(specs, settings, build, models)
        self.loader.on_built = self._watch
        alone = len(specs) == 1
        self.policies = {i: ModelPolicy(pinned=s.pinned or alone, preload=s.preload or alone)
                         for i, s in specs.items()}
        budget = settings.resolved_memory_budget()
        self.lifecycle: ModelLifecycle[ModelServices] = ModelLifecycle(
            self.loader, self.policies, budget_bytes=budget,
            load_timeout=settings.model_load_timeout, idle_unload_s=settings.model_idle_unload_s,
            on_load=lambda outcome: self._metrics.load_finished(outcome),
            on_unload=lambda model_id, reason: self._metrics.unloaded(model_id, reason),
            busy=lambda model: model.active)
        self._metrics = ModelLifecycleMetrics(metrics.registry, self.lifecycle.snapshot, budget)
        try:  # a startup error (exit status 2), before anything starts
            self.lifecycle.check_pinned_fit()
        except (ValueError, OSError) as exc:
            raise RegistryError(f"--memory-budget-bytes: {exc}") from None
        # Every model's header is read now, before the event loop runs (``GET /v1/models``
        # then reads a header again only when its file changed); a pinned model that cannot
        # start is a startup error.
        for model_id, policy in self.policies.items():
            preview = self.loader.preview(model_id)
            if policy.pinned and preview is not None and preview.problem is not None:
                raise RegistryError(f"model {model_id!r}: {preview.problem}")

    def _watch(self, model_id: str, model: ModelServices) -> None:
        """A request's hold that ends (a stream outliving its lease) is a use of the model."""
        model.on_release = lambda: self.lifecycle.notify(model_id)

    # -- the routes' interface -----------------------------------------------------------

    @asynccontextmanager
    async def lease(self, model_id: str) -> AsyncIterator[ModelServices]:
        """``model_id`` loaded for the block, counted on the model too (``hold``): waits for
        its load, bounded and cancellable (worker/lifecycle.py). A pinned model that is not
        loaded is handed out at once: its pool answers while its workers start, and after they
        gave up (``503 worker_unavailable``, as a one-model server always did)."""
        if self.pinned(model_id) and self.lifecycle.state(model_id) != "loaded":
            model = self.loader.current[model_id]
            release = model.hold()
            try:
                yield model
            finally:
                release()
            return
        async with self.lifecycle.lease(model_id) as model:
            release = model.hold()
            try:
                yield model
            finally:
                release()

    def state(self, model_id: str) -> str:
        """``not_loaded``, ``loading``, ``loaded`` or ``unloading`` (spec §14.5)."""
        return self.lifecycle.state(model_id)

    def failure(self, model_id: str) -> str | None:
        """Why ``model_id`` cannot be served now: its last load failed (and none runs), or its
        file's header shows it cannot start; None otherwise (``GET /v1/models``: ``failed``)."""
        failed = self.lifecycle.failure(model_id)
        if failed is not None or self.lifecycle.state(model_id) != "not_loaded":
            return failed
        preview = self.loader.preview(model_id)
        return preview.problem if preview is not None else None

    def preview(self, model_id: str) -> ModelPreview | None:
        """What ``model_id``'s file says before a worker loaded it (http/model_preview.py)."""
        return self.loader.preview(model_id)

    def pinned(self, model_id: str) -> bool:
        policy = self.policies.get(model_id)
        return policy is not None and policy.pinned

    def services(self, model_id: str) -> ModelServices:
        """The parts of ``model_id``'s current or last load (built up front before its first)."""
        return self.loader.current[model_id]

    def loaded(self) -> list[ModelServices]:
        """The models whose workers run or start now (every state but ``not_loaded``), in
        registry order."""
        return [self.loader.current[i] for i in self.registry.ids
                if self.lifecycle.state(i) != "not_loaded"]

    # -- admin (spec §14.5) -----------------------------------------------------------------

    async def load(self, model_id: str) -> str:
        return await self.lifecycle.load(model_id)

    async def unload(self, model_id: str) -> str:
        return await self.lifecycle.unload(model_id)

    # -- the lifespan ----------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own every model's load until ``stop``; starts the pinned and preloaded ones (whose
        fit in the budget the constructor checked)."""
        await self.lifecycle.run(task_status=task_status)

    async def stop(self) -> None:
        """Unload every model (each bounded by its supervisors' stop)."""
        await self.lifecycle.stop()

    @property
    def fatal(self) -> bool:
        pinned = [i for i, p in self.policies.items() if p.pinned]
        return bool(pinned) and all(i in self.loader.gave_up for i in pinned)

    async def wait_fatal(self) -> None:
        while not self.fatal:
            await self.loader.gave_up_changed.wait()

    @property
    def reason(self) -> str:
        """Why the models cannot be served (log only)."""
        return "; ".join(f"model {i}: {self.loader.current[i].pool.reason}"
                         for i in sorted(self.loader.gave_up) if i in self.loader.current)
