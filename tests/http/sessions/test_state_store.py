"""The persistent state store over HTTP (spec/README.md §12, spec/worker-protocol.md §6.4), on
the fake worker: a returning session is warm after the server restarts, after its worker is
SIGKILLed and restarted, and on another server sharing the directory; a damaged file is
served cold; ``DELETE /v1/sessions/{key}`` removes the session's files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from testkit import free_port
from testkit.replicas import stop, wait_healthy

from ..conftest import chat_body, child_pids, fake_worker_path, live_server

# ~3 KB of context: the fake worker's tokens are bytes (its context is 4096).
CONTEXT = "Repository notes: the parser lives in src/parser.py and its tests in tests/. " * 40
KEY = "agent-7"


def _turn1() -> dict:
    return chat_body(CONTEXT + "Fix the failing test.", prompt_cache_key=KEY, max_tokens=2)


def _turn2(reply: str) -> dict:
    body = _turn1()
    body["messages"] += [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "Now add a test for empty input."}]
    return body


def _cached(resp) -> tuple[int, int]:
    usage = resp.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


async def _stored(state_dir: Path, n: int = 1) -> list[Path]:
    """The store's files once ``n`` exist (the worker writes them after the turn, off the step)."""
    with trio.fail_after(10):
        while len(files := sorted(state_dir.glob("*.tss"))) < n:
            await trio.sleep(0.02)
    return files


async def _first_turn(tmp_path: Path, state_dir: Path) -> str:
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=_turn1())
        assert resp.status_code == 200, resp.text
        await _stored(state_dir)
        return resp.json()["choices"][0]["message"]["content"]


async def test_a_returning_session_is_warm_after_the_server_restarts(tmp_path):
    state_dir = tmp_path / "states"
    reply = await _first_turn(tmp_path, state_dir)
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=_turn2(reply))
        assert resp.status_code == 200
        cached, prompt = _cached(resp)
        assert cached >= 0.95 * prompt, (cached, prompt)
        metrics = (await client.get("/metrics")).text
        assert 'trioserve_state_store_hits_total{worker="0"} 1.0' in metrics
        assert 'trioserve_state_store_write_failures_total{worker="0"} 0.0' in metrics
        assert re.search(r'^trioserve_state_store_files\{worker="0"\} [1-9]', metrics, re.M)


async def test_a_returning_session_is_warm_after_its_worker_is_sigkilled(tmp_path):
    state_dir = tmp_path / "states"
    before = child_pids()
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as srv, srv.client() as client:
        (worker,) = child_pids() - before
        resp = await client.post("/v1/chat/completions", json=_turn1())
        reply = resp.json()["choices"][0]["message"]["content"]
        await _stored(state_dir)
        os.kill(worker, signal.SIGKILL)
        with trio.fail_after(15):
            while srv.pool.restarts < 1:
                await trio.sleep(0.01)
        await srv.wait_state("ready", timeout=15)
        resp = await client.post("/v1/chat/completions", json=_turn2(reply))
        assert resp.status_code == 200
        cached, prompt = _cached(resp)
        assert cached >= 0.95 * prompt, (cached, prompt)


async def test_a_second_server_sharing_the_directory_finds_the_first_ones_state(tmp_path):
    state_dir = tmp_path / "shared"
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as a, \
            live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as b, \
            a.client() as ca, b.client() as cb:
        resp = await ca.post("/v1/chat/completions", json=_turn1())
        reply = resp.json()["choices"][0]["message"]["content"]
        await _stored(state_dir)
        resp = await cb.post("/v1/chat/completions", json=_turn2(reply))
        assert resp.status_code == 200
        cached, prompt = _cached(resp)
        assert cached >= 0.95 * prompt, (cached, prompt)


async def test_a_corrupt_state_file_is_served_cold(tmp_path):
    state_dir = tmp_path / "states"
    reply = await _first_turn(tmp_path, state_dir)
    for f in state_dir.glob("*.tss"):
        data = bytearray(f.read_bytes())
        data[-1] ^= 0xFF
        f.write_bytes(bytes(data))
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as srv, srv.client() as client:
        resp = await client.post("/v1/chat/completions", json=_turn2(reply))
        assert resp.status_code == 200
        assert _cached(resp)[0] == 0
        assert (await client.get("/health")).status_code == 200
        assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_delete_removes_a_sessions_stored_state(tmp_path):
    state_dir = tmp_path / "states"
    await _first_turn(tmp_path, state_dir)
    async with live_server(tmp_path, script=["ok"], state_dir=str(state_dir)) as srv, srv.client() as client:
        # The restarted server holds the session only on disk: DELETE still finds it.
        assert (await client.delete(f"/v1/sessions/{KEY}")).status_code == 204
        assert not list(state_dir.glob("*.tss"))
        assert (await client.delete(f"/v1/sessions/{KEY}")).status_code == 404


def _serve(tmp_path: Path, state_dir: Path, port: int) -> subprocess.Popen:
    """`trioserve serve` as its own process on the fake worker, with the store in ``state_dir``."""
    script = tmp_path / "script.json"
    script.write_text(json.dumps(["ok"]))
    env = dict(os.environ, TRIOSERVE_ENGINE="fake", TRIOSERVE_WORKER_BIN=fake_worker_path(),
               TRIOSERVE_FAKE_SCRIPT=str(script), TRIOSERVE_PORT=str(port),
               TRIOSERVE_STATE_DIR=str(state_dir), TRIOSERVE_LOG_LEVEL="warning")
    log = open(tmp_path / f"serve-{port}.log", "wb")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen([sys.executable, "-m", "trioserve.cli", "serve"], env=env, stdout=log, stderr=log)


def test_sigterm_of_trioserve_serve_writes_the_pending_state(tmp_path):
    # The server is stopped (SIGTERM) right after the turn, whether or not the worker wrote
    # its state yet: the stop (stdin EOF to the worker) drains the write; the next server is warm.
    state_dir = tmp_path / "states"
    port = free_port()
    proc = _serve(tmp_path, state_dir, port)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=_turn1(), timeout=30)
        reply = resp.json()["choices"][0]["message"]["content"]
    finally:
        stop(proc)
    assert proc.returncode == 0
    assert list(state_dir.glob("*.tss"))
    proc = _serve(tmp_path, state_dir, port := free_port())
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=_turn2(reply), timeout=30)
        cached, prompt = _cached(resp)
        assert cached >= 0.95 * prompt, (cached, prompt)
    finally:
        stop(proc)
