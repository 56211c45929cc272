"""The composition root: every part of one server, built once from its settings.

``build_services`` wires the worker pool (each worker's runtime and supervisor), the
API-neutral serving core, one adapter per API and the metrics, and returns them as one typed
:class:`Services`. Nothing starts here: the app's lifespan starts ``pool`` in the app nursery
(``pool.run``) and stops it (bounded) at shutdown.

Readiness is one callback per worker (``_on_worker_ready``): the worker's ready record
configures the core (template, profile; it may refuse the worker with ``FatalStartupError``),
then the core's raw prompts (FIM and BOS ids), then that worker's KV-cache gauges.
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
from trioserve.core.serving import ServingCore
from trioserve.core.stats import GenerationStats, log_generation
from trioserve.http.guard import RequestGuard
from trioserve.http.metrics import Metrics
from trioserve.http.router_facing import serving_info
from trioserve.worker.pool import PoolWorker, WorkerPool
from trioserve.worker.prompt_encoder import PromptEncoder
from trioserve.worker.protocol import Ready
from trioserve.worker.routing import ResidentPrefixes
from trioserve.worker.runtime import SessionRuntime
from trioserve.worker.supervisor import RestartPolicy, Supervisor

__all__ = ["Services", "build_services"]


@dataclass
class Services:
    """One server's parts. ``pool`` is both the runtime the core submits to and the
    supervisor ``/health`` and the lifespan see (one worker or several behind one router)."""

    settings: Settings
    model_id: str
    guard: RequestGuard
    pool: WorkerPool
    core: ServingCore
    chat: ServingChat
    responses: ServingResponses
    messages: ServingMessages
    completions: ServingCompletions
    metrics: Metrics
    created: int = field(default_factory=lambda: int(time.time()))
    # A request's context window (the worker's per-slot n_ctx); 0 until a worker is ready.
    n_ctx: int = 0


def build_services(settings: Settings) -> Services:
    """Build (not start) every part of a server for ``settings``."""
    model_id = settings.resolved_model_id()
    pool = WorkerPool([], on_route=_tell_router)  # workers appended once the callback exists
    metrics = Metrics(queued=lambda: pool.queued, running=lambda: pool.in_flight,
                      restarts=lambda: pool.restarts, ready=lambda: pool.state == "ready",
                      workers=pool.workers, vllm_names=settings.metrics_vllm_names)

    def on_generation(stats: GenerationStats) -> None:
        log_generation(stats)
        metrics.observe_generation(stats)

    core = ServingCore(settings=settings, model_id=model_id, runtime=pool, on_generation=on_generation)
    services = Services(
        settings=settings, model_id=model_id, guard=RequestGuard.from_settings(settings), pool=pool,
        core=core, chat=ServingChat(core), responses=ServingResponses(core),
        messages=ServingMessages(core), completions=ServingCompletions(core), metrics=metrics)
    # The ExecuTorch worker does not tokenize: prompts go to it as ids (worker/prompt_encoder.py).
    encoder = PromptEncoder(settings.tokenizer_path) if settings.engine == "executorch" else None
    pool.workers.extend(
        _pool_worker(settings, index, _on_worker_ready(services, index), encoder)
        for index in range(settings.workers))
    pool.configure_tokenize_gate(settings.queue_depth)
    return services


def _on_worker_ready(services: Services, index: int) -> Callable[[Ready], None]:
    """Worker ``index``'s readiness callback (module docstring). Raising refuses the worker."""
    def on_ready(ready: Ready) -> None:
        core = services.core
        core.configure(ready)
        services.n_ctx = ready.n_ctx
        bos = ""
        if core.profile is not None and core.profile.profile.bos_once:
            bos = core.profile.bos_token
        bos_id = ready.special_tokens.get("bos_id")
        core.raw.configure(
            fim_ids=ready.fim_ids, bos_token=bos,
            bos_id=bos_id if isinstance(bos_id, int) and not isinstance(bos_id, bool) else None)
        services.metrics.worker_ready(ready.capacity, ready.n_ctx, index)
    return on_ready


def _tell_router(worker_index: int) -> None:
    """The response's ``x-trioserve-worker`` header (router_facing.py) names the worker the
    pool chose for this request; called in the submitting request's task."""
    serving_info().worker = worker_index


def _pool_worker(settings: Settings, index: int, on_ready: Callable[[Ready], None],
                 encoder: PromptEncoder | None) -> PoolWorker:
    """Worker ``index`` of the pool: its runtime and its supervisor (own restart policy,
    own environment: CPU settings, and its GPU when several workers offload)."""
    runtime = SessionRuntime(queue_depth=settings.queue_depth, cancel_grace=settings.cancel_grace,
                             stall_timeout=settings.stall_timeout,
                             health_timeout=settings.health_timeout, prompt_encoder=encoder)
    prefixes = ResidentPrefixes()

    def ready(info: Ready) -> None:
        on_ready(info)
        prefixes.clear()  # a new incarnation holds no prompt yet

    supervisor = Supervisor(
        settings.worker_argv(),
        runtime,
        on_ready=ready,
        # The worker gets the server's environment plus its CPU settings (OpenMP waiting).
        env={**os.environ, **settings.worker_env(index)},
        ready_timeout=settings.ready_timeout,
        stop_timeout=2.0,
        kill_timeout=2.0,
        policy=RestartPolicy(restart=settings.restart, max_crashes=settings.max_crashes,
                             crash_window=settings.crash_window),
    )
    return PoolWorker(index, runtime, supervisor, prefixes)
