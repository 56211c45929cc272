"""Fixtures for black-box tests of the whole server over real loopback HTTP.

Each test starts its own server (hypercorn's trio backend, ephemeral port) on the real
C++ fake worker, so every test sees a fresh worker whose scripted output restarts at
generation 0.
"""

from __future__ import annotations

import json
import os
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import httpx
import pytest
from trioserve.config import Settings
from trioserve.machine import installed_worker
from trioserve.testing import InProcessServer, serve_in_process


def fake_worker_path() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    if override:
        return str(Path(override) / "trioserve-fake-worker")
    return str(installed_worker("fake"))


def child_pids() -> set[int]:
    """PIDs of this process's live children (all threads)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.update(int(p) for p in (task / "children").read_text().split())
        except FileNotFoundError:
            continue
    return pids


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class LiveServer(InProcessServer):
    def client(self, **kwargs: Any) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, timeout=kwargs.pop("timeout", 20.0), **kwargs)


@asynccontextmanager
async def live_server(tmp_path: Path, *, script: list[str] | None = None, wait_ready: bool = True,
                      **overrides: Any) -> AsyncIterator[LiveServer]:
    """Run trioserve on the fake worker; ``script`` is what the "model" says, in order."""
    values: dict[str, Any] = dict(engine="fake", worker_bin=fake_worker_path(), host="127.0.0.1",
                                  port=0, log_level="warning")
    if script is not None:
        path = tmp_path / f"script-{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(script, ensure_ascii=False))
        values["fake_script"] = str(path)
    values.update(overrides)
    async with serve_in_process(Settings(**values), wait_ready=wait_ready, ready_timeout=15) as server:
        yield LiveServer(server.url, server.quart_app)


@pytest.fixture
def no_leaks():
    """Assert that a test leaves no child process and no extra open fd behind."""
    children_before = child_pids()
    fds_before = open_fds()
    yield
    # Reaping is synchronous in our shutdown path, but give the kernel a moment to tear
    # down exited children before /proc stops listing them.
    for _ in range(100):
        if child_pids() <= children_before and open_fds() <= fds_before:
            break
        import time
        time.sleep(0.02)
    assert child_pids() <= children_before, f"leaked child processes: {child_pids() - children_before}"
    assert open_fds() <= fds_before, f"leaked fds: {open_fds()} open, {fds_before} before"


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": content}], **extra}


def parse_sse(raw: bytes) -> list[Any]:
    """Split an SSE body into decoded JSON events; ``[DONE]`` stays the string "[DONE]"."""
    events: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        assert block.startswith("data: "), block
        data = block[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events
