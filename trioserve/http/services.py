"""The composition root: every part of one server, built once from its settings.

``build_services`` builds the model registry (trioserve.registry), then one
:class:`ModelServices` per served model (its worker pool, each worker's runtime and
supervisor, its API-neutral serving core and one adapter per API) and the server-wide parts
(guard, metrics, the host that the routes lease models from), and returns them as one typed
:class:`Services`. Nothing starts here: the app's lifespan starts the host in the app nursery
and stops it (bounded) at shutdown.

Readiness is one callback per worker (``_on_worker_ready``): the worker's ready record
configures its model's core (template, profile; it may refuse the worker with
``FatalStartupError``), then the core's raw prompts (FIM and BOS ids), then the KV-cache
gauges.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Callable

from trioserve.api.chat.adapter import ServingChat
from trioserve.api.completions.adapter import ServingCompletions
from trioserve.api.messages.adapter import ServingMessages
from trioserve.api.responses.adapter import ServingResponses
from trioserve.config import Settings
from trioserve.core.constraints import GrammarCache
from trioserve.core.model_names import ModelNames
from trioserve.core.serving import ServingCore
from trioserve.core.stats import GenerationStats, log_generation
from trioserve.http.guard import RequestGuard
from trioserve.http.host import ModelHost, ModelServices
from trioserve.http.metrics import Metrics
from trioserve.http.on_demand_host import OnDemandHost
from trioserve.http.router_facing import serving_info
from trioserve.registry import ModelRegistry, ModelSpec, PathResolver, build_registry
from trioserve.worker.client import WorkerClient
from trioserve.worker.early_start import EarlyStarts
from trioserve.worker.launch import worker_argv, worker_env
from trioserve.worker.pool import PoolWorker, WorkerPool
from trioserve.worker.prompt_encoder import PromptEncoder
from trioserve.worker.protocol import Ready
from trioserve.worker.routing import ResidentPrefixes
from trioserve.worker.runtime import SessionRuntime
from trioserve.worker.supervisor import RestartPolicy, SpawnWorker, Supervisor

# ModelServices is defined beside ModelHost (http/host.py) and named here too: the routes
# import a model's parts and the server's from one place.
__all__ = ["HostFactory", "Services", "build_model_services", "build_services"]


@dataclass
class Services:
    """One server's parts: the server-wide ones, and the models (``host``); ``default`` is
    the default model's parts (the registry's first)."""

    settings: Settings
    registry: ModelRegistry
    guard: RequestGuard
    host: ModelHost
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def default(self) -> ModelServices:
        return self.host.services(self.registry.default.id)

    @property
    def model_id(self) -> str:
        return self.registry.default.id


# Builds the host from the registry and a function that builds (not starts) one model's parts.
HostFactory = Callable[[ModelRegistry, Callable[[ModelSpec], ModelServices]], ModelHost]


def build_services(settings: Settings, *, resolve_path: PathResolver | None = None,
                   host_factory: HostFactory | None = None, registry: ModelRegistry | None = None,
                   early: EarlyStarts | None = None) -> Services:
    """Build (not start) every part of a server for ``settings``: the registry (unless given,
    built from the same settings), the metrics, and the host that ``host_factory`` makes
    (default: the load-on-demand host, http/on_demand_host.py, with the settings' memory
    budget and timeouts). ``early``: worker processes started at launch, which the workers'
    supervisors take on their first start (worker/early_start.py).

    Raises:
        RegistryError: the models cannot be served as configured.
    """
    if registry is None:
        registry = build_registry(settings, resolve_path=resolve_path)
    hosts: list[ModelHost] = []  # the host, once made; the metrics read it at scrape time

    def loaded() -> list[ModelServices]:
        return hosts[0].loaded() if hosts else []

    def default_workers() -> list[PoolWorker]:
        default = next((m for m in loaded() if m.model_id == registry.default.id), None)
        return default.pool.workers if default is not None else []

    # One compiled-grammar cache for the server (bounded in bytes, limits.GRAMMAR_CACHE_BYTES):
    # every model compiles the same schemas the same way.
    grammars = GrammarCache()
    metrics = Metrics(
        queued=lambda: sum(m.pool.queued for m in loaded()),
        running=lambda: sum(m.pool.in_flight for m in loaded()),
        restarts=lambda: sum(m.pool.restarts for m in loaded()),
        ready=lambda: any(m.pool.state == "ready" for m in loaded()),
        # Per-worker series: the default model's workers (per-model series are labelled).
        workers=default_workers, vllm_names=settings.metrics_vllm_names,
        models=lambda: [(m.model_id, m.pool) for m in loaded()],
        caches={"grammar": ("Bytes of compiled grammars kept for reuse (bound: "
                            "limits.GRAMMAR_CACHE_BYTES).", lambda: grammars.nbytes),
                "replay": ("Bytes of remembered assistant turns, over the loaded models (bound "
                           "per model: limits.REPLAY_CACHE_BYTES).",
                           lambda: sum(m.core.replay.nbytes for m in loaded()))})
    names = _resolver(registry)

    def stored_elsewhere(response_id: str) -> str | None:
        return next((m.model_id for m in loaded()
                     if m.responses.store.entry(response_id) is not None), None)

    def build(spec: ModelSpec) -> ModelServices:
        model = build_model_services(spec, settings, metrics, ModelNames(spec.id, names, registry.ids),
                                     kv_gauges=spec.id == registry.default.id, grammars=grammars,
                                     early=early)
        model.responses.stored_elsewhere = stored_elsewhere
        return model

    if host_factory is None:
        def host_factory(registry: ModelRegistry, build: Callable[[ModelSpec], ModelServices]) -> ModelHost:
            return OnDemandHost(registry, settings, metrics, build)
    hosts.append(host_factory(registry, build))
    return Services(settings=settings, registry=registry, guard=RequestGuard.from_settings(settings),
                    host=hosts[0], metrics=metrics)


def _resolver(registry: ModelRegistry) -> Callable[[object, str], str | None]:
    def resolve(requested: object, route: str) -> str | None:
        spec = registry.resolve(requested, route)
        return spec.id if spec is not None else None
    return resolve


def build_model_services(spec: ModelSpec, server: Settings, metrics: Metrics, names: ModelNames,
                         *, kv_gauges: bool = True, grammars: GrammarCache | None = None,
                         early: EarlyStarts | None = None) -> ModelServices:
    """Build (not start) one model's pool, core and adapters. ``kv_gauges``: its workers'
    ready records and generations feed the server's KV-cache gauges; ``grammars``: the
    server's compiled-grammar cache (the model's own when None); ``early``: see
    ``build_services``.

    Raises:
        RegistryError: a per-model value is out of bounds.
    """
    settings = spec.settings(server)
    pool = WorkerPool([], on_route=_tell_router)  # workers appended once the callback exists

    def on_generation(stats: GenerationStats) -> None:
        log_generation(stats)
        metrics.observe_generation(stats, kv=kv_gauges, model=spec.id)

    core = ServingCore(settings=settings, model_id=spec.id, runtime=pool, on_generation=on_generation,
                       grammars=grammars)
    core.names = names
    model = ModelServices(
        spec=spec, settings=settings, pool=pool, core=core, chat=ServingChat(core),
        responses=ServingResponses(core), messages=ServingMessages(core),
        completions=ServingCompletions(core))
    # The ExecuTorch worker does not tokenize: prompts go to it as ids (worker/prompt_encoder.py).
    encoder = PromptEncoder(settings.tokenizer_path) if settings.engine == "executorch" else None
    argv = worker_argv(spec, server)
    pool.workers.extend(
        _pool_worker(settings, argv, worker_env(spec, server, index), index,
                     _on_worker_ready(model, metrics, index, kv_gauges=kv_gauges), encoder,
                     spawn=early.spawn_for(spec.id, index) if early is not None else WorkerClient.spawn)
        for index in range(settings.workers))
    pool.configure_tokenize_gate(settings.queue_depth)
    return model


def _on_worker_ready(model: ModelServices, metrics: Metrics, index: int, *,
                     kv_gauges: bool) -> Callable[[Ready], None]:
    """Worker ``index``'s readiness callback (module docstring). Raising refuses the worker."""
    def on_ready(ready: Ready) -> None:
        core = model.core
        core.configure(ready)
        model.n_ctx = ready.n_ctx
        bos = ""
        if core.profile is not None and core.profile.profile.bos_once:
            bos = core.profile.bos_token
        bos_id = ready.special_tokens.get("bos_id")
        core.raw.configure(
            fim_ids=ready.fim_ids, bos_token=bos,
            bos_id=bos_id if isinstance(bos_id, int) and not isinstance(bos_id, bool) else None)
        metrics.worker_ready(ready.capacity, ready.n_ctx, index, model=model.model_id, kv=kv_gauges)
    return on_ready


def _tell_router(worker_index: int) -> None:
    """The response's ``x-trioserve-worker`` header (router_facing.py) names the worker the
    pool chose for this request; called in the submitting request's task."""
    serving_info().worker = worker_index


def _pool_worker(settings: Settings, argv: list[str], env: dict[str, str], index: int,
                 on_ready: Callable[[Ready], None], encoder: PromptEncoder | None,
                 spawn: SpawnWorker) -> PoolWorker:
    """Worker ``index`` of a model's pool: its runtime and its supervisor (own restart policy,
    own environment: CPU settings, and its GPU when several workers offload)."""
    runtime = SessionRuntime(queue_depth=settings.queue_depth, cancel_grace=settings.cancel_grace,
                             stall_timeout=settings.stall_timeout,
                             health_timeout=settings.health_timeout, prompt_encoder=encoder)
    prefixes = ResidentPrefixes()

    def ready(info: Ready) -> None:
        on_ready(info)
        prefixes.clear()  # a new incarnation holds no prompt yet

    supervisor = Supervisor(
        argv,
        runtime,
        on_ready=ready,
        # The worker gets the server's environment plus its CPU settings (OpenMP waiting).
        env={**os.environ, **env},
        ready_timeout=settings.ready_timeout,
        stop_timeout=2.0,
        kill_timeout=2.0,
        policy=RestartPolicy(restart=settings.restart, max_crashes=settings.max_crashes,
                             crash_window=settings.crash_window),
        spawn=spawn,
    )
    return PoolWorker(index, runtime, supervisor, prefixes)
