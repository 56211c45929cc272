"""Where the routes get a served model's parts: the model host (spec/README.md §2.1).

The interface the routes use (:class:`ModelHost`):

- ``async with host.lease(model_id) as model:`` yields the model's :class:`ModelServices`
  once it is loaded, and counts the request on it (``ModelServices.active``) while held; a
  route that answers with an event stream extends the count to the stream's end with
  ``model.hold()``.
- ``host.state(model_id)``: ``"loaded"``, ``"loading"``, ``"unloading"`` or
  ``"not_loaded"`` (``GET /v1/models``, spec §14.5).
- ``await host.load(model_id)`` / ``await host.unload(model_id)``: the admin endpoints.
- ``await nursery.start(host.run)`` starts it in the app nursery; ``await host.stop()``
  stops every model's workers, bounded by their supervisors.

The host is :class:`~trioserve.http.on_demand_host.OnDemandHost`: each model its own worker
pool and supervisors (one model's crash never touches another), loaded on demand within the
memory budget.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Protocol

import trio


if TYPE_CHECKING:
    from trioserve.http.services import ModelServices

__all__ = ["ModelHost"]


class ModelHost(Protocol):
    def lease(self, model_id: str) -> AbstractAsyncContextManager[ModelServices]: ...

    def state(self, model_id: str) -> str: ...

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
