"""Soak: hundreds of concurrent requests, a third of them abandoned at random points
(queued, prefilling, mid-stream, mid non-stream). Every request that was not abandoned
must get exactly one of the scripted outputs, nothing may leak (processes, fds), and the
worker must never need a restart."""

from __future__ import annotations

import json
import random

import pytest
import trio

from .conftest import chat_body, live_server, parse_sse
from .test_cancellation import open_raw_request, read_until

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
