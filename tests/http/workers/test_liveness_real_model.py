"""A slow step is not a hung worker, on the real model under CPU contention.

A busy-loop process on every core the server may use, then two long prompts sent at once to
SmolLM2 through llama.cpp: their prefill steps run several times slower than on a quiet
machine. The stall and health timeouts are cut from 30 s to 3 s each, so a worker judged by
pings between steps alone would be killed inside one such step; with progress records from
inside the step (graph nodes computed) and pieces that shrink under ``--max-step-ms``, both
prompts are answered, no request sees a 503 and ``/health`` reports no restart.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest
import trio

from trioserve.config import EMBEDDED_MODEL_ID

from ..conftest import live_server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaks")]

# Tokens per prompt (measured with /tokenize below, not assumed). Two of these in flight
# make every step a two-prompt prefill step for most of the test.
PROMPT_TOKENS = 2000
# Longest life of a hog: bounded even if this test process dies without its finally.
HOG_SECONDS = 240

_HOG = ("import time\n"
        "end = time.monotonic() + float(__import__('sys').argv[1])\n"
        "while time.monotonic() < end:\n"
        "    pass\n")


@contextmanager
def cpu_hogs(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` busy-loop processes (bounded by HOG_SECONDS), killed and reaped on exit."""
    hogs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(n):
            hogs.append(subprocess.Popen([sys.executable, "-c", _HOG, str(HOG_SECONDS)]))
        yield hogs
    finally:
        for hog in hogs:
            hog.kill()
        for hog in hogs:
            hog.wait(timeout=10)


def llama_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


def long_prompt(k: int, words: int) -> str:
    """A different text per ``k`` (no shared prefix between the two prompts)."""
    vocabulary = ("river", "mountain", "engine", "garden", "window", "market", "silver", "planet",
                  "harbor", "candle", "forest", "bridge", "thunder", "meadow", "lantern", "copper")
    body = " ".join(vocabulary[(i * (k + 3) + i // 7) % len(vocabulary)] for i in range(words))
    return f"Notebook {k}. {body}. Summarize notebook {k} in one sentence."


async def test_two_long_prompts_under_a_cpu_hog_are_answered_without_a_restart(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trioserve")
    cores = len(os.sched_getaffinity(0))
    async with live_server(tmp_path, engine="llama", worker_bin=llama_worker(), threads=cores,
                           max_context=PROMPT_TOKENS + 512, stall_timeout=3.0,
                           health_timeout=3.0) as srv, srv.client(timeout=600) as client:
        # Size the prompts in tokens of this model (before the hogs start).
        prompts = []
        for k in range(2):
            words = PROMPT_TOKENS
            while True:
                text = long_prompt(k, words)
                counted = await client.post("/tokenize", json={"content": text})
                n = len(counted.json()["tokens"])
                if n <= PROMPT_TOKENS:
                    break
                words = words * PROMPT_TOKENS // n - 8
            prompts.append((text, n))
        assert all(n > PROMPT_TOKENS * 0.9 for _, n in prompts)

        replies: dict[int, object] = {}

        async def ask(k: int) -> None:
            body = {"model": EMBEDDED_MODEL_ID, "max_tokens": 8, "temperature": 0,
                    "messages": [{"role": "user", "content": prompts[k][0]}]}
            replies[k] = await client.post("/v1/chat/completions", json=body)

        with cpu_hogs(cores):
            async with trio.open_nursery() as nursery:
                for k in range(2):
                    nursery.start_soon(ask, k)
        for k in range(2):
            reply = replies[k]
            assert reply.status_code == 200, reply.text  # type: ignore[attr-defined]
            assert reply.json()["usage"]["prompt_tokens"] >= prompts[k][1]  # type: ignore[attr-defined]
        health = (await client.get("/health")).json()
        assert health["status"] == "ready" and health["restarts"] == 0
    messages = [r.getMessage() for r in caplog.records]
    assert not [m for m in messages if m.startswith("worker failed")], messages
