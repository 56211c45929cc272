"""What routers in front of trioserve rely on, over real HTTP on the fake worker (spec §12,
§17.3; docs/deployment.md): the router's session header as the weakest session key, the
instance/worker headers, and unbuffered event streams with keep-alive comments on every
streaming API."""

from __future__ import annotations

import pytest

from ..conftest import live_server, parse_sse

pytestmark = pytest.mark.usefixtures("no_leaks")

HISTORY = [{"role": "user", "content": "Give me the list."}]


def chat(**extra):
    return {"model": "fake", "messages": HISTORY, **extra}


async def held(client, key: str) -> bool:
    """Whether the server holds session ``key`` (DELETE answers 204, else 404); frees it."""
    resp = await client.delete(f"/v1/sessions/{key}")
    assert resp.status_code in (204, 404), resp.text
    return resp.status_code == 204


@pytest.mark.parametrize("headers, winner", [
    ({"X-SMG-Routing-Key": "R"}, "R"),
    ({"x-session-id": "D", "X-SMG-Routing-Key": "R"}, "D"),
    ({"x-session-affinity": "B", "X-SMG-Routing-Key": "R"}, "B"),
])
async def test_router_routing_key_is_the_weakest_session_key(tmp_path, headers, winner):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat(), headers=headers)
        assert resp.status_code == 200, resp.text
        assert {k: await held(client, k) for k in "RDB"} == {k: k == winner for k in "RDB"}
        # The API's own session header (Claude Code's) comes before the router's too.
        resp = await client.post("/v1/messages", headers={"X-SMG-Routing-Key": "R",
                                                          "x-claude-code-session-id": "C"},
                                 json={"model": "fake", "max_tokens": 8, "messages": HISTORY})
        assert resp.status_code == 200, resp.text
        assert (await held(client, "C"), await held(client, "R")) == (True, False)


async def test_bad_router_routing_key_is_invalid_value(tmp_path):
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=chat(),
                                 headers={"X-SMG-Routing-Key": "a\tb"})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert (error["code"], error["param"]) == ("invalid_value", "x-smg-routing-key")


async def test_every_response_names_its_instance_and_worker(tmp_path):
    async with live_server(tmp_path, script=["ok"], instance_id="replica-7") as srv, \
            srv.client() as client:
        for resp in (await client.get("/health"), await client.get("/nowhere"),
                     await client.post("/v1/chat/completions", json=chat())):
            assert resp.headers["x-trioserve-instance"] == "replica-7"
            assert resp.headers["x-trioserve-worker"] == "0"
    async with live_server(tmp_path, script=["ok"]) as srv, srv.client() as client:
        resp = await client.get("/health")
        assert resp.headers["x-trioserve-instance"].endswith(f":{srv.port}")


STREAMS = [
    ("/v1/chat/completions", chat(stream=True)),
    ("/v1/completions", {"model": "fake", "prompt": "Give me", "max_tokens": 8, "stream": True}),
    ("/v1/messages", {"model": "fake", "max_tokens": 8, "messages": HISTORY, "stream": True}),
]


async def test_slow_streams_are_unbuffered_and_kept_alive_on_every_api(tmp_path):
    """Three tokens 0.3 s apart with a 0.05 s keep-alive: comments between the events, each
    a whole SSE block, and the events themselves unchanged."""
    async with live_server(tmp_path, script=["abc"], sse_keepalive=0.05,
                           worker_args="--token-delay-ms 300") as srv, srv.client() as client:
        for path, body in STREAMS:
            async with client.stream("POST", path, json=body) as resp:
                assert resp.status_code == 200
                assert resp.headers["x-accel-buffering"] == "no"
                assert resp.headers["content-type"].startswith("text/event-stream")
                raw = await resp.aread()
            blocks = raw.split(b"\n\n")
            assert b": keep-alive" in blocks, (path, raw[:300])
            data = b"\n\n".join(b for b in blocks if b != b": keep-alive")
            if path != "/v1/messages":  # Anthropic's stream has event: lines too
                events = parse_sse(data)
                assert events[-1] == "[DONE]"
            else:
                assert b"event: message_stop" in data
