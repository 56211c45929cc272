"""Over HTTP on the real embedded model: with the kernel probe forced to die by
SIGILL (fault injection, ``--test-probe-fault sigill``), the server still serves, every
request succeeds, the output is the same as with extra buffer types off, and
``/v1/models`` says which kernel path was chosen."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import trio

from trioserve.config import EMBEDDED_MODEL_ID

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]


def llama_worker_bin() -> str:
    """The dev build when TRIOSERVE_WORKER_DIR names one, else the installed worker."""
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


async def ask(client, question: str):
    return await client.post("/v1/chat/completions", json={
        "model": EMBEDDED_MODEL_ID, "messages": [{"role": "user", "content": question}],
        "max_tokens": 16, "temperature": 0})


async def greedy_answers(srv, questions: list[str]) -> tuple[dict, list[str]]:
    """``/v1/models`` and each question's greedy answer, one request at a time (alone in its
    batch, so the outputs of two servers compare exactly)."""
    async with srv.client(timeout=180) as client:
        answers = []
        for q in questions:
            resp = await ask(client, q)
            assert resp.status_code == 200, resp.text
            answers.append(resp.json()["choices"][0]["message"]["content"])
        return (await client.get("/v1/models")).json(), answers


async def test_probe_killed_by_sigill_falls_back_and_no_request_fails(tmp_path):
    questions = ["What is the capital of France?", "Name a color."]
    common = dict(engine="llama", worker_bin=llama_worker_bin(), threads=2, max_context=1024, slots=4)
    async with live_server(tmp_path, worker_args="--test-probe-fault sigill", **common) as srv:
        models, fallback = await greedy_answers(srv, questions)
        statuses: list[int] = []
        async with srv.client(timeout=180) as client, trio.open_nursery() as nursery:
            async def one(q: str) -> None:
                statuses.append((await ask(client, q)).status_code)
            for q in questions * 2:  # concurrent too: they share batches
                nursery.start_soon(one, q)
        assert statuses == [200] * 4 and srv.pool.restarts == 0
    kernel_path = models["data"][0]["capabilities"]["kernel_path"]
    if not kernel_path["extra_buffer_types"]:
        pytest.skip("this llama.cpp build offers no CPU extra buffer types: no probe to fail")
    assert kernel_path["probe"] == "died by illegal instruction (SIGILL)"
    assert kernel_path["fallback"] is True and kernel_path["extra_buffers_enabled"] is False
    async with live_server(tmp_path, cpu_extra_buffers="off", **common) as srv:
        models, plain = await greedy_answers(srv, questions)
        assert models["data"][0]["capabilities"]["kernel_path"]["cpu_extra_buffers"] == "off"
    assert fallback == plain and all(fallback)
