"""HTTP routes of the legacy and helper endpoints (spec/README.md §15): ``POST
/v1/completions``, ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from quart import Response, request
from quart_trio import QuartTrio

from trioserve.http.route_support import RequestEnd, generating_route, tokenizer_route
from trioserve.http.services import Services
from trioserve.api.completions.adapter import new_completion_id

__all__ = ["register"]


def register(app: QuartTrio, services: Services, call_at_request_end: RequestEnd) -> None:
    """The routes; each goes to the model its body's ``model`` names (``/tokenize`` and
    ``/detokenize`` without one: the default model)."""

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await generating_route(services, "completions", new_completion_id(),
                                      lambda model: model.completions, call_at_request_end)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return await tokenizer_route(services, "tokenize", lambda model, body: model.completions.tokenize(
            body, client=request.remote_addr or ""))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return await tokenizer_route(services, "tokenize", lambda model, body: model.completions.detokenize(
            body, client=request.remote_addr or ""))
