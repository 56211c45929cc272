"""A context-overflow 400 does not wait for a running prefill (spec worker §4 "Fast
refusals"). Ordering, not wall time: the 400 must arrive before the long request's first byte
of output, which needs its whole ~2 s prefill step."""

from __future__ import annotations

import pytest
import trio

from ..conftest import chat_body, live_server

pytestmark = pytest.mark.usefixtures("no_leaks")


async def test_context_overflow_400_arrives_while_a_long_prefill_runs(tmp_path):
    flags = "--prefill-ms-per-token 1 --batch-tokens 4096 --prefill-chunk 4096"
    async with live_server(tmp_path, script=["done"], max_context=4096, worker_args=flags) as srv, \
            srv.client(timeout=60) as client:
        events: list[str] = []

        async def long_request() -> None:
            resp = await client.post("/v1/chat/completions", json=chat_body("w" * 2000))
            assert resp.status_code == 200, resp.text
            events.append("long done")

        async def overflow() -> None:
            await trio.sleep(0.3)  # the long prompt's step is running by then (not asserted)
            resp = await client.post("/v1/chat/completions", json=chat_body("o" * 5000))
            assert resp.status_code == 400
            assert resp.json()["error"]["code"] == "context_length_exceeded"
            events.append("overflow 400")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(long_request)
            nursery.start_soon(overflow)
        assert events == ["overflow 400", "long done"]
