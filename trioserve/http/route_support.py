"""What every generating API route shares: how a request arrives, and the two shapes it is
answered with (a JSON body, or an event stream).

Shared by the chat, Responses, Messages and legacy routes so that the request's naming, its
arrival mark, the headers an event stream needs (no caching, no proxy buffering) and its
cancellation hook are each written once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Mapping

from quart import Response, request

from trioserve.http.access_log import current_request
from trioserve.http.guard import json_bytes
from trioserve.http.model_routing import leased_model, model_for
from trioserve.http.services import ModelServices, Services
from trioserve.worker.runtime import Arrival

__all__ = ["arriving_request", "json_response", "event_stream"]

RequestEnd = Callable[[Callable[[], None]], None]


@asynccontextmanager
async def arriving_request(services: Services, route: str, request_id: str,
                           call_at_request_end: RequestEnd) -> AsyncIterator[tuple[ModelServices, bytes, Arrival]]:
    """Name the current request ``request_id`` (its ``x-request-id`` and log lines use it),
    read its body, pick and lease the model that serves it on ``route`` (model_routing.py;
    held until the HTTP request ends) and yield ``(model, body, arrival)``. The arrival mark
    (the model's worker pool's ``arrival()``) lasts until the block ends, so the block submits
    the generation while it holds: requests of a burst reach the worker together.

    Raises:
        APIError: 404 ``model_not_found`` for a ``model`` no served model answers.
    """
    info = current_request()
    if info is not None:
        info.request_id = request_id
    body = await request.get_data(cache=False)
    model_id = await model_for(services, body, route)
    async with leased_model(services, model_id, call_at_request_end) as model:
        with model.pool.arrival() as arrival:
            yield model, body, arrival


def json_response(body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json_bytes(body), content_type="application/json", headers=dict(headers or {}))


def event_stream(body: AsyncIterator[bytes], cancel: Callable[[], None],
                 call_at_request_end: Callable[[Callable[[], None]], None],
                 headers: Mapping[str, str] | None = None) -> Response:
    """An SSE response over ``body``. ``cancel`` (synchronous, idempotent) runs when the
    request ends, whether or not the body was iterated, so a client that disconnects at any
    point frees its generation."""
    call_at_request_end(cancel)
    resp = Response(body, content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
    resp.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long streams
    return resp
