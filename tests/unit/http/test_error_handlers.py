"""The HTTP error path never raises, whatever reached it (spec §3): outside an HTTP request
context (a WebSocket scope, a framework error before the request exists) it still answers with
the envelope."""

from __future__ import annotations

import json

import trio
from werkzeug.exceptions import HTTPException, NotFound

from trioserve import errors
from trioserve.config import Settings
from trioserve.http.application import _error_response, create_quart_app


def test_an_error_response_outside_a_request_context_is_the_envelope():
    resp = _error_response(errors.not_found())
    assert resp.status_code == 404 and resp.content_type == "application/json"
    body = json.loads(trio.run(resp.get_data))
    assert body["error"]["code"] == "not_found"


def test_the_registered_handlers_answer_outside_a_request_context():
    app = create_quart_app(Settings(engine="fake", worker_bin="/nonexistent"))

    async def handle(exc: Exception, kind: type) -> int:
        handler = app.error_handler_spec[None][None][kind]
        return (await handler(exc)).status_code

    assert trio.run(handle, NotFound(), HTTPException) == 404
    assert trio.run(handle, RuntimeError("boom"), Exception) == 500
