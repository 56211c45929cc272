"""The HTTP layer: quart-trio routes, JSON/SSE responses and the app lifespan.

``hypercorn trioserve.app:app --worker-class trio`` serves the app configured from
``TRIOSERVE_*`` variables (``app`` builds it on its first call, so importing this module
for ``create_app`` starts nothing). The lifespan owns the worker: ``before_serving``
starts the Supervisor in the app nursery, ``after_serving`` stops it (bounded).

Cancellation path: hypercorn/quart-trio cancel a request's task when its client goes
away; ServingChat's ``finally`` then calls ``Generation.cancel()`` synchronously, which
writes the cancel frame and bounds the dispatcher's wait for the worker's terminal
record. Nothing in a handler's cleanup awaits.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
from typing import Any, Callable

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from . import errors
from .config import Settings
from .runtime import SessionRuntime
from .serving_chat import ServingChat
from .supervisor import RestartPolicy, Supervisor

log = logging.getLogger("trioserve")


# Synchronous callbacks to run when the current HTTP request's ASGI call ends, however it
# ends (normally, cancelled by a disconnect, or failing). Set per request by AsgiWrapper.
_request_end_callbacks: contextvars.ContextVar[list[Callable[[], None]]] = contextvars.ContextVar(
    "trioserve_request_end_callbacks")


def call_at_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` (synchronous, must not raise) when this request's ASGI call ends.

    Why: a streaming response's body generator only runs its ``finally`` once iteration
    started; a client that disconnects between the handler's return and the first body
    chunk would otherwise leave its generation running. This hook always runs.
    """
    _request_end_callbacks.get().append(callback)


class AsgiWrapper:
    """The ASGI layer around the Quart app. Two duties:

    1. Run the ``call_at_request_end`` callbacks of each HTTP request in ``finally``.
    2. Shield only the last ``http.response.body`` send of each response. quart-trio under
       hypercorn's trio worker cancels the request while hypercorn is still inside that
       final send, so the connection is never closed or recycled (keep-alive timeouts and
       ``Connection: close`` are ignored, shutdown waits out the graceful timeout).
       Shielding *every* send would make a generator with no awaits between yields
       uncancellable, so only the last is shielded.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        callbacks: list[Callable[[], None]] = []
        token = _request_end_callbacks.set(callbacks)
        try:
            return await self.app(scope, receive, send_wrapper)
        finally:
            _request_end_callbacks.reset(token)
            for callback in callbacks:
                callback()


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _error_response(exc: errors.APIError) -> Response:
    resp = Response(_dumps(exc.envelope()), status=exc.status, content_type="application/json")
    for name, value in exc.headers.items():
        resp.headers[name] = value
    return resp


def create_quart_app(settings: Settings) -> QuartTrio:
    """Build the Quart app with its runtime, supervisor and adapter (nothing starts yet)."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = QuartTrio("trioserve")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    # quart-trio cancels the app nursery this long after shutdown starts, silently cutting
    # after_serving; it must exceed the worker's bounded stop (EOF wait + SIGTERM + SIGKILL).
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 30
    app.config["RESPONSE_TIMEOUT"] = None  # streams are bounded by max_tokens, not a clock
    app.config["BODY_TIMEOUT"] = 60

    runtime = SessionRuntime(queue_depth=settings.queue_depth, cancel_grace=settings.cancel_grace)
    model_id = settings.resolved_model_id()
    serving = ServingChat(settings=settings, model_id=model_id, runtime=runtime)
    supervisor = Supervisor(
        settings.worker_argv(),
        runtime,
        on_ready=serving.configure,
        # The worker gets the server's environment plus its CPU settings (OpenMP waiting).
        env={**os.environ, **settings.worker_env()},
        ready_timeout=settings.ready_timeout,
        stop_timeout=2.0,
        kill_timeout=2.0,
        policy=RestartPolicy(restart=settings.restart, max_crashes=settings.max_crashes,
                             crash_window=settings.crash_window),
    )
    app.extensions["trioserve"] = {"settings": settings, "runtime": runtime,
                                   "serving": serving, "supervisor": supervisor}
    created = int(time.time())

    @app.before_serving
    async def start_supervisor() -> None:
        await app.nursery.start(supervisor.run)

    @app.after_serving
    async def stop_supervisor() -> None:
        with trio.CancelScope(shield=True):
            await supervisor.stop()

    @app.get("/health")
    async def health() -> Response:
        body: dict[str, Any] = {"status": supervisor.state}
        if supervisor.state != "ready":
            body["reason"] = supervisor.reason
        body.update(model=model_id, queued=runtime.queued, busy=runtime.busy,
                    restarts=supervisor.restarts, worker_pid=supervisor.worker_pid)
        status = 200 if supervisor.state == "ready" else 503
        return Response(_dumps(body), status=status, content_type="application/json")

    @app.get("/v1/models")
    async def models() -> Response:
        body = {"object": "list", "data": [
            {"id": model_id, "object": "model", "created": created, "owned_by": "trioserve"}]}
        return Response(_dumps(body), content_type="application/json")

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        body = await request.get_data(cache=False)
        result = await serving.create(body)
        if isinstance(result, dict):
            return Response(_dumps(result), content_type="application/json")
        call_at_request_end(result.cancel)
        resp = Response(result.body, content_type="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        resp.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long streams
        return resp

    @app.errorhandler(errors.APIError)
    async def api_error(exc: errors.APIError) -> Response:
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        if exc.code == 413:
            return _error_response(errors.request_too_large(settings.max_body_bytes))
        if exc.code == 405:
            return _error_response(errors.method_not_allowed())
        if exc.code == 404:
            return _error_response(errors.not_found())
        return _error_response(errors.APIError(exc.code or 500, "invalid_request_error",
                                               exc.description or exc.name))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception("unexpected error")
        return _error_response(errors.internal_error("internal server error"))

    return app


def create_app(settings: Settings | None = None) -> AsgiWrapper:
    """The ASGI application for ``settings`` (default: from the environment)."""
    return AsgiWrapper(create_quart_app(settings or Settings.from_env()))


class _AppFromEnvironment:
    """The ASGI app for ``hypercorn trioserve.app:app``, built from ``TRIOSERVE_*`` variables
    on its first call (the lifespan startup), so importing this module starts nothing."""

    def __init__(self) -> None:
        self._app: AsgiWrapper | None = None

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self._app is None:
            self._app = create_app()
        await self._app(scope, receive, send)


app = _AppFromEnvironment()
