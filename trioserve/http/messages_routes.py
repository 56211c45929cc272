"""HTTP routes of the Anthropic Messages API (spec/README.md §16). ``?beta=true`` and the ``anthropic-version`` /
``anthropic-beta`` headers are accepted and need nothing (no beta changes what a local model
does); errors on these paths use Anthropic's envelope (``error_body``)."""

from __future__ import annotations

from typing import Any, Callable

from quart import Response, request
from quart_trio import QuartTrio

from trioserve import errors
from trioserve.api.answers import JsonResponse
from trioserve.http.route_support import arriving_request, event_stream, json_response, read_body
from trioserve.http.model_routing import leased_model, model_for
from trioserve.http.services import Services
from trioserve.api.messages.wire import error_envelope, new_message_id

__all__ = ["register", "is_messages_path", "error_body"]

PREFIX = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether errors for ``path`` take Anthropic's envelope."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(exc: errors.APIError) -> dict[str, Any]:
    return error_envelope(exc)


def register(app: QuartTrio, services: Services,
             call_at_request_end: Callable[[Callable[[], None]], None]) -> None:
    @app.post(PREFIX)
    async def create_message() -> Response:
        message_id = new_message_id()
        async with arriving_request(services, "messages", message_id,
                                    call_at_request_end) as (model, body, arrival):
            result = await model.messages.create(body, message_id=message_id,
                                                 headers=request.headers, arrival=arrival)
        if isinstance(result, JsonResponse):
            return json_response(result.body, result.headers)
        return event_stream(result.body, result.cancel, call_at_request_end, result.headers)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens() -> Response:
        body = await read_body()
        async with leased_model(services, await model_for(services, body, "messages")) as model:
            return json_response(await model.messages.count_tokens(
                body, headers=request.headers, client=request.remote_addr or ""))
