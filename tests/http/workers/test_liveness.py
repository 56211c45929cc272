"""A slow step is not a hung worker (spec/worker-protocol.md §4.4), over HTTP on the fake worker.

The stall and health timeouts are cut to 1 s each, so a worker judged by pings alone would be
killed inside any step longer than 2 s. ``--prefill-ms-per-token`` makes a step that long
while the fake's compute counter moves (progress); ``--stuck-token`` makes a step that never
moves (a kernel that stopped).
"""

from __future__ import annotations

import logging

import trio

from ..conftest import chat_body, live_server

TIMEOUTS = dict(stall_timeout=1.0, health_timeout=1.0)


async def test_a_long_step_that_makes_progress_is_not_killed(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    # Two prompts of ~120 tokens prefilled in one step at 20 ms a token: about 5 s, more than
    # twice stall + health.
    async with live_server(tmp_path, script=["one", "two"], worker_args="--prefill-ms-per-token 20",
                           **TIMEOUTS) as srv, srv.client(timeout=60) as client:
        replies: dict[int, object] = {}

        async def ask(k: int) -> None:
            replies[k] = await client.post("/v1/chat/completions", json=chat_body("x" * 80 + str(k)))

        async with trio.open_nursery() as nursery:
            for k in range(2):
                nursery.start_soon(ask, k)
        statuses = sorted(r.status_code for r in replies.values())  # type: ignore[attr-defined]
        assert statuses == [200, 200]
        contents = sorted(r.json()["choices"][0]["message"]["content"]  # type: ignore[attr-defined]
                          for r in replies.values())
        assert contents == ["one", "two"]
        health = (await client.get("/health")).json()
        assert health["status"] == "ready" and health["restarts"] == 0
    assert not [r for r in caplog.records if r.getMessage().startswith(("worker stalled", "worker failed"))]


async def test_a_stuck_step_is_killed_reported_and_the_worker_restarted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    # A prompt holding "Z" (token 90) gets stuck in its step; the others are served.
    async with live_server(tmp_path, script=["ok"], worker_args="--stuck-token 90",
                           max_crashes=10, **TIMEOUTS) as srv, srv.client(timeout=60) as client:
        stuck = await client.post("/v1/chat/completions", json=chat_body("Zzz"))
        assert stuck.status_code == 503
        assert stuck.json()["error"]["code"] == "worker_unavailable"
        with trio.fail_after(30):
            while srv.pool.restarts < 1:
                await trio.sleep(0.05)
        await srv.wait_state("ready", timeout=30)
        fine = await client.post("/v1/chat/completions", json=chat_body("hello"))
        assert fine.status_code == 200 and fine.json()["choices"][0]["message"]["content"] == "ok"
        assert (await client.get("/health")).json()["restarts"] == 1
    messages = [r.getMessage() for r in caplog.records]
    stalled = [m for m in messages if m.startswith("worker stalled: no progress for")]
    assert stalled and " in step " in stalled[0] and "(1 prefill piece (" in stalled[0] and "; pinging it" in stalled[0]
    failed = [m for m in messages if m.startswith("worker failed: worker stalled with generations in flight")]
    assert len(failed) == 1 and "(1 prefill piece (" in failed[0], messages
