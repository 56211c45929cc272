"""Where the routes get a served model's parts: the model host (spec/README.md §2.1).

The interface the routes use (:class:`ModelHost`):

- ``async with host.lease(model_id) as model:`` yields the model's :class:`ModelServices`
  once it is loaded, and counts the request on it (``ModelServices.active``) while held; a
  route that answers with an event stream extends the count to the stream's end with
  ``model.hold()``.
- ``host.state(model_id)``: ``"loaded"``, ``"loading"`` or ``"not_loaded"`` (``GET
  /v1/models``).
- ``await nursery.start(host.run)`` starts it in the app nursery; ``await host.stop()``
  stops every model's workers, bounded by their supervisors.

:class:`StaticHost` is the simple host: every model is loaded at startup, each its own worker
pool and supervisors, so one model's crash never touches another. A load-on-demand host
replaces it behind the same interface.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, AsyncIterator, Protocol

import trio

from trioserve.registry import ModelRegistry

if TYPE_CHECKING:
    from trioserve.http.services import ModelServices

__all__ = ["ModelHost", "StaticHost"]

LOADED, LOADING, NOT_LOADED = "loaded", "loading", "not_loaded"


class ModelHost(Protocol):
    def lease(self, model_id: str) -> AbstractAsyncContextManager[ModelServices]: ...

    def state(self, model_id: str) -> str: ...

    def services(self, model_id: str) -> ModelServices: ...

    def loaded(self) -> list[ModelServices]: ...

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None: ...

    async def stop(self) -> None: ...

    async def wait_fatal(self) -> None: ...

    @property
    def fatal(self) -> bool: ...

    @property
    def reason(self) -> str: ...


class StaticHost:
    """Every model of the registry loaded at startup and kept (module docstring)."""

    def __init__(self, models: dict[str, ModelServices], registry: ModelRegistry) -> None:
        self.models = models
        self.registry = registry

    def services(self, model_id: str) -> ModelServices:
        """The parts of ``model_id`` (a served id), whatever its state."""
        return self.models[model_id]

    def loaded(self) -> list[ModelServices]:
        """The models whose workers run (here: all), in registry order."""
        return [self.models[model_id] for model_id in self.registry.ids]

    @asynccontextmanager
    async def lease(self, model_id: str) -> AsyncIterator[ModelServices]:
        """The model's parts, counted as in use until the block ends. Never waits here:
        every model is loaded (a model whose workers are still starting answers as its pool
        does, 503 ``worker_unavailable`` or a wait in its queue)."""
        model = self.models[model_id]
        release = model.hold()
        try:
            yield model
        finally:
            release()

    def state(self, model_id: str) -> str:
        pool = self.models[model_id].pool
        return {"ready": LOADED, "loading": LOADING}.get(pool.state, NOT_LOADED)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Supervise every model's pool until ``stop()``; started once every pool has
        (workers load in the background)."""
        async with trio.open_nursery() as nursery:
            for model in self.loaded():
                await nursery.start(model.pool.run)
            task_status.started()

    async def stop(self) -> None:
        """Stop every model's workers concurrently (each bounded by its supervisors)."""
        async with trio.open_nursery() as nursery:
            for model in self.loaded():
                nursery.start_soon(model.pool.stop)

    async def wait_fatal(self) -> None:
        """Return once no model can be served any more: every pool gave up."""
        for model in self.loaded():
            await model.pool.fatal.wait()

    @property
    def fatal(self) -> bool:
        """No model can be served any more: every pool gave up."""
        return all(model.pool.fatal.is_set() for model in self.loaded())

    @property
    def reason(self) -> str:
        """Why the models cannot be served (log only), model by model."""
        models = self.loaded()
        if len(models) == 1:
            return models[0].pool.reason
        return "; ".join(f"model {m.model_id}: {m.pool.reason}" for m in models if m.pool.reason)
