"""HTTP routes of the legacy and helper endpoints (spec/README.md §15): ``POST
/v1/completions``, ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Callable

from quart import Response, request
from quart_trio import QuartTrio

from trioserve.http.model_routing import leased_model, model_for
from trioserve.http.route_support import arriving_request, event_stream, json_response, read_body
from trioserve.http.services import Services
from trioserve.api.completions.adapter import new_completion_id

__all__ = ["register"]


def register(app: QuartTrio, services: Services,
             call_at_request_end: Callable[[Callable[[], None]], None]) -> None:
    """The routes; each goes to the model its body's ``model`` names (``/tokenize`` and
    ``/detokenize`` without one: the default model)."""

    @app.post("/v1/completions")
    async def completions() -> Response:
        completion_id = new_completion_id()
        async with arriving_request(services, "completions", completion_id,
                                    call_at_request_end) as (model, body, arrival):
            result = await model.completions.create(body, completion_id=completion_id,
                                                    headers=request.headers, arrival=arrival)
        if isinstance(result, dict):
            return json_response(result)
        return event_stream(result.body, result.cancel, call_at_request_end)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        body = await read_body()
        async with leased_model(services, await model_for(services, body, "tokenize")) as model:
            return json_response(await model.completions.tokenize(
                body, client=request.remote_addr or ""))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        body = await read_body()
        async with leased_model(services, await model_for(services, body, "tokenize")) as model:
            return json_response(await model.completions.detokenize(
                body, client=request.remote_addr or ""))
