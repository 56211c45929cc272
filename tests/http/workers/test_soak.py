"""Soak: hundreds of concurrent requests, a third of them abandoned at random points
(queued, prefilling, mid-stream, mid non-stream). Every request that was not abandoned
must get exactly one of the scripted outputs, nothing may leak (processes, fds), and the
worker must never need a restart."""

from __future__ import annotations

import json
import random

import pytest
import trio

from ..conftest import chat_body, live_server, parse_sse
from ..connections.test_cancellation import open_raw_request, read_until

pytestmark = pytest.mark.usefixtures("no_leaks")

SCRIPT = ["alpha — ünïcödé " * 8, "beta 日本語 " * 12, "gamma 🎉 " * 10, "delta plain text " * 6]
REQUESTS = 240
CONCURRENCY = 8


async def test_soak_random_disconnects(tmp_path):
    rng = random.Random(20261130)
    outcomes = {"ok": 0, "abandoned": 0}
    async with live_server(tmp_path, script=SCRIPT, queue_depth=64,
                           worker_args="--token-delay-ms 0.2 --prefill-ms-per-token 0.01") as srv, \
            srv.client() as client:

        async def one(i: int) -> None:
            stream = rng.random() < 0.5
            if rng.random() < 0.35:
                sock = await open_raw_request(srv, chat_body(f"request {i}", stream=True))
                if rng.random() < 0.5:
                    await read_until(sock, b'"content"', timeout=60)  # mid-stream
                    await trio.sleep(rng.uniform(0, 0.01))
                else:
                    await trio.sleep(rng.uniform(0, 0.03))  # queued, prefilling or decoding
                await sock.aclose()
                outcomes["abandoned"] += 1
                return
            resp = await client.post("/v1/chat/completions", json=chat_body(f"request {i}", stream=stream))
            assert resp.status_code == 200, resp.text
            if stream:
                events = parse_sse(resp.content)
                assert events[-1] == "[DONE]"
                text = "".join(c["choices"][0]["delta"].get("content") or ""
                               for c in events[:-1] if c["choices"])
                reason = [c["choices"][0]["finish_reason"] for c in events[:-1]
                          if c["choices"] and c["choices"][0]["finish_reason"]]
            else:
                body = resp.json()
                text, reason = body["choices"][0]["message"]["content"], [body["choices"][0]["finish_reason"]]
            assert text in SCRIPT, f"request {i} got a corrupted output: {text!r}"
            assert reason == ["stop"]
            outcomes["ok"] += 1

        limiter = trio.CapacityLimiter(CONCURRENCY)

        async def limited(i: int) -> None:
            async with limiter:
                await one(i)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(REQUESTS):
                    nursery.start_soon(limited, i)
            while srv.pool.busy or srv.pool.queued:
                await trio.sleep(0.01)
        assert srv.pool.restarts == 0 and srv.pool.state == "ready"
        cancelled = sum(1 for r in srv.pool.history if r.get("cancelled"))
        print(json.dumps(outcomes | {"cancelled_in_worker": cancelled,
                                     "dispatched": srv.pool.dispatched}))
    assert outcomes["ok"] + outcomes["abandoned"] == REQUESTS
    assert outcomes["abandoned"] > 50
    assert cancelled > 10  # a fair share of abandons happened while the worker was generating


def _route_request(rng: random.Random, i: int) -> tuple[str, str, dict | None, bool]:
    """(method, path, body, streamed) of one request to a random endpoint."""
    stream = rng.random() < 0.5
    text = f"request {i}"
    choices: list[tuple[str, str, dict | None, bool]] = [
        ("POST", "/v1/chat/completions", chat_body(text, stream=stream), stream),
        ("POST", "/v1/responses", {"model": "fake", "input": text, "stream": stream,
                                   "store": rng.random() < 0.5}, stream),
        ("POST", "/v1/messages", {"model": "fake", "max_tokens": 64, "stream": stream,
                                  "messages": [{"role": "user", "content": text}]}, stream),
        ("POST", "/v1/messages/count_tokens", {"model": "fake",
                                               "messages": [{"role": "user", "content": text}]}, False),
        ("POST", "/v1/completions", {"model": "fake", "prompt": text, "stream": stream,
                                     "max_tokens": 64}, stream),
        ("POST", "/tokenize", {"content": text}, False),
        ("POST", "/detokenize", {"tokens": [104, 105]}, False),
        ("GET", "/v1/models", None, False),
        ("GET", "/health", None, False),
    ]
    return rng.choice(choices)


async def test_soak_every_endpoint_with_abandoned_requests(tmp_path):
    """Every endpoint in one soak, 30 % of the requests abandoned at random points: every
    request kept gets a 200, the worker never restarts, the same worker serves at the end and
    no fd is left open (``no_leaks``). Short enough for CI (150 requests)."""
    rng = random.Random(20261202)
    outcomes = {"ok": 0, "abandoned": 0}
    statuses: dict[str, int] = {}
    async with live_server(tmp_path, script=SCRIPT, queue_depth=64,
                           worker_args="--token-delay-ms 0.2 --prefill-ms-per-token 0.01") as srv, \
            srv.client() as client:
        pid = srv.pool.worker_pid

        async def one(i: int) -> None:
            method, path, body, stream = _route_request(rng, i)
            if rng.random() < 0.3:
                payload = json.dumps(body).encode() if body is not None else b""
                sock = await trio.open_tcp_stream("127.0.0.1", srv.port)
                head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                if body is not None:
                    head += f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
                data = head.encode() + b"\r\n" + payload
                cut = rng.choice([len(data) // 2, len(data), len(data)])  # mid-body or whole
                await sock.send_all(data[:cut])
                if cut == len(data) and rng.random() < 0.5:
                    with trio.move_on_after(5):
                        await sock.receive_some(1)  # the answer started, then gone
                else:
                    await trio.sleep(rng.uniform(0, 0.02))
                await sock.aclose()
                outcomes["abandoned"] += 1
                return
            resp = await client.request(method, path, json=body)
            statuses[path] = statuses.get(path, 0) + 1
            assert resp.status_code == 200, (path, resp.status_code, resp.text[:300])
            if stream:
                text = resp.text.rstrip()
                last_event = text.rsplit("event: ", 1)[-1].split("\n", 1)[0]
                assert (text.endswith("data: [DONE]")
                        or last_event in ("response.completed", "message_stop")), (path, text[-300:])
            outcomes["ok"] += 1

        limiter = trio.CapacityLimiter(CONCURRENCY)

        async def limited(i: int) -> None:
            async with limiter:
                await one(i)

        with trio.fail_after(120):
            async with trio.open_nursery() as nursery:
                for i in range(150):
                    nursery.start_soon(limited, i)
            while srv.pool.busy or srv.pool.queued:
                await trio.sleep(0.01)
        assert srv.pool.restarts == 0 and srv.pool.state == "ready"
        assert srv.pool.worker_pid == pid
        resp = await client.post("/v1/chat/completions", json=chat_body("after the soak"))
        assert resp.status_code == 200
        print(json.dumps(outcomes | {"statuses": statuses}))
    assert outcomes["ok"] + outcomes["abandoned"] == 150
    assert outcomes["abandoned"] > 25 and len(statuses) >= 8
