"""RequestObserver as an ASGI layer: request id header, access line, and the 500 envelope
when the app below fails before responding."""

import json
import logging

import pytest

from trioserve.http.access_log import RequestObserver, current_request


def scope(**kw):
    return {"type": "http", "method": "GET", "path": "/x", "headers": [], "client": ("1.2.3.4", 5), **kw}


async def run(app, **kw):
    sent = []

    async def send(message):
        sent.append(message)

    await RequestObserver(app)(scope(**kw), None, send)
    return sent


async def test_app_failing_before_a_response_gets_the_500_envelope(caplog):
    caplog.set_level(logging.INFO, logger="trioserve.access")

    async def broken(scope, receive, send):
        raise ValueError("framework trouble")

    sent = await run(broken)
    start, body = sent
    assert start["status"] == 500
    headers = dict(start["headers"])
    assert headers[b"content-type"] == b"application/json"
    request_id = headers[b"x-request-id"].decode()
    error = json.loads(body["body"])["error"]
    assert error["code"] == "internal_error" and request_id in error["message"]
    assert "framework trouble" not in error["message"]
    lines = [r.getMessage() for r in caplog.records if r.name == "trioserve.access"]
    assert len(lines) == 1 and '"GET /x" 500' in lines[0] and request_id in lines[0]


async def test_app_failing_after_the_response_started_is_reraised():
    async def half(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise ValueError("mid-body")

    with pytest.raises(ValueError):
        await run(half)


async def test_handler_may_replace_the_request_id_before_the_response_starts():
    async def app(scope, receive, send):
        current_request().request_id = "chatcmpl-abc"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"ok"})

    start, _ = await run(app)
    assert start["headers"] == [(b"a", b"b"), (b"x-request-id", b"chatcmpl-abc")]
    assert current_request() is None  # reset after the request
