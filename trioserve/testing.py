"""Run a whole trioserve in-process on a loopback port — for tests and benchmarks.

``serve_in_process`` starts hypercorn's trio backend with the real app (worker process
included) inside the caller's Trio run and stops it, lifespan and worker included, when
the ``async with`` block ends. Nothing here is used by the server itself.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import AsyncIterator

import trio
from hypercorn.config import Config

from trioserve.http.application import TrioserveApp, asgi_app, create_quart_app
from trioserve.http.services import Services
from trioserve.worker.pool import WorkerPool
from trioserve.config import Settings
from trioserve.http.server import serve


@dataclass
class InProcessServer:
    """A running server: its base URL and the app's parts, for white-box assertions."""

    url: str
    quart_app: TrioserveApp

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    @property
    def services(self) -> Services:
        return self.quart_app.services

    @property
    def settings(self) -> Settings:
        return self.quart_app.services.settings

    @property
    def pool(self) -> WorkerPool:
        """The workers: the runtime requests are submitted to, and what ``/health`` reports."""
        return self.quart_app.services.default.pool

    async def wait_state(self, state: str, timeout: float = 15.0) -> None:
        """Wait (bounded) until ``/health`` would report ``state``."""
        with trio.fail_after(timeout):
            while self.pool.state != state:
                await trio.sleep(0.01)


@asynccontextmanager
async def serve_in_process(settings: Settings, *, wait_ready: bool = True,
                           ready_timeout: float = 300.0) -> AsyncIterator[InProcessServer]:
    """Serve ``settings`` on 127.0.0.1 (``port`` is ignored: an ephemeral one is used)."""
    quart_app = create_quart_app(settings)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 2.0
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, asgi_app(quart_app), config,
                                            max_connections=settings.max_connections,
                                            shutdown_trigger=shutdown.wait))
        server = InProcessServer(binds[0], quart_app)
        try:
            if wait_ready:  # every model loading at startup loaded
                host = server.services.host
                with trio.fail_after(ready_timeout):
                    for model in host.loaded():
                        while host.state(model.model_id) != "loaded":
                            if model.pool.fatal.is_set():
                                raise RuntimeError(f"server cannot start: model {model.model_id}: "
                                                   f"{model.pool.reason}")
                            await trio.sleep(0.01)
            yield server
        finally:
            shutdown.set()
