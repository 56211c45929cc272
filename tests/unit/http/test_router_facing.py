"""RouterFacing (trioserve/http/router_facing.py) on scripted ASGI apps under Trio's MockClock:
instance and worker headers, X-Accel-Buffering on event streams, keep-alive comments exactly
when a started stream has been silent, never on other responses, never after the end."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import trio

from trioserve.http.router_facing import KEEPALIVE_COMMENT, RouterFacing, serving_info

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
         "server": ("127.0.0.1", 8123), "headers": []}


def scripted_app(content_type: bytes, steps: list[Any], extra_headers=()):
    """An ASGI app that starts a response, then for each step sends a body chunk (bytes) or
    sleeps (a number of seconds); the last chunk ends the body."""

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), *extra_headers]})
        for k, step in enumerate(steps):
            if isinstance(step, bytes):
                await send({"type": "http.response.body", "body": step,
                            "more_body": k < len(steps) - 1})
            else:
                await trio.sleep(step)

    return app


async def run(app, **options) -> list[tuple[float, dict]]:
    """Messages the server would send, each with the (mock) time it was sent at."""
    sent: list[tuple[float, dict]] = []
    start = trio.current_time()

    async def send(message):
        sent.append((trio.current_time() - start, message))

    async def receive():
        await trio.sleep_forever()

    await RouterFacing(app, **options)(dict(SCOPE), receive, send)
    return sent


def bodies(sent):
    return [(round(t, 3), m["body"]) for t, m in sent if m["type"] == "http.response.body"]


def headers(sent) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in sent[0][1]["headers"]:
        out.setdefault(name.lower(), []).append(value)
    return out


async def test_silent_event_stream_gets_keepalive_comments_between_events(autojump_clock):
    app = scripted_app(b"text/event-stream", [b"data: 1\n\n", 40, b"data: 2\n\n", 5, b"data: [DONE]\n\n"])
    sent = await run(app, keepalive=15)
    assert bodies(sent) == [(0, b"data: 1\n\n"), (15, KEEPALIVE_COMMENT), (30, KEEPALIVE_COMMENT),
                            (40, b"data: 2\n\n"), (45, b"data: [DONE]\n\n")]
    assert sent[-1][1]["more_body"] is False
    assert all(m.get("more_body") for _, m in sent[1:-1])  # a comment never ends the body


async def test_silence_counts_from_the_last_write(autojump_clock):
    """Events closer together than the interval need no comment."""
    app = scripted_app(b"text/event-stream", [b"a", 10, b"b", 10, b"c", 10, b"d"])
    assert [b for _, b in bodies(await run(app, keepalive=15))] == [b"a", b"b", b"c", b"d"]


async def test_no_keepalive_before_the_stream_starts_or_on_other_responses(autojump_clock):
    async def slow_start(scope, receive, send):
        await trio.sleep(100)  # prefill: nothing may be sent, not even headers
        await scripted_app(b"text/event-stream", [b"x"])(scope, receive, send)

    sent = await run(slow_start, keepalive=15)
    assert [round(t) for t, _ in sent] == [100, 100]
    json_app = scripted_app(b"application/json", [b"{", 100, b"}"])
    assert [b for _, b in bodies(await run(json_app, keepalive=15))] == [b"{", b"}"]


async def test_keepalive_zero_disables_comments(autojump_clock):
    app = scripted_app(b"text/event-stream", [b"a", 100, b"b"])
    assert [b for _, b in bodies(await run(app, keepalive=0))] == [b"a", b"b"]


async def test_event_streams_are_unbuffered_once(autojump_clock):
    sent = await run(scripted_app(b"text/event-stream; charset=utf-8", [b"x"]), keepalive=15)
    assert headers(sent)[b"x-accel-buffering"] == [b"no"]
    own = await run(scripted_app(b"text/event-stream", [b"x"], [(b"X-Accel-Buffering", b"no")]),
                    keepalive=15)
    assert headers(own)[b"x-accel-buffering"] == [b"no"]
    plain = await run(scripted_app(b"application/json", [b"{}"]), keepalive=15)
    assert b"x-accel-buffering" not in headers(plain)


async def test_instance_and_worker_headers(autojump_clock):
    sent = await run(scripted_app(b"application/json", [b"{}"]), instance_id="replica-a")
    assert headers(sent)[b"x-trioserve-instance"] == [b"replica-a"]
    assert headers(sent)[b"x-trioserve-worker"] == [b"0"]
    default = await run(scripted_app(b"application/json", [b"{}"]))
    assert headers(default)[b"x-trioserve-instance"] == [f"{socket.gethostname()}:8123".encode()]

    async def on_worker_1(scope, receive, send):
        serving_info().worker = 1  # what a route that picked worker 1 records
        await scripted_app(b"application/json", [b"{}"])(scope, receive, send)

    assert headers(await run(on_worker_1))[b"x-trioserve-worker"] == [b"1"]


async def test_app_failure_propagates_as_itself(autojump_clock):
    async def failing(scope, receive, send):
        await trio.sleep(1)
        raise KeyError("boom")

    with pytest.raises(KeyError):
        await run(failing, keepalive=15)


async def test_cancelled_request_stops_the_ticker(autojump_clock):
    app = scripted_app(b"text/event-stream", [b"a", 1000, b"b"])
    with trio.move_on_after(50) as scope:
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            await trio.sleep_forever()

        await RouterFacing(app, keepalive=15)(dict(SCOPE), receive, send)
    assert scope.cancelled_caught
    assert [m["body"] for m in sent[1:]] == [b"a"] + [KEEPALIVE_COMMENT] * 3


async def test_a_start_that_coincides_with_a_keepalive_tick_still_goes_first(autojump_clock):
    # The app starts its stream exactly when the ticker wakes. Whichever task the scheduler
    # runs first, no comment may precede the start: a real server refuses a body message
    # before it and cuts the stream (seen in CI as an incomplete chunked read). Trio orders
    # simultaneous wake-ups at random, so several rounds cover both orders.
    for _ in range(40):
        app = scripted_app(b"text/event-stream", [b"a", 1.0, b"b"])

        async def late_start(scope, receive, send, app=app):
            await trio.sleep(15)
            await app(scope, receive, send)

        sent = await run(late_start, keepalive=15)
        assert sent[0][1]["type"] == "http.response.start", sent[:2]
