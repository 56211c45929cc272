"""A worker that dies by a signal (a CPU kernel fault) is reported by the signal's name.

Black-box over HTTP on the fake worker, whose ``--signal-after-tokens N --crash-signal S``
makes it die by signal S when asked for token N+1 (an AMX kernel killing the
llama worker with SIGILL on its first request). The last test uses the llama worker's
CPU-feature check with a fake /proc/cpuinfo (it refuses before loading the model, so it is fast).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import trio

from ..conftest import chat_body, live_server


async def wait_restarted(srv, restarts: int) -> None:
    """Until the supervisor started its ``restarts``-th replacement worker and it is ready."""
    with trio.fail_after(15):
        while srv.pool.restarts < restarts:
            await trio.sleep(0.01)
    await srv.wait_state("ready", timeout=15)


async def test_a_worker_that_dies_on_every_first_step_is_a_startup_failure_named_by_its_signal(
        tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    async with live_server(tmp_path, script=["0123456789"], max_crashes=10, crash_window=60,
                           worker_args="--signal-after-tokens 0 --crash-signal sigill") as srv, \
            srv.client() as client:
        first = await client.post("/v1/chat/completions", json=chat_body())
        assert first.status_code == 503
        assert "died by illegal instruction (SIGILL)" in first.json()["error"]["message"]
        await wait_restarted(srv, 1)
        second = await client.post("/v1/chat/completions", json=chat_body())
        assert second.status_code == 503
        with trio.fail_after(15):
            await srv.pool.fatal.wait()  # given up after 2 starts, not after 10
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable", "reason": "unavailable",
                                 "crash": "illegal instruction (SIGILL)", "model": "fake",
                                 "queued": 0, "running": 0, "restarts": 1}
        assert srv.pool.reason == ("startup failed: the worker died by illegal instruction "
                                         "(SIGILL) before finishing a generation, 2 starts in a row")
    failures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("worker failed")]
    assert failures == ["worker failed: worker died by illegal instruction (SIGILL)"] * 2


async def test_a_worker_that_served_before_it_crashed_is_restarted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    # Each generation says "ab" (2 tokens); the 4th token of a worker's life kills it.
    async with live_server(tmp_path, script=["ab"], max_crashes=10, crash_window=60,
                           worker_args="--signal-after-tokens 3 --crash-signal sigsegv") as srv, \
            srv.client() as client:
        for round_ in range(2):
            ok = await client.post("/v1/chat/completions", json=chat_body())
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ab"
            crashed = await client.post("/v1/chat/completions", json=chat_body())
            assert crashed.status_code == 503
            assert "segmentation fault (SIGSEGV)" in crashed.json()["error"]["message"]
            await wait_restarted(srv, round_ + 1)
        assert not srv.pool.fatal.is_set() and srv.pool.restarts == 2
        assert (await client.get("/health")).json()["status"] == "ready"
    assert any("died by segmentation fault (SIGSEGV)" in r.getMessage() for r in caplog.records)


async def test_a_llama_build_for_another_cpu_is_a_startup_failure_at_once(tmp_path, caplog):
    """The llama worker refuses a CPU without the extensions its ggml was compiled for (exit
    status 3, before loading the model); the server gives up at once: restarting cannot help."""
    caplog.set_level(logging.INFO, logger="trioserve")
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse sse2\n\n")
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    worker = str(Path(override) / "trioserve-llama-worker") if override else ""
    async with live_server(tmp_path, engine="llama", worker_bin=worker, wait_ready=False,
                           worker_args=f"--test-cpuinfo {cpuinfo}") as srv, srv.client() as client:
        with trio.fail_after(60):
            while srv.pool.state == "loading":
                await trio.sleep(0.02)
        if srv.pool.state == "ready":
            pytest.skip("the linked ggml was built for no x86 extension (or not for x86)")
        assert srv.pool.fatal.is_set() and srv.pool.restarts == 0
        assert srv.pool.reason.startswith(
            "startup failed: worker exited during startup (exit status 3): this CPU lacks")
        assert (await client.get("/health")).json()["reason"] == "unavailable"
    # A linked build names the rebuild command; run-time-selected kernels name the chosen variant.
    assert any("lacks instruction-set extensions" in r.getMessage()
               and ("pip install --no-cache-dir" in r.getMessage() or "selected for it (variant " in r.getMessage())
               for r in caplog.records)
