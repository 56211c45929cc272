"""The control plane alone: a fake worker (no delay, one token per byte) behind trioserve in its own
process, streamed through HTTP/SSE by a raw-socket client; and the keep-up check (a fake worker at
2 ms/token: a client that keeps up gets one SSE event per token, delivered at once).

The ``control`` and ``keepup`` sections of ``python -m bench``. Never asserts on time.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from bench.lib.client import stream_chat
from bench.lib.machine import cpu_seconds, rss_mb
from bench.lib.servers import ServerProcess
from bench.lib.stats import percentile, summary


async def control_plane(tmp: Path, runs: int, tokens: int, streams: int) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps(["abcdefghij" * (tokens // 10)]))
    srv = ServerProcess.trioserve(tmp, engine="fake", fake_script=script, max_context=tokens + 256,
                                  queue_depth=max(16, streams))
    try:
        await srv.wait_ready()
        body = {"model": "fake", "messages": [{"role": "user", "content": "go"}]}
        await stream_chat(srv.port, body)  # warm-up
        rss_idle = rss_mb(srv.pid)
        single, client_cpu, server_cpu, events_per_token = [], [], [], []
        for _ in range(runs):
            c0, s0 = time.process_time(), cpu_seconds(srv.pid)
            r = await stream_chat(srv.port, body)
            wall = r["t_done"] - r["t_sent"]
            single.append(r["completion_tokens"] / wall)
            client_cpu.append((time.process_time() - c0) / wall)
            server_cpu.append((cpu_seconds(srv.pid) - s0) / wall)
            events_per_token.append(r["events"] / r["completion_tokens"])
        aggregate, rss_peak = [], 0.0
        for _ in range(runs):
            results: list[dict[str, Any]] = []
            async with trio.open_nursery() as nursery:
                async def one() -> None:
                    results.append(await stream_chat(srv.port, body))

                async def sample_rss() -> None:
                    nonlocal rss_peak
                    while True:
                        rss_peak = max(rss_peak, rss_mb(srv.pid))
                        await trio.sleep(0.02)

                nursery.start_soon(sample_rss)
                async with trio.open_nursery() as clients:
                    for _ in range(streams):
                        clients.start_soon(one)
                nursery.cancel_scope.cancel()
            total = sum(r["completion_tokens"] for r in results)
            wall = max(r["t_done"] for r in results) - min(r["t_sent"] for r in results)
            aggregate.append(total / wall)
        return {"control_plane_tok_s": summary(single), "control_plane_tok_s_8": summary(aggregate),
                "control_plane_client_cpu": summary(client_cpu), "control_plane_server_cpu": summary(server_cpu),
                "control_plane_events_per_token": summary(events_per_token),
                "control_plane_rss_mb_idle": rss_idle, "control_plane_rss_mb_8": rss_peak,
                "control_plane_stream_tokens": tokens}
    finally:
        srv.stop()


async def keep_up(tmp: Path, runs: int, tokens: int = 200, delay_ms: float = 2.0) -> dict[str, Any]:
    """When the client keeps up, every token must be its own event, delivered at once."""
    script = tmp / "keepup.json"
    script.write_text(json.dumps(["x" * tokens]))
    srv = ServerProcess.trioserve(tmp, engine="fake", fake_script=script, worker_args=f"--token-delay-ms {delay_ms}")
    try:
        await srv.wait_ready()
        body = {"model": "fake", "stream": True, "messages": [{"role": "user", "content": "go"}]}
        ratios, gaps, cpu_us = [], [], []
        for _ in range(runs):
            c0 = cpu_seconds(srv.pid)
            payload = json.dumps(body).encode()
            stream = await trio.open_tcp_stream("127.0.0.1", srv.port)
            async with stream:
                await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                                      + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
                arrivals, buf, content_events = [], b"", 0
                while b"[DONE]" not in buf[-64:]:
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    buf += data
                    k = data.count(b'"delta":{"content":')
                    if k:
                        content_events += k
                        arrivals.append(time.perf_counter())
            cpu_us.append((cpu_seconds(srv.pid) - c0) / tokens * 1e6)
            ratios.append(content_events / tokens)
            gaps += [(b - a) * 1000 for a, b in zip(arrivals, arrivals[1:])]
        return {"keepup_events_per_token": summary(ratios), "keepup_cpu_us_per_token": summary(cpu_us), "keepup_gap_ms_p50": percentile(gaps, 50),
                "keepup_gap_ms_p99": percentile(gaps, 99), "keepup_token_delay_ms": delay_ms}
    finally:
        srv.stop()
