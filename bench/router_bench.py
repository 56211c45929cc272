"""Time to first byte through a router versus direct (fake engine, three replicas).

    python -m bench.router_bench [--requests 50]

Three ``trioserve serve`` replicas on the fake worker, with nginx (when installed) and
vllm-router (when installed) in front of them, each configured exactly as docs/deployment.md
says (testkit/replicas.py reads the configuration from the document). Every request is a
streamed chat completion of 4 tokens for one session key, on a fresh connection, so the router
hashes it to one replica and the direct requests go to that same replica (each router hashes
its own way, so there is one direct row per replica a router chose). Time to first byte
runs from the request's last byte sent to the first byte of the response (trioserve sends its
headers with the first token, so this is the time to the first token as the client sees it).
The targets take turns request by request, so drift in the machine's load falls on all of
them alike. Prints a markdown table (median and 90th percentile per target, and the median's
difference to direct) and a final JSON line. Never asserts; a router that is not installed is
a row saying so.

``TRIOSERVE_WORKER_DIR`` names a directory holding ``trioserve-fake-worker`` (a dev build);
otherwise the installed package's worker is used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import trio

from bench.lib.machine import machine
from bench.lib.stats import percentile
from testkit.replicas import (
    free_port,
    nginx_config,
    replica,
    router_argv,
    stop,
    wait_healthy,
)
from trioserve.machine import installed_worker

KEY = "bench-session"


def fake_worker() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-fake-worker") if override else str(installed_worker("fake"))


async def first_byte(port: int) -> tuple[float, str]:
    """One streamed 4-token chat on a new connection: seconds to the first response byte, and
    the ``x-trioserve-instance`` that answered (read to the end of the stream)."""
    payload = json.dumps({"model": "fake", "max_tokens": 4, "stream": True,
                          "messages": [{"role": "user", "content": "hello"}]}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
               b"Content-Type: application/json\r\nConnection: close\r\n"
               + f"x-session-id: {KEY}\r\nx-session-affinity: {KEY}\r\n".encode()
               + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    with trio.fail_after(30):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(request)
            sent = time.perf_counter()
            data = await stream.receive_some(65536)
            ttfb = time.perf_counter() - sent
            while b"data: [DONE]" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
    head = data.split(b"\r\n\r\n", 1)[0].decode("latin-1")
    if not head.startswith("HTTP/1.1 200"):
        raise RuntimeError(f"{port}: {head[:200]}")
    instance = next((line.split(":", 1)[1].strip() for line in head.split("\r\n")
                     if line.lower().startswith("x-trioserve-instance:")), "?")
    return ttfb, instance


def wait_serving(port: int, proc: subprocess.Popen, timeout: float = 30) -> None:
    """Until a chat through the router on ``port`` succeeds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            trio.run(first_byte, port)
            return
        except (OSError, RuntimeError):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"router on {port} did not start (exit {proc.poll()})") from None
            time.sleep(0.1)


def start_routers(stack: ExitStack, tmp: Path, upstreams: list[int]) -> tuple[dict[str, int], dict[str, str]]:
    """The installed routers in front of ``upstreams``: ports by name, and why a router is
    missing."""
    ports: dict[str, int] = {}
    missing: dict[str, str] = {}
    nginx = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx", "/usr/local/sbin/nginx")
                                           if os.access(p, os.X_OK)), None)
    if nginx:
        listen = free_port()
        (tmp / "nginx").mkdir()
        conf = tmp / "nginx" / "nginx.conf"
        conf.write_text(nginx_config(tmp / "nginx", listen, upstreams))
        proc = subprocess.Popen([nginx, "-p", str(tmp / "nginx"), "-c", str(conf)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.callback(stop, proc, 10)
        wait_serving(listen, proc)
        ports["nginx"] = listen
    else:
        missing["nginx"] = "not installed"
    beside = Path(sys.executable).with_name("vllm-router")
    router = str(beside) if beside.exists() else shutil.which("vllm-router")
    if router:
        listen = free_port()
        log = stack.enter_context(open(tmp / "vllm-router.log", "wb"))
        proc = subprocess.Popen(router_argv(router, listen, free_port(), upstreams),
                                stdout=log, stderr=log)
        stack.callback(stop, proc, 10)
        wait_serving(listen, proc)
        ports["vllm-router"] = listen
    else:
        missing["vllm-router"] = "not installed (pip install vllm-router)"
    return ports, missing


def measure(targets: dict[str, int], requests: int) -> dict[str, list[float]]:
    """``requests`` TTFB samples per target, the targets taking turns."""
    samples: dict[str, list[float]] = {name: [] for name in targets}
    for port in targets.values():  # warm-up: connections, the session's slot
        trio.run(first_byte, port)
    for _ in range(requests):
        for name, port in targets.items():
            samples[name].append(trio.run(first_byte, port)[0] * 1000)
    return samples


def run(requests: int) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(), "requests": requests}
    with tempfile.TemporaryDirectory() as name, ExitStack() as stack:
        tmp = Path(name)
        replicas = {f"replica-{k}": free_port() for k in range(3)}
        procs = {n: stack.enter_context(replica(tmp, n, port, fake_worker()))
                 for n, port in replicas.items()}
        for n, port in replicas.items():
            wait_healthy(f"http://127.0.0.1:{port}", procs[n])
        routers, missing = start_routers(stack, tmp, list(replicas.values()))
        # Direct = straight to the replica a router sends this key to (each router hashes its
        # own way, so each is compared with its own replica).
        homes = {r: trio.run(first_byte, port)[1] for r, port in routers.items()}
        direct = {f"direct to {home}": replicas[home]
                  for home in sorted(set(homes.values()) or {"replica-0"})}
        samples = measure({**direct, **routers}, requests)
        res["homes"] = homes
        res["missing"] = missing
        res["ttfb_ms"] = {n: {"median": statistics.median(v), "p90": percentile(v, 90),
                              "min": min(v)} for n, v in samples.items()}
    return res


def run_section(quick: bool) -> dict[str, Any]:
    """For ``python -m bench`` (bench/runner.py): fewer requests with ``--quick``."""
    return {"router_bench": run(20 if quick else 50)}


def table(res: dict[str, Any]) -> list[str]:
    ttfb = res["ttfb_ms"]
    lines = [f"Time to first byte, streamed chat of 4 tokens on a fresh connection, median of "
             f"{res['requests']} requests per target (fake engine, 3 replicas; "
             f"{res['machine']['cores']} cores, {res['machine']['cpu']})", "",
             "| target | TTFB median (ms) | p90 (ms) | min (ms) | median − direct (ms) |",
             "|---|---|---|---|---|"]
    for name, row in ttfb.items():
        home = res["homes"].get(name)
        diff = "—" if home is None else (
            f"{row['median'] - ttfb[f'direct to {home}']['median']:+.2f} (vs {home})")
        lines.append(f"| {name} | {row['median']:.2f} | {row['p90']:.2f} | {row['min']:.2f} | {diff} |")
    for name, why in res["missing"].items():
        lines.append(f"| {name} | {why} | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args(argv)
    res = run(args.requests)
    print("\n".join(table(res)))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
