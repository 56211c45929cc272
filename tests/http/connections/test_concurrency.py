"""Several generations on one multiplexed worker (protocol v2), end to end over real
sockets on the real C++ fake worker: isolation of concurrent streams, cancelling one of
N, a crash with N in flight, admission limits, and bad requests that fail only themselves.

The fake worker without ``--script`` echoes the last 64 bytes of each prompt, so every
request's text depends only on its own prompt: concurrent requests must each get exactly
the text they get alone.
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio

from ..conftest import chat_body, live_server, parse_sse
from .test_cancellation import cancelled_ids, open_raw_request, read_until, wait_for

pytestmark = pytest.mark.usefixtures("no_leaks")


def stream_text(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or ""
                   for e in events if isinstance(e, dict) and e.get("choices"))


async def solo_texts(client: httpx.AsyncClient, prompts: list[str]) -> list[str]:
    texts = []
    for prompt in prompts:
        resp = await client.post("/v1/chat/completions", json=chat_body(prompt))
        assert resp.status_code == 200, resp.text
        texts.append(resp.json()["choices"][0]["message"]["content"])
    assert len(set(texts)) == len(texts), "the prompts must give distinct answers"
    return texts


async def test_concurrent_streams_each_get_exactly_their_solo_text(tmp_path):
    prompts = [f"request number {i}: " + chr(ord("a") + i) * 40 for i in range(6)]
    async with live_server(tmp_path, worker_args="--capacity 4 --token-delay-ms 3") as srv, \
            srv.client() as client:
        assert srv.pool.capacity == 4
        solo = await solo_texts(client, prompts)
        results: dict[int, str] = {}
        most_in_flight = 0

        async def one(i: int) -> None:
            resp = await client.post("/v1/chat/completions", json=chat_body(prompts[i], stream=True))
            events = parse_sse(resp.content)
            assert events[-1] == "[DONE]" and "error" not in events[-2]
            results[i] = stream_text(events)

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
            while len(results) < len(prompts):
                most_in_flight = max(most_in_flight, srv.pool.in_flight)
                await trio.sleep(0.002)
        assert [results[i] for i in range(len(prompts))] == solo
        assert most_in_flight >= 2, "the streams never overlapped"
        assert srv.pool.restarts == 0


async def test_cancel_one_of_n_leaves_the_others_intact(tmp_path):
    prompts = [f"stream {i} " + str(i) * 60 for i in range(3)]
    async with live_server(tmp_path, worker_args="--capacity 3 --token-delay-ms 25") as srv, \
            srv.client() as client:
        solo = await solo_texts(client, prompts)
        first_new_id = srv.pool.dispatched + 1
        pid = srv.pool.worker_pid
        results: dict[int, str] = {}

        async def keep(i: int) -> None:
            resp = await client.post("/v1/chat/completions", json=chat_body(prompts[i], stream=True))
            results[i] = stream_text(parse_sse(resp.content))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep, 0)
            leaving = await open_raw_request(srv, chat_body(prompts[1], stream=True))
            nursery.start_soon(keep, 2)
            await read_until(leaving, b'"content"')
            await wait_for(lambda: srv.pool.in_flight == 3)
            await leaving.aclose()
        assert results == {0: solo[0], 2: solo[2]}
        cancelled = cancelled_ids(srv)
        assert len(cancelled) == 1 and cancelled[0] >= first_new_id
        assert srv.pool.worker_pid == pid and srv.pool.restarts == 0


async def test_crash_with_n_in_flight_fails_all_then_the_server_recovers(tmp_path):
    async with live_server(tmp_path, script=["0123456789" * 6],
                           worker_args="--capacity 3 --token-delay-ms 20 --exit-after-tokens 30") as srv, \
            srv.client() as client:
        old_pid = srv.pool.worker_pid
        streams = [await open_raw_request(srv, chat_body(stream=True)) for _ in range(3)]
        for stream in streams:  # all three streaming before the worker dies
            await read_until(stream, b'"content"')
        for stream in streams:
            raw = await read_until(stream, b"data: [DONE]", timeout=15)  # chunked transfer coding
            await stream.aclose()
            error_at = raw.index(b'data: {"error":')
            assert b'"code":"worker_unavailable"' in raw[error_at:]
            assert raw.index(b"data: [DONE]") > error_at
        await srv.wait_state("ready", timeout=15)
        assert srv.pool.worker_pid != old_pid and srv.pool.restarts == 1
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
        assert resp.status_code == 200
        assert resp.json()["choices"][0]["message"]["content"] == "01234"


@pytest.mark.parametrize("queue_depth", [0, 1])
async def test_503_with_retry_after_when_slots_and_queue_are_full(tmp_path, queue_depth):
    capacity = 2
    async with live_server(tmp_path, script=["slow " * 20], queue_depth=queue_depth,
                           worker_args=f"--capacity {capacity} --token-delay-ms 20") as srv, \
            srv.client() as client:
        results: list[httpx.Response] = []

        async def one() -> None:
            results.append(await client.post("/v1/chat/completions", json=chat_body()))

        async with trio.open_nursery() as nursery:
            for _ in range(capacity + queue_depth):
                nursery.start_soon(one)
            await wait_for(lambda: srv.pool.in_flight == capacity
                           and srv.pool.queued == queue_depth)
            overflow = await client.post("/v1/chat/completions", json=chat_body())
        assert overflow.status_code == 503
        assert overflow.json()["error"]["code"] == "server_busy"
        assert int(overflow.headers["retry-after"]) >= 1
        assert sorted(r.status_code for r in results) == [200] * (capacity + queue_depth)


# -- a bad request fails only itself -------------------------------------------------------


async def assert_worker_untouched(srv, client: httpx.AsyncClient, pid: int) -> None:
    assert srv.pool.state == "ready" and not srv.pool.fatal.is_set()
    assert srv.pool.worker_pid == pid and srv.pool.restarts == 0
    resp = await client.post("/v1/chat/completions", json=chat_body("still serving"))
    assert resp.status_code == 200, resp.text


async def test_lone_surrogates_are_400_and_never_reach_the_worker(tmp_path):
    async with live_server(tmp_path) as srv, srv.client() as client:
        pid = srv.pool.worker_pid
        bodies = [chat_body("half a pair: \ud800"), chat_body("low \udc00 first"),
                  chat_body("fine", stop=["\ud83d"])]
        for _ in range(3):  # more than the crash-loop limit of the old behaviour
            for body in bodies:
                # json.dumps escapes the surrogate as "\ud800", as a JavaScript client would send it
                resp = await client.post("/v1/chat/completions", content=json.dumps(body),
                                         headers={"Content-Type": "application/json"})
                assert resp.status_code == 400, resp.text
                err = resp.json()["error"]
                assert err["type"] == "invalid_request_error" and err["code"] == "invalid_value"
                assert err["param"].startswith(("messages", "stop"))
        assert srv.pool.dispatched == 0
        await assert_worker_untouched(srv, client, pid)


async def test_prompt_longer_than_the_workers_line_limit_is_413_and_fails_only_itself(tmp_path):
    async with live_server(tmp_path, max_body_bytes=64 * 1024 * 1024,
                           worker_args="--capacity 2 --token-delay-ms 5") as srv, srv.client(timeout=60) as client:
        pid = srv.pool.worker_pid
        limit = srv.pool.client.max_line_bytes
        # A stream in flight meanwhile must be untouched.
        solo = (await solo_texts(client, ["bystander " * 10]))[0]
        async with trio.open_nursery() as nursery:
            bystander: list[str] = []

            async def watch() -> None:
                resp = await client.post("/v1/chat/completions", json=chat_body("bystander " * 10, stream=True))
                bystander.append(stream_text(parse_sse(resp.content)))

            nursery.start_soon(watch)
            await wait_for(lambda: srv.pool.in_flight == 1)
            huge = chat_body("x" * (limit + 1))
            for _ in range(5):
                resp = await client.post("/v1/chat/completions", json=huge)
                assert resp.status_code == 413, resp.text[:300]
                assert resp.json()["error"]["code"] == "request_too_large"
        assert bystander == [solo]
        await assert_worker_untouched(srv, client, pid)
