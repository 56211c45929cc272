"""``--workers 2`` on the real embedded model (SmolLM2-135M-Instruct through llama.cpp), one
thread each: a keyed 8-turn conversation stays on its key's worker and reuses its KV state
there, and two sessions on the two workers decode at the same time. One server for both
(two model loads are the expensive part on CI's 2 cores)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trioserve.worker.routing import key_order

from ..conftest import live_server
from ..sessions.test_sessions_real_model import llama_worker, reused_fractions
from .test_worker_pool import all_ready, keys_for, metric

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

MODEL = "SmolLM2-135M-Instruct"
QUESTIONS = ["Name a fruit.", "What colour is it?", "Where does it grow?", "Is it sweet?",
             "Name another fruit.", "What colour is that one?", "Which of the two is larger?",
             "Thank you. Say goodbye."]


async def converse(client, key: str) -> tuple[list[dict[str, Any]], set[str]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Answer in one short sentence."}]
    usages, workers = [], set()
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        resp = await client.post("/v1/chat/completions", headers={"x-session-id": key}, json={
            "model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 24})
        assert resp.status_code == 200, resp.text
        workers.add(resp.headers["x-trioserve-worker"])
        data = resp.json()
        usages.append(data["usage"])
        messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
    return usages, workers


async def stream_story(client, key: str, first: trio.Event, texts: dict[str, str]) -> None:
    body = {"model": MODEL, "stream": True, "temperature": 0, "max_tokens": 160,
            "messages": [{"role": "user", "content": "Tell me a very long story about a "
                          f"lighthouse keeper ({key})."}]}
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"x-session-id": key}) as resp:
        assert resp.status_code == 200
        text = ""
        async for line in resp.aiter_lines():
            if '"content":"' in line and not first.is_set():
                first.set()
            text += line
        texts[key] = text


async def test_two_workers_keep_sessions_and_decode_concurrently(tmp_path, capsys):
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), workers=2,
                           threads=1, max_context=2048, wait_ready=True) as srv, \
            srv.client(timeout=300) as client:
        await all_ready(srv, timeout=300)
        pool = srv.quart_app.services.default.pool
        assert all(w.runtime.capacity >= 2 for w in pool.workers)  # sessions need 2+ slots

        # 1. An 8-turn conversation: every turn on its key's worker, reusing its state.
        key = "conversation-1"
        home = key_order(key, 2)[0]
        usages, workers = await converse(client, key)
        fractions = reused_fractions(usages)
        with capsys.disabled():
            print("\nworker", home, "reused fractions per turn:", [round(f, 3) for f in fractions])
        assert workers == {str(home)}
        assert len(fractions) == 7 and all(f >= 0.9 for f in fractions), fractions
        text = (await client.get("/metrics")).text
        assert metric(text, "trioserve_pool_worker_generations_total", worker=str(home)) == 8
        assert metric(text, "trioserve_pool_worker_generations_total", worker=str(1 - home)) == 0

        # 2. Two sessions, one per worker, decoding at the same time.
        keys = [keys_for(0, 2, 1, "story")[0], keys_for(1, 2, 1, "story")[0]]
        firsts = [trio.Event(), trio.Event()]
        texts: dict[str, str] = {}
        async with trio.open_nursery() as nursery:
            for k, first in zip(keys, firsts):
                nursery.start_soon(stream_story, client, k, first, texts)
            for first in firsts:
                await first.wait()
            # Both have produced output and neither stream has ended: each worker runs one.
            running = [w.runtime.in_flight for w in pool.workers]
            assert not texts, "a stream ended before the other started"
            assert running == [1, 1], running
        assert set(texts) == set(keys)
