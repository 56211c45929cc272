"""The HTTP layer: quart-trio routes, JSON/SSE responses and the app lifespan.

``hypercorn trioserve.app:app --worker-class trio`` serves the app configured from
``TRIOSERVE_*`` variables (``app`` builds it on its first call, so importing this module
for ``create_app`` starts nothing). The lifespan owns the worker: ``before_serving``
starts the Supervisor in the app nursery, ``after_serving`` stops it (bounded).

Layers around the Quart app (outermost first): ``AsgiWrapper`` (request-end callbacks,
final-send shield), ``RequestObserver`` (request id, access log, request metrics, a 500
envelope if anything below fails before responding), ``HostCheck`` (Host validity and
allow-list), then Quart, whose ``before_request`` hook runs the rest of the
``RequestGuard`` (API key, JSON content type) before any handler reads a body.

Cancellation path: hypercorn/quart-trio cancel a request's task when its client goes
away; ServingChat's ``finally`` then calls ``Generation.cancel()`` synchronously, which
writes the cancel frame and bounds the dispatcher's wait for the worker's terminal
record. Nothing in a handler's cleanup awaits.
"""

from __future__ import annotations

import contextvars
import logging
import os
import time
from typing import Any, Callable

import trio
from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from trioserve import errors
from trioserve.http.access_log import RequestObserver, current_request
from trioserve.config import Settings
from trioserve.http.guard import HostCheck, RequestGuard, json_bytes
from trioserve.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trioserve.http.metrics import Metrics
from trioserve.worker.prompt_encoder import PromptEncoder
from trioserve.http.router_facing import RouterFacing
from trioserve.worker.runtime import GenerationError, SessionRuntime
from trioserve.core.sessions import validate_session_key
from trioserve.api.chat.adapter import ServingChat, new_completion_id
from trioserve.api.responses.adapter import JsonResponse, ServingResponses, new_response_id
from trioserve.core.serving import ServingCore
from trioserve.core.stats import GenerationStats, log_generation
from trioserve.worker.pool import PoolWorker, WorkerPool
from trioserve.worker.protocol import Ready
from trioserve.worker.routing import ResidentPrefixes
from trioserve.worker.supervisor import PUBLIC_REASONS, RestartPolicy, Supervisor, public_reason  # noqa: F401 (re-exported)
from trioserve.http import completions_routes as legacy_routes
from trioserve.http import messages_routes
from trioserve.http.route_support import arriving_request, event_stream, json_response
from trioserve.api.messages.adapter import ServingMessages

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


def _error_response(exc: errors.APIError) -> Response:
    # json_bytes, here and for every JSON body: text quoted from a request may not be
    # valid UTF-8 (lone surrogates), and that must not turn a response into a 500.
    # Each API answers in its own error shape: Anthropic's under /v1/messages.
    body = (messages_routes.error_body(exc) if messages_routes.is_messages_path(request.path)
            else exc.envelope())
    resp = Response(json_bytes(body), status=exc.status, content_type="application/json")
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
    # OPTIONS is a wrong method like any other (405 envelope), not an empty 200: there is
    # no CORS support to preflight.
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False

    guard = RequestGuard.from_settings(settings)
    # The ExecuTorch worker does not tokenize: prompts go to it as ids (worker/prompt_encoder.py).
    encoder = PromptEncoder(settings.tokenizer_path) if settings.engine == "executorch" else None
    model_id = settings.resolved_model_id()

    def on_generation(stats: GenerationStats) -> None:
        log_generation(stats)
        metrics.observe_generation(stats)

    # The workers (one by default) behind one router: the core and the APIs see the pool
    # as their runtime, the lifespan and /health as their supervisor (worker/pool.py).
    pool = WorkerPool([])  # filled below, once the readiness callback exists
    runtime = supervisor = pool
    # One API-neutral core; each API is an adapter over it (trioserve/api/).
    core = ServingCore(settings=settings, model_id=model_id, runtime=runtime,
                       on_generation=on_generation)
    serving = ServingChat(core)
    responses = ServingResponses(core)
    legacy = legacy_routes.build(settings, model_id, runtime, serving, on_generation)
    messages_api = ServingMessages(core)
    serve_ready = legacy.chain_ready(core.configure)

    def on_ready(index: int) -> Callable[[Ready], None]:
        # Worker ``index``'s ready record configures the core, then that worker's own
        # KV-cache gauges (metrics.py sums them for the pool).
        return _then(serve_ready, lambda ready: metrics.worker_ready(ready.capacity, ready.n_ctx,
                                                                     index))

    pool.workers.extend(_pool_worker(settings, index, on_ready(index), encoder)
                        for index in range(settings.workers))
    metrics = Metrics(queued=lambda: runtime.queued, running=lambda: runtime.in_flight,
                      restarts=lambda: supervisor.restarts,
                      ready=lambda: supervisor.state == "ready", workers=pool.workers,
                      vllm_names=settings.metrics_vllm_names)
    app.extensions["trioserve"] = {"settings": settings, "runtime": runtime, "serving": serving,
                                   "core": core, "responses": responses,
                                   "supervisor": supervisor, "metrics": metrics, "guard": guard,
                                   "pool": pool}
    created = int(time.time())

    @app.before_serving
    async def start_supervisor() -> None:
        await app.nursery.start(supervisor.run)

    @app.after_serving
    async def stop_supervisor() -> None:
        with trio.CancelScope(shield=True):
            await supervisor.stop()

    @app.before_request
    async def check_guards() -> None:
        # The Host was already checked by HostCheck, in front of Quart.
        headers = request.headers
        server = request.scope.get("server")
        refusal = guard.check(
            method=request.method, path=request.path,
            authorization=authorization_header(headers), content_type=headers.get("content-type"),
            local_address=server[0] if server else None, route_matched=request.url_rule is not None)
        if refusal is not None:
            raise refusal

    @app.get("/health")
    async def health() -> Response:
        # Public: status, a short reason and counters. The detailed reason (worker
        # messages, paths, pids) goes to the log only.
        state = supervisor.state
        body: dict[str, Any] = {"status": state}
        if state != "ready":
            body["reason"] = public_reason(supervisor)
            # The signal that killed the last worker, in words ("illegal instruction
            # (SIGILL)"): a fact about the CPU path, not a worker message.
            crash = getattr(supervisor, "crash", None)
            if crash:
                body["crash"] = crash
        body.update(model=model_id, queued=runtime.queued, running=runtime.in_flight,
                    restarts=supervisor.restarts)
        if len(pool.workers) > 1:  # one worker: the fields above are its own
            body["workers"] = pool.health()
        status = 200 if state == "ready" else 503
        return Response(json_bytes(body), status=status, content_type="application/json")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        entry: dict[str, Any] = {"id": model_id, "object": "model", "created": created,
                                 "owned_by": "trioserve"}
        capabilities = serving.capabilities()  # profiles branch: spec §2, None while loading
        if capabilities is not None:
            entry["capabilities"] = capabilities
            if supervisor.kernel_path is not None:  # llama workers: the verified CPU path
                entry["capabilities"] = {**capabilities, "kernel_path": supervisor.kernel_path}
        entry.update(legacy_routes.context_window(legacy.n_ctx))
        body = {"object": "list", "data": [entry]}
        return json_response(body)

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        completion_id = new_completion_id()
        async with arriving_request(runtime, completion_id) as (body, arrival):
            result = await serving.create(body, completion_id=completion_id, headers=request.headers,
                                          arrival=arrival)
        if isinstance(result, dict):
            return json_response(result)
        return event_stream(result.body, result.cancel, call_at_request_end)

    @app.post("/v1/responses")
    async def create_response() -> Response:
        response_id = new_response_id()
        async with arriving_request(runtime, response_id) as (body, arrival):
            result = await responses.create(body, response_id=response_id, headers=request.headers,
                                            arrival=arrival)
        if isinstance(result, JsonResponse):
            return json_response(result.body, result.headers)
        return event_stream(result.body, result.cancel, call_at_request_end, result.headers)

    # Stored responses (spec §20.5): what the official SDK's retrieve, delete and
    # input_items.list call.
    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str) -> Response:
        return json_response(responses.retrieve(response_id, request.args))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        return json_response(responses.delete(response_id))

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        return json_response(responses.input_items(response_id, request.args))
    legacy_routes.register(app, legacy, runtime, call_at_request_end)
    messages_routes.register(app, messages_api, runtime, call_at_request_end)

    @app.delete("/v1/sessions/<path:key>")
    async def delete_session(key: str) -> Response:
        validate_session_key(key, "session")
        serving.replay.forget(key)  # its remembered turns go too (spec §12)
        try:
            found = await runtime.close_session(key)
        except GenerationError as exc:
            if exc.code == "session_busy":
                raise errors.session_busy(key) from None
            raise errors.worker_unavailable(exc.message, 1) from None
        if not found:
            raise errors.session_not_found(key)
        return Response(b"", status=204)

    @app.errorhandler(errors.APIError)
    async def api_error(exc: errors.APIError) -> Response:
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        if exc.code == 413:
            return _error_response(errors.request_too_large(settings.max_body_bytes))
        if exc.code == 405:
            return _error_response(errors.method_not_allowed())
        if exc.code == 408:  # Quart's BODY_TIMEOUT
            return _error_response(errors.request_timeout(app.config["BODY_TIMEOUT"]))
        if exc.code == 404:
            if request.method == "DELETE" and request.path.startswith(SESSIONS_PREFIX):
                # No route matched: the key is empty or holds a newline (the route's path
                # converter stops there). Name what is wrong with it rather than 404.
                try:
                    validate_session_key(request.path[len(SESSIONS_PREFIX):], "session")
                except errors.APIError as bad_key:
                    return _error_response(bad_key)
            return _error_response(errors.not_found())
        return _error_response(errors.APIError(exc.code or 500, "invalid_request_error",
                                               exc.description or exc.name))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        info = current_request()
        request_id = info.request_id if info else "-"
        log.exception("unexpected error in %s %s (request %s)", request.method, request.path, request_id)
        return _error_response(errors.internal_error(
            f"the request could not be completed (request id {request_id}; details in the server log)"))

    return app


SESSIONS_PREFIX = "/v1/sessions/"


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


def _then(first: Callable[[Any], None], second: Callable[[Any], None]) -> Callable[[Any], None]:
    """An ``on_ready`` that runs ``first`` (which may refuse the worker by raising), then
    ``second``."""
    def both(ready: Any) -> None:
        first(ready)
        second(ready)
    return both


def authorization_header(headers: Any) -> str | None:
    """The request's credentials as an ``Authorization`` value: the header itself, else
    Anthropic's ``x-api-key`` as a bearer token (Claude Code and the anthropic SDK send the
    key there)."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key") is not None:
        return "Bearer " + headers.get("x-api-key")
    return authorization


def asgi_app(quart_app: QuartTrio) -> AsgiWrapper:
    """The full ASGI stack around an app from ``create_quart_app``."""
    parts = quart_app.extensions["trioserve"]
    settings = parts["settings"]
    observed = RequestObserver(HostCheck(quart_app, parts["guard"]), parts["metrics"])
    return AsgiWrapper(RouterFacing(observed, instance_id=settings.instance_id,
                                    keepalive=settings.sse_keepalive))


def create_app(settings: Settings | None = None) -> AsgiWrapper:
    """The ASGI application for ``settings`` (default: from the environment).

    Also gives hypercorn's HTTP parser errors JSON bodies (server.install_protocol_error_bodies),
    since under ``hypercorn trioserve.app:app`` nothing else of trioserve runs first.
    """
    from trioserve.http.server import install_protocol_error_bodies

    install_protocol_error_bodies()
    return asgi_app(create_quart_app(settings or Settings.from_env()))
