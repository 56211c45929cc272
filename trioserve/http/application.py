"""The HTTP layer: quart-trio routes, JSON/SSE responses and the app lifespan.

``hypercorn trioserve.app:app --worker-class trio`` serves the app configured from
``TRIOSERVE_*`` variables (``app`` builds it on its first call, so importing this module
for ``create_app`` starts nothing). The lifespan owns the workers: ``before_serving``
starts the model host (every model's pool and supervisors) in the app nursery,
``after_serving`` stops it (bounded).

Layers around the Quart app (outermost first): ``AsgiWrapper`` (request-end callbacks,
final-send shield), ``RequestObserver`` (request id, access log, request metrics, a 500
envelope if anything below fails before responding), ``HostCheck`` (Host validity and
allow-list), ``WebSocketRefusal`` (WebSocket handshakes: API key, then 426), then Quart,
whose ``before_request`` hook runs the rest of the ``RequestGuard`` (API key, JSON content
type) before any handler reads a body.

Cancellation path: hypercorn/quart-trio cancel a request's task when its client goes
away; ServingChat's ``finally`` then calls ``Generation.cancel()`` synchronously, which
writes the cancel frame and bounds the dispatcher's wait for the worker's terminal
record. Nothing in a handler's cleanup awaits.
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable

import trio
from quart import Response, has_request_context, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, NotFound

from trioserve import errors
from trioserve.config import Settings
from trioserve.core.sessions import validate_session_key
from trioserve.http import messages_routes
from trioserve.http.access_log import RequestObserver, current_request
from trioserve.http.guard import HostCheck, json_bytes
from trioserve.http.router_facing import RouterFacing
from trioserve.http.routes import register_routes
from trioserve.http.services import Services, build_services
from trioserve.http.websocket import WebSocketRefusal
from trioserve.registry import ModelRegistry, PathResolver
from trioserve.worker.early_start import EarlyStarts

log = logging.getLogger("trioserve")


# Synchronous callbacks to run when the current HTTP request's ASGI call ends, however it
# ends (normally, cancelled by a disconnect, or failing). Set per request by AsgiWrapper.
_request_end_callbacks: contextvars.ContextVar[list[Callable[[], None]]] = contextvars.ContextVar(
    "trioserve_request_end_callbacks")


def call_at_request_end(callback: Callable[[], None]) -> None:
    """Run ``callback`` (synchronous, must not raise) when this request's ASGI call ends,
    or, when it sends a complete response, just before the response's last byte goes out.

    Why: a streaming response's body generator only runs its ``finally`` once iteration
    started; a client that disconnects between the handler's return and the first body
    chunk would otherwise leave its generation running. This hook always runs.
    """
    _request_end_callbacks.get().append(callback)


class AsgiWrapper:
    """The ASGI layer around the Quart app. Two duties:

    1. Run the ``call_at_request_end`` callbacks of each HTTP request before its last body
       send, and in ``finally`` (a request that ends without a complete response).
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

        callbacks: list[Callable[[], None]] = []

        def run_callbacks() -> None:
            while callbacks:
                callbacks.pop(0)()

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                # The body is complete: end the request's holds before the client can see
                # the response end, so its next request (an unload of the model it used)
                # never finds this one still in flight.
                run_callbacks()
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        token = _request_end_callbacks.set(callbacks)
        try:
            return await self.app(scope, receive, send_wrapper)
        finally:
            _request_end_callbacks.reset(token)
            run_callbacks()


def _request_path() -> str:
    """The current request's path; "" outside an HTTP request context (error handlers must
    never raise, whatever reached them)."""
    return request.path if has_request_context() else ""


def error_body_for(exc: errors.APIError, path: str) -> dict[str, Any]:
    """The JSON body of ``exc`` for a request to ``path``: each API answers in its own error
    shape (Anthropic's under /v1/messages)."""
    return messages_routes.error_body(exc) if messages_routes.is_messages_path(path) else exc.envelope()


def _error_response(exc: errors.APIError, path: str | None = None) -> Response:
    """``exc`` as a JSON response, in the error shape of ``path`` (default: the request's)."""
    # json_bytes, here and for every JSON body: text quoted from a request may not be
    # valid UTF-8 (lone surrogates), and that must not turn a response into a 500.
    body = error_body_for(exc, _request_path() if path is None else path)
    resp = Response(json_bytes(body), status=exc.status, content_type="application/json")
    for name, value in exc.headers.items():
        resp.headers[name] = value
    return resp


class TrioserveApp(QuartTrio):
    """The Quart app with its parts (:class:`Services`) as a typed attribute."""

    services: Services


def create_quart_app(settings: Settings, *, resolve_path: PathResolver | None = None,
                     registry: ModelRegistry | None = None, early: EarlyStarts | None = None) -> TrioserveApp:
    """Build the Quart app and every part behind it (nothing starts until its lifespan).
    ``resolve_path`` turns a hub model path (``hf:…``) into a local file (trioserve.registry);
    ``registry``, ``early``: see ``build_services``.

    Raises:
        RegistryError: the models cannot be served as configured.
    """
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = TrioserveApp("trioserve")
    _configure_quart(app, settings)
    services = app.services = build_services(settings, resolve_path=resolve_path, registry=registry,
                                             early=early)
    host = services.host

    @app.before_serving
    async def start_workers() -> None:
        await app.nursery.start(host.run)

    @app.after_serving
    async def stop_workers() -> None:
        with trio.CancelScope(shield=True):
            await host.stop()

    @app.before_request
    async def check_guards() -> None:
        # The Host was already checked by HostCheck, in front of Quart.
        headers = request.headers
        server = request.scope.get("server")
        refusal = services.guard.check(
            method=request.method, path=request.path,
            authorization=authorization_header(headers), content_type=headers.get("content-type"),
            local_address=server[0] if server else None, route_matched=request.url_rule is not None)
        if refusal is not None:
            raise refusal
        if str(request.scope.get("path", "")).startswith("//"):
            # Quart and the URL map drop extra leading slashes; spec §2: any other path is 404.
            raise errors.not_found()

    register_routes(app, services, call_at_request_end)
    _register_error_handlers(app, settings)
    return app


def _configure_quart(app: QuartTrio, settings: Settings) -> None:
    # "/v1//models" is another path (spec §2: 404), not a redirect to "/v1/models" with an
    # HTML body; set before any route is added (rules copy it when they bind).
    app.url_map.merge_slashes = False
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    # quart-trio cancels the app nursery this long after shutdown starts, silently cutting
    # after_serving; it must exceed the worker's bounded stop (EOF wait + SIGTERM + SIGKILL).
    app.config["BACKGROUND_TASK_SHUTDOWN_TIMEOUT"] = 30
    app.config["RESPONSE_TIMEOUT"] = None  # streams are bounded by max_tokens, not a clock
    # The body must arrive at a minimum rate, not within a fixed time (route_support.read_body).
    app.config["BODY_TIMEOUT"] = None
    # OPTIONS is a wrong method like any other (405 envelope), not an empty 200: there is
    # no CORS support to preflight.
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = False


def _register_error_handlers(app: QuartTrio, settings: Settings) -> None:
    @app.errorhandler(errors.APIError)
    async def api_error(exc: errors.APIError) -> Response:
        return _error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        if exc.code == 413:
            return _error_response(errors.request_too_large(settings.max_body_bytes))
        if exc.code == 405:
            return _error_response(errors.method_not_allowed())
        if exc.code == 404 or (exc.code or 0) // 100 == 3:
            # A 3xx here is a routing redirect (a trailing or doubled slash): never HTML, and
            # the path asked for does not exist (spec §2).
            if (has_request_context() and request.method == "DELETE"
                    and request.path.startswith(SESSIONS_PREFIX)):
                # No route matched: the key is empty or holds a newline (the route's path
                # converter stops there). Name what is wrong with it rather than 404.
                try:
                    validate_session_key(request.path[len(SESSIONS_PREFIX):], "session")
                except errors.APIError as bad_key:
                    return _error_response(bad_key)
            route = _route_under_doubled_v1(app)
            if route is not None:
                # In the error shape of the route meant: Claude Code reads Anthropic's.
                return _error_response(errors.doubled_v1(request.path, route), route)
            return _error_response(errors.not_found())
        return _error_response(errors.APIError(exc.code or 500, "invalid_request_error",
                                               exc.description or exc.name))

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        info = current_request()
        request_id = info.request_id if info else "-"
        method, path = (request.method, request.path) if has_request_context() else ("-", "-")
        log.exception("unexpected error in %s %s (request %s)", method, path, request_id)
        return _error_response(errors.internal_error(
            f"the request could not be completed (request id {request_id}; details in the server log)"))


SESSIONS_PREFIX = "/v1/sessions/"
DOUBLED_V1 = "/v1/v1/"


def _route_under_doubled_v1(app: QuartTrio) -> str | None:
    """For a request to ``/v1/v1/<rest>`` where ``/v1/<rest>`` is a route (with any method):
    that route, else None. A client whose base URL ends in ``/v1`` and that adds ``/v1``
    itself asks for such paths (spec §2: the 404 says so)."""
    if not has_request_context() or not request.path.startswith(DOUBLED_V1):
        return None
    route = request.path[len("/v1"):]
    try:
        app.url_map.bind("localhost").match(route, method=request.method)
    except NotFound:
        return None
    except HTTPException:  # another method (405) or a redirect: the route exists
        pass
    return route


def authorization_header(headers: Any) -> str | None:
    """The request's credentials as an ``Authorization`` value: the header itself, else
    Anthropic's ``x-api-key`` as a bearer token (Claude Code and the anthropic SDK send the
    key there)."""
    authorization = headers.get("authorization")
    if authorization is None and headers.get("x-api-key") is not None:
        return "Bearer " + headers.get("x-api-key")
    return authorization


def asgi_app(quart_app: TrioserveApp) -> AsgiWrapper:
    """The full ASGI stack around an app from ``create_quart_app``."""
    services = quart_app.services
    settings = services.settings
    # WebSocket handshakes pass the Host and key checks, then are refused in front of
    # Quart, which has no websocket routes (trioserve.http.websocket).
    refusing = WebSocketRefusal(quart_app, services.guard, error_body_for)
    observed = RequestObserver(HostCheck(refusing, services.guard), services.metrics)
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
