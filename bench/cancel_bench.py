"""Cancellation benchmark: client disconnect → worker idle, hung-worker kill, restart.

* ``cancel_to_idle_ms``: a raw-socket client closes its connection at a random point —
  while its ~1,500-token prompt is prefilling, or after a random number of streamed
  tokens — and we time from ``close()`` to the worker's terminal record reaching the
  runtime (the moment the next request could start). Real model, real worker.
  Target: p99 ≤ one decode step + 20 ms.
* ``hung_kill_ms``: the fake worker hangs ignoring cancel; from the disconnect to the
  worker reaped. Target: ≤ grace + 1 s.
* ``restart_ms``: a worker crash detected → the new worker ready (includes the 0.5 s
  first backoff and the model load).

Prints a table; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

import trio

from bench.lib.client import open_stream
from bench.lib.machine import machine
from bench.lib.servers import running_server
from bench.lib.stats import percentile, summary
from trioserve.machine import installed_worker

LONG_PROMPT = " ".join(f"item{i}" for i in range(700))  # about 1,500 tokens
SHORT_PROMPT = "Write a long story about a lighthouse keeper."


async def wait_idle(runtime, after: float, timeout: float = 30.0) -> float:
    """Wait until the runtime got a terminal record later than ``after``; return its time."""
    with trio.fail_after(timeout):
        while runtime.last_terminal_time <= after or runtime.busy:
            await trio.sleep(0.001)
    return runtime.last_terminal_time


async def cancel_to_idle(n: int, threads: int, seed: int) -> dict:
    rng = random.Random(seed)
    prefill, decode, steps = [], [], []
    ended_first = 0
    async with running_server(engine="llama", threads=threads, max_context=4096) as srv:
        # Warm up, and measure one decode step on this machine.
        warm = await open_stream(srv.port, {"model": srv.settings.resolved_model_id(), "max_tokens": 32,
                                            "messages": [{"role": "user", "content": SHORT_PROMPT}]})
        await wait_idle(srv.pool, 0.0, 120)
        await warm.aclose()
        for i in range(n):
            mid_prefill = i % 3 == 0
            body = {"model": srv.settings.resolved_model_id(), "stream": True, "max_tokens": 400,
                    "temperature": 0.8, "seed": i,
                    "messages": [{"role": "user", "content": LONG_PROMPT if mid_prefill else SHORT_PROMPT}]}
            # Before the request: its own terminal record is the first one later than this, whether it
            # comes after the disconnect (a cancel to time) or before it (it ended by itself: a
            # stop token within the wanted tokens, which another CPU's kernels can make happen).
            before = srv.pool.last_terminal_time
            stream = await open_stream(srv.port, body)
            if mid_prefill:
                await trio.sleep(rng.uniform(0.05, 0.5))
            else:
                want = rng.randint(1, 40)
                seen = b""
                while seen.count(b'"content"') < want + 1:  # +1: the role chunk
                    data = await stream.receive_some(65536)
                    if not data:
                        break
                    seen += data
            t0 = trio.current_time()
            await stream.aclose()
            t1 = await wait_idle(srv.pool, before)
            if t1 < t0:
                ended_first += 1  # nothing to cancel
                continue
            (prefill if mid_prefill else decode).append((t1 - t0) * 1000)
        for record in srv.pool.history:
            if record.get("type") == "done" and record.get("completion_tokens", 0) > 1:
                steps.append(record["decode_ms"] / record["completion_tokens"])
    all_ms = prefill + decode
    step = percentile(steps, 50)
    return {
        "cancel_to_idle_ms_p50": percentile(all_ms, 50),
        "cancel_to_idle_ms_p99": percentile(all_ms, 99),
        "cancel_prefill_ms_p99": percentile(prefill, 99),
        "cancel_decode_ms_p99": percentile(decode, 99),
        "decode_step_ms": step,
        "cancel_target_ms": step + 20,
        "cancel_samples": len(all_ms),
        "cancel_prefill_samples": len(prefill),
        "cancel_ended_before_disconnect": ended_first,
    }


async def hung_kill(runs: int, grace: float) -> list[float]:
    times = []
    for _ in range(runs):
        async with running_server(engine="fake", worker_bin=str(installed_worker("fake")),
                                  worker_args="--hang-after-tokens 0", cancel_grace=grace) as srv:
            pid = srv.pool.worker_pid
            stream = await open_stream(srv.port, {"model": "fake", "stream": True,
                                                  "messages": [{"role": "user", "content": "x"}]})
            while not srv.pool.busy:
                await trio.sleep(0.001)
            await trio.sleep(0.05)
            t0 = trio.current_time()
            await stream.aclose()
            with trio.fail_after(30):
                while srv.pool.last_stop is None or srv.pool.worker_pid == pid and srv.pool.state == "ready":
                    await trio.sleep(0.001)
            times.append((trio.current_time() - t0) * 1000)
    return times


async def restart(runs: int, threads: int) -> list[float]:
    times = []
    for _ in range(runs):
        async with running_server(engine="llama", threads=threads, max_context=2048) as srv:
            pid = srv.pool.worker_pid
            import os
            import signal
            os.kill(pid, signal.SIGKILL)
            with trio.fail_after(120):
                while srv.pool.last_restart_ms is None:
                    await trio.sleep(0.005)
            times.append(srv.pool.last_restart_ms)
    return times


async def run_section(disconnects: int, runs: int, threads: int, grace: float) -> dict[str, Any]:
    """The ``cancel`` section of ``python -m bench``: disconnects, hung-worker kills and
    restarts, with the kill target (grace + 1 s)."""
    out = await cancel_to_idle(disconnects, threads, seed=1)
    kills = await hung_kill(runs, grace)
    restarts = await restart(runs, threads)
    out.update(hung_kill_ms=summary(kills), hung_kill_target_ms=grace * 1000 + 1000, restart_ms=summary(restarts))
    return out


async def main_async(args: argparse.Namespace) -> dict:
    result = await cancel_to_idle(args.disconnects, args.threads, args.seed)
    kills = await hung_kill(args.runs, args.grace)
    restarts = await restart(max(1, args.runs // 2), args.threads)
    result.update(hung_kill_ms=summary(kills)["median"], hung_kill_ms_max=max(kills),
                  hung_kill_target_ms=args.grace * 1000 + 1000,
                  restart_ms=summary(restarts)["median"], restart_ms_max=max(restarts))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--disconnects", type=int, default=60)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--grace", type=float, default=2.0)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    result = trio.run(main_async, args)
    result["machine"] = machine()
    print("| figure | value | target |")
    print("|---|---|---|")
    print(f"| cancel_to_idle_ms p50 / p99 | {result['cancel_to_idle_ms_p50']:.1f} / {result['cancel_to_idle_ms_p99']:.1f} "
          f"| p99 ≤ {result['cancel_target_ms']:.1f} (one decode step {result['decode_step_ms']:.1f} + 20) |")
    print(f"| cancel_prefill_ms p99 ({result['cancel_prefill_samples']} samples) | {result['cancel_prefill_ms_p99']:.1f} | same |")
    print(f"| cancel_decode_ms p99 | {result['cancel_decode_ms_p99']:.1f} | same |")
    print(f"| hung_kill_ms median (max) | {result['hung_kill_ms']:.0f} ({result['hung_kill_ms_max']:.0f}) | ≤ {result['hung_kill_target_ms']:.0f} |")
    print(f"| restart_ms median (max) | {result['restart_ms']:.0f} ({result['restart_ms_max']:.0f}) | — |")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
