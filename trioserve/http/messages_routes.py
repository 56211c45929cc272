"""HTTP routes of the Anthropic Messages API (spec/README.md §16). ``?beta=true`` and the ``anthropic-version`` /
``anthropic-beta`` headers are accepted and need nothing (no beta changes what a local model
does); errors on these paths use Anthropic's envelope (``error_body``)."""

from __future__ import annotations

from typing import Any

from quart import Response, request
from quart_trio import QuartTrio

from trioserve import errors
from trioserve.http.route_support import RequestEnd, generating_route, tokenizer_route
from trioserve.http.services import Services
from trioserve.api.messages.wire import error_envelope, new_message_id

__all__ = ["register", "is_messages_path", "error_body"]

PREFIX = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether errors for ``path`` take Anthropic's envelope."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(exc: errors.APIError) -> dict[str, Any]:
    return error_envelope(exc)


def register(app: QuartTrio, services: Services, call_at_request_end: RequestEnd) -> None:
    @app.post(PREFIX)
    async def create_message() -> Response:
        return await generating_route(services, "messages", new_message_id(),
                                      lambda model: model.messages, call_at_request_end)

    @app.post(PREFIX + "/count_tokens")
    async def count_tokens() -> Response:
        return await tokenizer_route(services, "messages", lambda model, body: model.messages.count_tokens(
            body, headers=request.headers, client=request.remote_addr or ""))
