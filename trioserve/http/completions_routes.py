"""HTTP routes of the legacy and helper endpoints (spec/README.md §15): ``POST
/v1/completions``, ``POST /tokenize`` and ``POST /detokenize``."""

from __future__ import annotations

from typing import Any, Callable

from quart import Response, request
from quart_trio import QuartTrio

from trioserve.http.route_support import arriving_request, event_stream, json_response
from trioserve.api.completions.adapter import ServingCompletions, new_completion_id

__all__ = ["register"]


def register(app: QuartTrio, serving: ServingCompletions, runtime: Any,
             call_at_request_end: Callable[[Callable[[], None]], None]) -> None:
    """The routes over ``serving``; ``runtime`` marks arrivals (``arrival()``)."""

    @app.post("/v1/completions")
    async def completions() -> Response:
        completion_id = new_completion_id()
        async with arriving_request(runtime, completion_id) as (body, arrival):
            result = await serving.create(body, completion_id=completion_id,
                                          headers=request.headers, arrival=arrival)
        if isinstance(result, dict):
            return json_response(result)
        return event_stream(result.body, result.cancel, call_at_request_end)

    @app.post("/tokenize")
    async def tokenize() -> Response:
        return json_response(await serving.tokenize(await request.get_data(cache=False),
                                                    client=request.remote_addr or ""))

    @app.post("/detokenize")
    async def detokenize() -> Response:
        return json_response(await serving.detokenize(await request.get_data(cache=False),
                                                      client=request.remote_addr or ""))
