"""What every generating API route shares: how a request arrives, and the two shapes it is
answered with (a JSON body, or an event stream).

The chat, Responses, Messages and legacy completions routes are each one call of
:func:`generating_route`, so that the request's naming, its arrival mark, the model lease,
the headers an event stream needs (no caching, no proxy buffering) and its cancellation hook
are each written once.
"""

from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

import trio
from quart import Response, current_app, request
from werkzeug.exceptions import RequestEntityTooLarge

from trioserve import errors
from trioserve.api.answers import Answer, GeneratingAPI, JsonResponse
from trioserve.http import connection
from trioserve.http.access_log import current_request
from trioserve.http.guard import json_bytes
from trioserve.http.model_routing import leased_model, model_for
from trioserve.http.host import ModelServices
from trioserve.http.services import Services
from trioserve.worker.runtime import Arrival

__all__ = ["answer", "arriving_request", "event_stream", "generating_route", "json_response", "read_body",
           "tokenizer_route"]

RequestEnd = Callable[[Callable[[], None]], None]


async def generating_route(services: Services, route: str, request_id: str,
                           api: Callable[[ModelServices], GeneratingAPI],
                           call_at_request_end: RequestEnd) -> Response:
    """One generating request on ``route`` (``chat``, ``responses``, ``messages``,
    ``completions``: model_routing.py): the request named ``request_id`` arrives
    (:func:`arriving_request`), the leased model's ``api(model)`` serves its body, and the
    answer is written (:func:`answer`). Raises APIError for every failure known before the
    first byte; a stream's ``cancel`` runs when the HTTP request ends, however it ends."""
    async with arriving_request(services, route, request_id,
                                call_at_request_end) as (model, body, arrival):
        result = await api(model).create(body, request_id=request_id, headers=request.headers,
                                         arrival=arrival)
    return answer(result, call_at_request_end)


async def tokenizer_route(services: Services, route: str,
                          call: Callable[[ModelServices, bytes], Awaitable[dict[str, Any]]]) -> Response:
    """A request that asks the model's tokenizer and generates nothing (``/tokenize``,
    ``/detokenize``, ``/v1/messages/count_tokens``): read the body, lease the model its
    ``model`` names on ``route`` for the call, answer ``call(model, body)`` as JSON."""
    body = await read_body()
    async with leased_model(services, await model_for(services, body, route)) as model:
        return json_response(await call(model, body))


def answer(result: Answer, call_at_request_end: RequestEnd) -> Response:
    """An adapter's answer as the HTTP response: a JSON body, or an event stream whose
    ``cancel`` runs at request end."""
    if isinstance(result, JsonResponse):
        return json_response(result.body, result.headers)
    return event_stream(result.body, result.cancel, call_at_request_end, result.headers)


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
    body = await read_body()
    model_id = await model_for(services, body, route)
    async with leased_model(services, model_id, call_at_request_end) as model:
        with model.pool.arrival() as arrival:
            yield model, body, arrival


async def read_body() -> bytes:
    """The current request's whole body, which must arrive at the connection's minimum rate:
    by ``REQUEST_GRACE_S + bytes_so_far / MIN_RECEIVE_RATE`` seconds after this call
    (connection.py). A large body sent at a normal speed is never cut; one trickled in is,
    after the grace. Over HTTP/1.1 the connection enforces the same rule; over HTTP/2 (many
    requests on one connection) this is the only one. It replaces Quart's fixed
    ``BODY_TIMEOUT``, which cut any body still arriving after 60 s, at whatever rate.

    Raises:
        APIError: 408 ``request_timeout`` for a body that falls behind.
        RequestEntityTooLarge: the body exceeds ``MAX_CONTENT_LENGTH`` (answered 413).
    """
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    started = trio.current_time()
    body = bytearray()
    # Read chunk by chunk: the deadline moves with each chunk. Quart's own size check then
    # sees one chunk at a time, so the total is checked here.
    chunks = request.body.__aiter__()
    while True:
        deadline = started + connection.REQUEST_GRACE_S + len(body) / connection.MIN_RECEIVE_RATE
        with trio.move_on_at(deadline) as waiting:
            try:
                chunk = await chunks.__anext__()
            except StopAsyncIteration:
                return bytes(body)
        if waiting.cancelled_caught:
            raise errors.request_timeout(len(body), trio.current_time() - started)
        body += chunk
        if limit is not None and len(body) > limit:
            raise RequestEntityTooLarge()


def json_response(body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(json_bytes(body), content_type="application/json", headers=dict(headers or {}))


def event_stream(body: AsyncIterator[bytes], cancel: Callable[[], None],
                 call_at_request_end: RequestEnd,
                 headers: Mapping[str, str] | None = None) -> Response:
    """An SSE response over ``body``. ``cancel`` (synchronous, idempotent) runs when the
    request ends, whether or not the body was iterated, so a client that disconnects at any
    point frees its generation."""
    call_at_request_end(cancel)
    resp = Response(body, content_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
    resp.timeout = None  # Quart's RESPONSE_TIMEOUT would cut long streams
    return resp
