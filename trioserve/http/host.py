"""Where the routes get a served model's parts: the model host (spec/README.md §2.1).

The interface the routes use (:class:`ModelHost`):

- ``async with host.lease(model_id) as model:`` yields the model's :class:`ModelServices`
  once it is loaded, and counts the request on it (``ModelServices.active``) while held; a
  route that answers with an event stream extends the count to the stream's end with
  ``model.hold()``.
- ``host.state(model_id)``: ``"loaded"``, ``"loading"``, ``"unloading"`` or
  ``"not_loaded"`` (``GET /v1/models``, spec §14.5); ``host.failure(model_id)``: why a model
  that is not loaded cannot be served now (``GET /v1/models`` shows it ``failed``), and
  ``host.preview(model_id)``: its context window and capabilities from its file's header.
- ``await host.load(model_id)`` / ``await host.unload(model_id)``: the admin endpoints.
- ``await nursery.start(host.run)`` starts it in the app nursery; ``await host.stop()``
  stops every model's workers, bounded by their supervisors.

The host is :class:`~trioserve.http.on_demand_host.OnDemandHost`: each model its own worker
pool and supervisors (one model's crash never touches another), loaded on demand within the
memory budget. :class:`ModelServices` (one model's parts) lives here, beside the interface
that hands it out, so the host, its implementation and the composition root
(http/services.py) import in one direction: services → on_demand_host → host.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Callable, Protocol

import trio

from trioserve.api.chat.adapter import ServingChat
from trioserve.api.completions.adapter import ServingCompletions
from trioserve.api.messages.adapter import ServingMessages
from trioserve.api.responses.adapter import ServingResponses
from trioserve.config import Settings
from trioserve.core.serving import ServingCore
from trioserve.http.model_preview import ModelPreview
from trioserve.registry import ModelSpec
from trioserve.worker.pool import WorkerPool

__all__ = ["ModelHost", "ModelServices"]


@dataclass
class ModelServices:
    """One served model's parts. ``pool`` is both the runtime its core submits to and the
    supervisor ``/health`` sees (one worker or several behind one router); ``settings`` are
    the model's own (the server's with the model's values applied, ``ModelSpec.settings``).

    ``active`` counts the requests holding the model (``hold``): a load-on-demand host never
    unloads a model while it is above zero.
    """

    spec: ModelSpec
    settings: Settings
    pool: WorkerPool
    core: ServingCore
    chat: ServingChat
    responses: ServingResponses
    messages: ServingMessages
    completions: ServingCompletions
    created: int = field(default_factory=lambda: int(time.time()))
    # A request's context window (the worker's per-slot n_ctx); 0 until a worker is ready.
    n_ctx: int = 0
    active: int = 0
    # Called when a hold ends (the host re-checks loads waiting for memory and idle timers).
    on_release: Callable[[], None] | None = None

    @property
    def model_id(self) -> str:
        return self.spec.id

    def hold(self) -> Callable[[], None]:
        """Count one request on this model until the returned release (synchronous,
        idempotent) is called; a route holds a model for a whole event stream with it."""
        self.active += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.active -= 1
                if self.on_release is not None:
                    self.on_release()
        return release


class ModelHost(Protocol):
    def lease(self, model_id: str) -> AbstractAsyncContextManager[ModelServices]: ...

    def state(self, model_id: str) -> str: ...

    def failure(self, model_id: str) -> str | None: ...

    def preview(self, model_id: str) -> ModelPreview | None: ...

    def pinned(self, model_id: str) -> bool: ...

    async def load(self, model_id: str) -> str: ...

    async def unload(self, model_id: str) -> str: ...

    def services(self, model_id: str) -> ModelServices: ...

    def loaded(self) -> list[ModelServices]: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    async def stop(self) -> None: ...

    async def wait_fatal(self) -> None: ...

    @property
    def fatal(self) -> bool: ...

    @property
    def reason(self) -> str: ...
