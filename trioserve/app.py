"""The entry point ``hypercorn trioserve.app:app --worker-class trio``.

Importing this module is what hypercorn does in its worker process before it serves, so this
is the one module whose import has an effect: it gives hypercorn's accept loop trioserve's
isolated connection handler and connection cap (:mod:`trioserve.http.server`), so no client
can stop that entry point or take all its connections. It raises if the installed hypercorn
is not a version that was verified. Everything else (``trioserve serve``, tests) builds the
app through :func:`trioserve.http.application.create_app` and patches nothing on import.
"""

from __future__ import annotations

import logging
from typing import Any

from trioserve.config import Settings, SettingsError
from trioserve.http.application import AsgiWrapper, create_app
from trioserve.http.server import freeze_startup_heap, install_in_hypercorn_worker

__all__ = ["app"]

log = logging.getLogger("trioserve")


class _AppFromEnvironment:
    """The ASGI app for ``hypercorn trioserve.app:app``, built from ``TRIOSERVE_*`` variables
    on its first call (the lifespan startup), so importing this module starts nothing."""

    def __init__(self) -> None:
        self._app: AsgiWrapper | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._app is None:
            try:
                self._app = create_app()
            except SettingsError as exc:
                if scope["type"] != "lifespan":
                    raise
                # Fail the startup: hypercorn would otherwise log a warning, carry on without
                # a lifespan and answer every request with a 500.
                log.error("trioserve cannot start: %s", exc)
                await receive()  # lifespan.startup
                await send({"type": "lifespan.startup.failed", "message": str(exc)})
                return
        if scope["type"] == "lifespan":
            send = _freezing_at_startup(send)
        await self._app(scope, receive, send)


def _freezing_at_startup(send: Any) -> Any:
    """``send`` for the lifespan: the heap start-up built is frozen before hypercorn hears
    that start-up is complete, as ``trioserve serve`` does (server.freeze_startup_heap); this
    worker process only serves."""

    async def lifespan_send(message: dict) -> None:
        if message["type"] == "lifespan.startup.complete":
            freeze_startup_heap()
        await send(message)

    return lifespan_send


def _max_connections_from_environment() -> int:
    return Settings.from_env().max_connections


install_in_hypercorn_worker(_max_connections_from_environment)
app = _AppFromEnvironment()
