"""The routes every server has: ``/health``, ``/metrics``, ``GET /v1/models``, Chat
Completions, Responses and ``DELETE /v1/sessions/{key}`` (spec/README.md §2, §12, §13); the
completions and Messages routes register from their own modules.

A handler only moves bytes: it names the request, reads its body, hands it to its API's
adapter and answers with a JSON body or an event stream (route_support.py). Cancellation: a
stream's ``cancel`` runs when the HTTP request ends, however it ends (``call_at_request_end``).
"""

from __future__ import annotations

from typing import Any, Callable

from quart import Response, request
from quart_trio import QuartTrio

from trioserve import errors
from trioserve.api.chat.adapter import new_completion_id
from trioserve.api.responses.adapter import JsonResponse, new_response_id
from trioserve.core.sessions import validate_session_key
from trioserve.http import completions_routes, messages_routes
from trioserve.http.guard import json_bytes
from trioserve.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trioserve.http.route_support import arriving_request, event_stream, json_response
from trioserve.http.services import Services
from trioserve.worker.runtime import GenerationError
from trioserve.worker.supervisor import public_reason

__all__ = ["register_routes", "context_window"]

RequestEnd = Callable[[Callable[[], None]], None]


def context_window(n_ctx: int) -> dict[str, Any]:
    """``/v1/models`` fields for the context window of one request (a slot's ``n_ctx``):
    ``context_length`` (OpenRouter/LM Studio/llama-server name) and ``max_model_len``
    (vLLM's). Empty while no worker was ready yet."""
    return {"context_length": n_ctx, "max_model_len": n_ctx} if n_ctx > 0 else {}


def register_routes(app: QuartTrio, services: Services, call_at_request_end: RequestEnd) -> None:
    """Every route of the server."""
    _register_operations(app, services)
    _register_chat_and_responses(app, services, call_at_request_end)
    completions_routes.register(app, services.completions, services.pool, call_at_request_end)
    messages_routes.register(app, services.messages, services.pool, call_at_request_end)


def _register_operations(app: QuartTrio, services: Services) -> None:
    pool = services.pool

    @app.get("/health")
    async def health() -> Response:
        # Public: status, a short reason and counters. The detailed reason (worker
        # messages, paths, pids) goes to the log only.
        state = pool.state
        body: dict[str, Any] = {"status": state}
        if state != "ready":
            body["reason"] = public_reason(pool)
            # The signal that killed the last worker, in words ("illegal instruction
            # (SIGILL)"): a fact about the CPU path, not a worker message.
            if pool.crash:
                body["crash"] = pool.crash
        body.update(model=services.model_id, queued=pool.queued, running=pool.in_flight,
                    restarts=pool.restarts)
        if len(pool.workers) > 1:  # one worker: the fields above are its own
            body["workers"] = pool.health()
        status = 200 if state == "ready" else 503
        return Response(json_bytes(body), status=status, content_type="application/json")

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(services.metrics.render(), content_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        entry: dict[str, Any] = {"id": services.model_id, "object": "model",
                                 "created": services.created, "owned_by": "trioserve"}
        capabilities = services.core.capabilities()  # spec §2, None while loading
        if capabilities is not None:
            entry["capabilities"] = capabilities
            if pool.kernel_path is not None:  # llama workers: the verified CPU path
                entry["capabilities"] = {**capabilities, "kernel_path": pool.kernel_path}
        entry.update(context_window(services.n_ctx))
        return json_response({"object": "list", "data": [entry]})

    @app.delete("/v1/sessions/<path:key>")
    async def delete_session(key: str) -> Response:
        validate_session_key(key, "session")
        services.core.replay.forget(key)  # its remembered turns go too (spec §12)
        try:
            found = await pool.close_session(key)
        except GenerationError as exc:
            if exc.code == "session_busy":
                raise errors.session_busy(key) from None
            raise errors.worker_unavailable(exc.message, 1) from None
        if not found:
            raise errors.session_not_found(key)
        return Response(b"", status=204)


def _register_chat_and_responses(app: QuartTrio, services: Services,
                                 call_at_request_end: RequestEnd) -> None:
    pool = services.pool

    @app.post("/v1/chat/completions")
    async def chat_completions() -> Response:
        completion_id = new_completion_id()
        async with arriving_request(pool, completion_id) as (body, arrival):
            result = await services.chat.create(body, completion_id=completion_id,
                                                headers=request.headers, arrival=arrival)
        if isinstance(result, dict):
            return json_response(result)
        return event_stream(result.body, result.cancel, call_at_request_end)

    @app.post("/v1/responses")
    async def create_response() -> Response:
        response_id = new_response_id()
        async with arriving_request(pool, response_id) as (body, arrival):
            result = await services.responses.create(body, response_id=response_id,
                                                     headers=request.headers, arrival=arrival)
        if isinstance(result, JsonResponse):
            return json_response(result.body, result.headers)
        return event_stream(result.body, result.cancel, call_at_request_end, result.headers)

    # Stored responses (spec §20.5): what the official SDK's retrieve, delete and
    # input_items.list call.
    @app.get("/v1/responses/<response_id>")
    async def retrieve_response(response_id: str) -> Response:
        return json_response(services.responses.retrieve(response_id, request.args))

    @app.delete("/v1/responses/<response_id>")
    async def delete_response(response_id: str) -> Response:
        return json_response(services.responses.delete(response_id))

    @app.get("/v1/responses/<response_id>/input_items")
    async def response_input_items(response_id: str) -> Response:
        return json_response(services.responses.input_items(response_id, request.args))
