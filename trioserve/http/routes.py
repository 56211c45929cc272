"""The routes every server has: ``/health``, ``/metrics``, ``GET /v1/models`` (and
``/v1/models/{id}``), Chat Completions, Responses and ``DELETE /v1/sessions/{key}``
(spec/README.md §2, §2.1, §12, §13); the completions and Messages routes register from their
own modules.

A handler only moves bytes: it names the request, reads its body, leases the model its
``model`` names (model_routing.py), hands the body to that model's adapter and answers with a
JSON body or an event stream (route_support.py ``generating_route``). Cancellation: a
stream's ``cancel`` runs when the HTTP request ends, however it ends (``call_at_request_end``).
"""

from __future__ import annotations

from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from trioserve import errors
from trioserve.api.chat.adapter import new_completion_id
from trioserve.api.responses.adapter import new_response_id
from trioserve.core.sessions import validate_session_key
from trioserve.http import completions_routes, messages_routes
from trioserve.http.guard import json_bytes
from trioserve.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trioserve.http.model_routing import describe, stored_response_model
from trioserve.http.route_support import RequestEnd, generating_route, json_response
from trioserve.http.host import ModelServices
from trioserve.http.services import Services
from trioserve.worker.runtime import GenerationError
from trioserve.worker.supervisor import public_reason

__all__ = ["register_routes"]

def register_routes(app: QuartTrio, services: Services, call_at_request_end: RequestEnd) -> None:
    """Every route of the server."""
    _register_operations(app, services)
    _register_models(app, services)
    _register_chat_and_responses(app, services, call_at_request_end)
    completions_routes.register(app, services, call_at_request_end)
    messages_routes.register(app, services, call_at_request_end)


def _model_health(model: ModelServices) -> tuple[str, dict[str, Any]]:
    """One model's ``/health`` state and fields: status, a short reason and counters. The
    detailed reason (worker messages, paths, pids) goes to the log only."""
    pool = model.pool
    state = pool.state
    body: dict[str, Any] = {"status": state}
    if state != "ready":
        body["reason"] = public_reason(pool)
        # The signal that killed the last worker, in words ("illegal instruction
        # (SIGILL)"): a fact about the CPU path, not a worker message.
        if pool.crash:
            body["crash"] = pool.crash
    body.update(model=model.model_id, queued=pool.queued, running=pool.in_flight,
                restarts=pool.restarts)
    if len(pool.workers) > 1:  # one worker: the fields above are its own
        body["workers"] = pool.health()
    return state, body


def _health(services: Services) -> tuple[str, dict[str, Any]]:
    """``/health`` (spec §13). One model: its own fields, as always. Several: ready (200)
    while every pinned model is (models loaded on demand come and go; a model loading for a
    request must not take the server out of a load balancer); every model under ``models``
    with its lifecycle ``state`` (spec §14.5) and, while its workers run or after they gave
    up, their fields."""
    host = services.host
    if len(services.registry.specs) == 1:
        return _model_health(services.default)
    # Models whose workers run or start, and those whose last workers gave up (their reason
    # and crash say why they are not loaded).
    shown = host.loaded() + [host.services(i) for i in services.registry.ids
                             if host.state(i) == "not_loaded" and host.services(i).pool.fatal.is_set()]
    running = {model.model_id: _model_health(model) for model in shown}
    pinned = [running.get(i, ("unavailable", {})) for i in services.registry.ids if host.pinned(i)]
    state = next((s for s, _ in pinned if s != "ready"), "ready")
    entries = []
    for model_id in services.registry.ids:
        fields = running[model_id][1] if model_id in running else {"model": model_id}
        entries.append({**fields, "state": host.state(model_id)})
    return state, {"status": state, "models": entries}


def _register_operations(app: QuartTrio, services: Services) -> None:
    @app.get("/health")
    async def health() -> Response:
        state, body = _health(services)
        status = 200 if state == "ready" else 503
        return Response(json_bytes(body), status=status, content_type="application/json")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(services.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.delete("/v1/sessions/<path:key>")
    async def delete_session(key: str) -> Response:
        # Sessions are per model: the key is closed on every loaded model that holds it.
        validate_session_key(key, "session")
        found = False
        for model in services.host.loaded():
            # Every branch of the key (spec §12), with its remembered turns.
            for name in model.core.branches.table.names(key):
                model.core.replay.forget(name)
                try:
                    found = await model.pool.close_session(name) or found
                except GenerationError as exc:
                    if exc.code == "session_busy":
                        raise errors.session_busy(key) from None
                    raise errors.worker_unavailable(exc.message, 1) from None
            model.core.branches.forget(key)
        if not found:
            raise errors.session_not_found(key)
        return Response(b"", status=204)


def _register_models(app: QuartTrio, services: Services) -> None:
    """``GET /v1/models``: every served model with its state (spec §2.1); ``GET
    /v1/models/{id}``: one, by id."""
    def entry(model_id: str) -> dict[str, Any]:
        loaded = services.host.state(model_id) != "not_loaded"
        return describe(services, services.host.services(model_id) if loaded else None, model_id)

    @app.get("/v1/models")
    async def models() -> Response:
        return json_response({"object": "list", "data": [entry(i) for i in services.registry.ids]})

    @app.get("/v1/models/<path:model_id>")
    async def model(model_id: str) -> Response:
        if services.registry.get(model_id) is None:
            raise errors.model_not_found(model_id, services.registry.ids)
        return json_response(entry(model_id))

    # Admin (spec §14.5): behind the API key like every route but /health; a POST, so a JSON
    # content type like every POST (which also keeps browsers' forms from reaching it).
    @app.post("/v1/models/<path:model_id>/load")
    async def load_model(model_id: str) -> Response:
        return json_response(admin_answer(model_id, await services.host.load(known(model_id))))

    @app.post("/v1/models/<path:model_id>/unload")
    async def unload_model(model_id: str) -> Response:
        return json_response(admin_answer(model_id, await services.host.unload(known(model_id))))

    def known(model_id: str) -> str:
        if services.registry.get(model_id) is None:
            raise errors.model_not_found(model_id, services.registry.ids)
        return model_id

    def admin_answer(model_id: str, state: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "state": state}


def _register_chat_and_responses(app: QuartTrio, services: Services,
                                 call_at_request_end: RequestEnd) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        return await generating_route(services, "chat", new_completion_id(),
                                      lambda model: model.chat, call_at_request_end)

    @app.post("/v1/responses")
    async def create_response() -> Response:
        return await generating_route(services, "responses", new_response_id(),
                                      lambda model: model.responses, call_at_request_end)

    # Stored responses (spec §20.5): what the official SDK's retrieve, delete and
    # input_items.list call. Each model keeps its own; the one holding the id answers.
    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str) -> Response:
        model = stored_response_model(services, response_id)
        return json_response(model.responses.retrieve(response_id, request.args))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        model = stored_response_model(services, response_id)
        return json_response(model.responses.delete(response_id))

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        model = stored_response_model(services, response_id)
        return json_response(model.responses.input_items(response_id, request.args))
