"""The token path: control-plane CPU per streamed token, where it goes, and fleets at GPU rates.

    python -m bench.token_path_bench [--quick] [--profile] [--floor] [--fleet [--pin]] [--out docs/benchmarks/token-path.md]

* **per token**: one stream on the fake engine at a fixed step time (2 ms: a client that
  keeps up gets one SSE event per token), control-plane CPU per streamed token (the server
  process's schedstat, all threads) and SSE events per token; ``--runs`` runs.
* **profile** (``--profile``): the same stream with trioserve in this process under
  cProfile (the client is another process), its profiled time grouped by stage (worker
  record decode, read and routing, events and pipeline, adapter encoding, http/, quart,
  hypercorn and h11, trio); idle time in epoll is left out. cProfile's own cost per call
  inflates every stage, so the table gives each stage's share and that share of the CPU
  per token measured without the profiler.
* **floor** (``--floor``): the same stream at 2, 10 and 30 ms steps beside the least a process
  must spend to forward one token (bench/lib/wake_floor.py: one trio task, two trio tasks as a
  server has them, and a bare ``epoll`` loop, that wait for a pipe, read it and write a
  socket), run alternately: what trioserve adds above trio's own wake-ups at each cadence, and
  what the cadence itself costs.
* **fleet** (``--fleet``): N streams decoding at once on the fake engine, one step every
  ``1000/rate`` ms (``--token-delay-ms`` is per step, however many streams are in it: a
  GPU's batched step): delivered tokens/s against the nominal N×rate, control-plane CPU in
  cores, and each token's lag behind its stream's schedule in steps (arrival − first
  arrival, in steps, minus the tokens before it) at p50 / p99. 256 × 50 tok/s and
  64 × 200 tok/s. The server's trace also counts the garbage collector's passes (a full pass
  stops every stream). ``--pin``: the control plane on a CPU of its own.

Writes its own section of ``--out`` (between ``<!-- token-path:begin -->`` markers); never
asserts on time.
"""

from __future__ import annotations

import argparse
import cProfile
import collections
import datetime
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.lib.machine import cpu_seconds, machine
from bench.lib.markdown import replace_section
from bench.lib.servers import ServerProcess, running_server
from bench.lib.stats import percentile, summary
from bench.lib.wake_floor import RELAYS

BEGIN, END = "<!-- token-path:begin -->", "<!-- token-path:end -->"
_CONTENT = re.compile(rb'"content":"(x*)"')

# Stages of the path, matched on the file of a profiled function, first match wins.
STAGES = [
    ("worker record decode", ("trioserve/worker/protocol.py", "json/decoder.py", "json/__init__.py")),
    ("worker read + routing", ("trioserve/worker/",)),
    ("events + pipeline", ("trioserve/core/",)),
    ("adapter: SSE encoding", ("trioserve/api/", "json/encoder.py")),
    ("http/ (router-facing, access log, connection)", ("trioserve/http/",)),
    ("quart (ASGI)", ("quart",)),
    ("hypercorn + h11", ("hypercorn/", "h11/")),
    ("trio (scheduler, I/O, cancel scopes)", ("trio/", "outcome/", "contextlib", "attr")),
]
_SYSCALLS = ("posix.write", "posix.read", "send", "recv", "epoll")


async def _stream(port: int, body: dict[str, Any]) -> list[tuple[float, int]]:
    """Stream one chat completion on a raw socket; ``(arrival time, tokens)`` per read that
    carried content (the script is all ``x``: one character per token)."""
    payload = json.dumps(dict(body, stream=True)).encode()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    arrivals: list[tuple[float, int]] = []
    async with stream:
        await stream.send_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Type: application/json\r\n"
                              + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        tail = b""
        while b"[DONE]" not in tail:
            data = await stream.receive_some(1 << 16)
            if not data:
                raise RuntimeError(f"connection closed before [DONE]: {tail[-300:]!r}")
            tokens = sum(len(m) for m in _CONTENT.findall(data))
            if tokens:
                arrivals.append((time.perf_counter(), tokens))
            tail = tail[-16:] + data
    return arrivals


def _body(tokens: int) -> dict[str, Any]:
    return {"model": "fake", "messages": [{"role": "user", "content": "go"}], "max_tokens": tokens}


def _script(tmp: Path, tokens: int) -> Path:
    path = tmp / f"script-{tokens}.json"
    path.write_text(json.dumps(["x" * tokens]))
    return path


async def per_token(tmp: Path, runs: int, tokens: int, step_ms: float) -> dict[str, Any]:
    srv = ServerProcess.trioserve(tmp, engine="fake", fake_script=_script(tmp, tokens),
                                  max_context=tokens + 256, worker_args=f"--token-delay-ms {step_ms}")
    try:
        await srv.wait_ready()
        await _stream(srv.port, _body(tokens))  # warm-up
        cpu_us, events = [], []
        for _ in range(runs):
            c0 = cpu_seconds(srv.pid)
            arrivals = await _stream(srv.port, _body(tokens))
            cpu_us.append((cpu_seconds(srv.pid) - c0) / tokens * 1e6)
            events.append(len(arrivals) / tokens)
        return {"cpu_us_per_token": summary(cpu_us), "reads_per_token": summary(events),
                "tokens": tokens, "step_ms": step_ms}
    finally:
        srv.stop()


FLOOR_PERIODS_MS = (2.0, 10.0, 30.0)


def _relay_floor(relay: str, period_ms: float, tokens: int) -> float:
    """bench/lib/wake_floor.py in a process of its own (its CPU is the relay's alone)."""
    out = subprocess.run([sys.executable, "-m", "bench.lib.wake_floor", relay, str(period_ms), str(tokens)],
                         capture_output=True, text=True, check=True, timeout=600,
                         cwd=Path(__file__).resolve().parent.parent)  # the repository root: bench is a package there
    return float(json.loads(out.stdout)["cpu_us_per_token"])


async def floor(tmp: Path, runs: int, tokens: int) -> list[dict[str, Any]]:
    """Per period: trioserve's control-plane CPU per token (one stream, one event per token)
    and the three relays' floors, each run ``runs`` times, all four alternating; about 10 s of
    tokens per run at most."""
    rows = []
    for period in FLOOR_PERIODS_MS:
        n = min(tokens, int(10_000 / period))
        got: dict[str, list[float]] = {name: [] for name in ("trioserve", *RELAYS)}
        for _ in range(runs):
            got["trioserve"].append((await per_token(tmp, 1, n, period))["cpu_us_per_token"]["median"])
            for relay in RELAYS:
                got[relay].append(await trio.to_thread.run_sync(_relay_floor, relay, period, n))
        rows.append({"step_ms": period, "tokens": n, **{k: summary(v) for k, v in got.items()}})
    return rows


_PROFILE_CLIENT = """
import sys, trio
from bench.token_path_bench import _stream, _body
trio.run(_stream, int(sys.argv[1]), _body(int(sys.argv[2])))
"""


async def profile(tmp: Path, tokens: int, step_ms: float) -> dict[str, float]:
    """Each stage's share of the profiled (non-idle) time of one stream."""
    async with running_server(engine="fake", fake_script=str(_script(tmp, tokens)),
                              max_context=tokens + 256, worker_args=f"--token-delay-ms {step_ms}") as srv:
        client = [sys.executable, "-c", _PROFILE_CLIENT, str(srv.port), str(tokens)]
        await trio.run_process(client)  # warm-up
        prof = cProfile.Profile()
        prof.enable()
        await trio.run_process(client)
        prof.disable()
    shares: collections.Counter[str] = collections.Counter()
    for (file, _line, name), (_cc, _nc, tottime, _ct, _callers) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        if "epoll" in name and "poll" in name:
            continue  # waiting for I/O: idle
        if "subprocess" in file:
            continue  # the profiler's own client process handling
        stage = next((s for s, files in STAGES if any(f in file for f in files)), None)
        if stage is None:
            stage = ("system calls (socket, pipe, epoll)" if file == "~" and any(k in name for k in _SYSCALLS)
                     else "other (builtins, stdlib)")
        shares[stage] += tottime
    total = sum(shares.values())
    return {stage: t / total for stage, t in shares.most_common()}


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` onto ``cpus`` (``sched_setaffinity`` moves one thread)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


async def fleet(tmp: Path, streams: int, rate: float, seconds: float, pin: bool = False) -> dict[str, Any]:
    """``streams`` streams of ``rate`` tokens/s each, all in one batched step every 1/rate s.
    The server runs under bench/lib/token_trace.py, so each token's wait splits into the
    worker and the control plane's read, the handler's wake-up, and the write to the client.

    ``pin``: the control plane gets the last CPU to itself; the worker and this client (the
    fleet's load generator, at a lower priority) share the others. It shows what one process
    carries on a core of its own, which a shared 2-core machine otherwise hides."""
    tokens = int(rate * seconds)
    step = 1.0 / rate
    trace = tmp / f"trace-{streams}.json"
    srv = ServerProcess.trioserve(tmp, engine="fake", fake_script=_script(tmp, tokens), trace=trace,
                                  max_context=tokens + 256, slots=streams, queue_depth=streams,
                                  max_connections=streams + 16,
                                  worker_args=f"--token-delay-ms {step * 1000:g} --batch-tokens {max(512, 2 * streams)}")
    results: dict[str, list[tuple[float, int]]] = {}
    own_cpus = os.sched_getaffinity(0)
    try:
        await srv.wait_ready()
        if pin:
            server_cpu = max(own_cpus)
            others = own_cpus - {server_cpu}
            if not others or srv.worker_pid is None:
                raise SystemExit("--pin needs two CPUs and one worker")
            _pin(srv.pid, {server_cpu})
            _pin(srv.worker_pid, others)
            _pin(os.getpid(), others)
            # The client yields to the worker it shares a CPU with: a step the client's
            # bursts delayed would read as the control plane's lag.
            os.setpriority(os.PRIO_PROCESS, 0, 10)
        await _stream(srv.port, _body(8))  # warm-up

        async def one(i: int) -> None:
            body = _body(tokens)
            body["messages"][0]["content"] = f"go, stream {i}"
            results[f"stream {i}"] = await _stream(srv.port, body)

        c0, t0, client0 = cpu_seconds(srv.pid), time.perf_counter(), time.process_time()
        async with trio.open_nursery() as nursery:
            for i in range(streams):
                nursery.start_soon(one, i)
        wall = time.perf_counter() - t0
        cpu = cpu_seconds(srv.pid) - c0
        client_cores = (time.process_time() - client0) / wall
    finally:
        srv.stop()
        if pin:
            _pin(os.getpid(), own_cpus)
            os.setpriority(os.PRIO_PROCESS, 0, 0)
    lags: list[float] = []
    firsts, lasts = [], []
    for arrivals in results.values():
        first, seen = arrivals[0][0], 0
        firsts.append(first)
        lasts.append(arrivals[-1][0])
        for at, n in arrivals:
            behind = (at - first) / step
            lags += [behind - k for k in range(seen, seen + n)]
            seen += n
    # Delivered rate while every stream decodes: from the last stream's first token to
    # the first stream's last (all streams when they overlap; else the whole span).
    lo, hi = max(firsts), min(lasts)
    if hi - lo < step * 10:
        lo, hi = min(firsts), max(lasts)
    delivered = sum(n for a in results.values() for at, n in a if lo <= at <= hi)
    return {"streams": streams, "rate": rate, "nominal_tok_s": streams * rate,
            "delivered_tok_s": delivered / (hi - lo), "cp_cores": cpu / wall,
            "cp_us_per_token": cpu / max(1, sum(n for a in results.values() for _, n in a)) * 1e6,
            "client_cores": client_cores, "pinned": pin, "first_token_spread_s": max(firsts) - min(firsts),
            "lag_p50_steps": percentile(lags, 50), "lag_p99_steps": percentile(lags, 99),
            "tokens_per_stream": tokens, **_where_tokens_wait(trace, results, step)}


def _per_token(chunks: list[tuple[float, int]]) -> list[float]:
    """Each token's time, from ``(time, tokens)`` chunks."""
    return [t for t, n in chunks for _ in range(n)]


def _where_tokens_wait(trace: Path, results: dict[str, list[tuple[float, int]]],
                       step: float) -> dict[str, Any]:
    """Each token's wait, split at the control plane's read of the worker's pipe (``push``)
    and the handler's wake-up (``take``), from the server's trace and the client's arrivals:

    * ``read lag`` (steps): how far the read of token k is behind the stream's first read
      plus k steps: the worker's own drift (its step takes the delay plus its work) and
      any delay of the reader.
    * ``wake`` (ms): read → the handler took the text (the handler's wake-up).
    * ``write`` (ms): taken → the client read it (SSE encoding, h11, the socket, the client).
    * ``worker step`` (ms): the mean time between a stream's reads, first to last.
    """
    try:
        traced = json.loads(trace.read_text())
    except (OSError, ValueError):
        return {}
    start, end = min(a[0][0] for a in results.values()), max(a[-1][0] for a in results.values())
    pauses = [(g, seconds) for g, at, seconds in traced.get("_gc", []) if start <= at <= end]
    read_lag: list[float] = []
    wake: list[float] = []
    write: list[float] = []
    periods: list[float] = []
    for marker, arrivals in results.items():
        found = traced.get(marker)
        if not found or not found["push"]:
            continue
        pushes, takes, client = found["push"], _per_token(found["take"]), _per_token(arrivals)
        n = min(len(pushes), len(takes), len(client))
        read_lag += [(pushes[k] - pushes[0]) / step - k for k in range(n)]
        wake += [(takes[k] - pushes[k]) * 1000 for k in range(n)]
        write += [(client[k] - takes[k]) * 1000 for k in range(n)]
        if n > 1:
            periods.append((pushes[n - 1] - pushes[0]) / (n - 1) * 1000)
    if not read_lag:
        return {}
    return {"read_lag_p50_steps": percentile(read_lag, 50), "read_lag_p99_steps": percentile(read_lag, 99),
            "wake_ms_p50": percentile(wake, 50), "wake_ms_p99": percentile(wake, 99),
            "write_ms_p50": percentile(write, 50), "write_ms_p99": percentile(write, 99),
            "worker_step_ms": percentile(periods, 50), "step_ms": step * 1000,
            "gc_passes": len(pauses), "gc_full_passes": sum(1 for g, _ in pauses if g == 2),
            "gc_max_ms": max((seconds for _, seconds in pauses), default=0.0) * 1000}


def report(res: dict[str, Any]) -> str:
    m = res["machine"]
    lines = [BEGIN, "## The token path (bench/token_path_bench.py)", "",
             f"{res['date']}, {m['cpu']}, {m['cores']} cores, Python {m['python']}, load "
             f"{res['load']} (1-min average at the start; the machine is shared).", ""]
    pt = res.get("per_token")
    if pt:
        lines += ["| one stream, fake engine | median | min | max |", "|---|---|---|---|",
                  f"| control-plane CPU µs per streamed token ({pt['tokens']} tokens, {pt['step_ms']:g} ms steps) | "
                  f"{pt['cpu_us_per_token']['median']:.0f} | {pt['cpu_us_per_token']['min']:.0f} | "
                  f"{pt['cpu_us_per_token']['max']:.0f} |",
                  f"| reads with content per token (1.0: one event per token) | {pt['reads_per_token']['median']:.2f} | "
                  f"{pt['reads_per_token']['min']:.2f} | {pt['reads_per_token']['max']:.2f} |", ""]
    prof = res.get("profile")
    if prof and pt:
        total = pt["cpu_us_per_token"]["median"]
        lines += ["| stage (cProfile, one stream) | share | ≈ µs per token |", "|---|---|---|"]
        lines += [f"| {stage} | {share * 100:.1f} % | {share * total:.0f} |" for stage, share in prof.items()]
        lines += [""]
    floors = res.get("floor")
    if floors:
        def cell(s: dict[str, float]) -> str:
            return f"{s['median']:.0f} ({s['min']:.0f}–{s['max']:.0f})"
        lines += ["| one stream, one event per token: step ms (tokens) | trioserve, control-plane µs per token | "
                  "trio relay, one task µs | trio relay, two tasks µs | bare epoll relay µs | "
                  "trioserve above the two-task relay µs |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['step_ms']:g} ({r['tokens']}) | {cell(r['trioserve'])} | {cell(r['trio'])} | "
                  f"{cell(r['trio2'])} | {cell(r['epoll'])} | {r['trioserve']['median'] - r['trio2']['median']:.0f} |"
                  for r in floors]
        lines += [""]
    rows = res.get("fleet") or []
    if rows:
        lines += ["| fleet (fake engine, batched steps) | nominal tok/s | delivered tok/s | control-plane cores | "
                  "client cores | first tokens spread (s) | control-plane µs per token | lag p50 (steps) | "
                  "lag p99 (steps) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['streams']} streams × {r['rate']:g} tok/s ({r['tokens_per_stream']} tokens each"
                  f"{', control plane pinned to its own CPU' if r.get('pinned') else ''}) | "
                  f"{r['nominal_tok_s']:.0f} | {r['delivered_tok_s']:.0f} | {r['cp_cores']:.2f} | "
                  f"{r['client_cores']:.2f} | {r['first_token_spread_s']:.2f} | {r['cp_us_per_token']:.0f} | "
                  f"{r['lag_p50_steps']:.1f} | {r['lag_p99_steps']:.1f} |" for r in rows]
        lines += [""]
        waits = [r for r in rows if "read_lag_p50_steps" in r]
        if waits:
            lines += ["| where a token waits (fleet) | step ms (nominal / worker's) | read lag p50 / p99 (steps) | "
                      "read → handler ms p50 / p99 | handler → client ms p50 / p99 | "
                      "garbage collector: passes (full) / longest ms |", "|---|---|---|---|---|---|"]
            lines += [f"| {r['streams']} streams × {r['rate']:g} tok/s | {r['step_ms']:g} / {r['worker_step_ms']:.2f} | "
                      f"{r['read_lag_p50_steps']:.1f} / {r['read_lag_p99_steps']:.1f} | "
                      f"{r['wake_ms_p50']:.2f} / {r['wake_ms_p99']:.2f} | "
                      f"{r['write_ms_p50']:.2f} / {r['write_ms_p99']:.2f} | "
                      f"{r.get('gc_passes', 0)} ({r.get('gc_full_passes', 0)}) / {r.get('gc_max_ms', 0.0):.1f} |"
                      for r in waits]
            lines += [""]
    lines.append(END)
    return "\n".join(lines)


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine(), "date": datetime.date.today().isoformat(),
                           "load": f"{os.getloadavg()[0]:.1f}"}
    tokens = 500 if args.quick else 2000
    res["per_token"] = await per_token(tmp, args.runs, tokens, 2.0)
    if args.profile:
        res["profile"] = await profile(tmp, tokens, 2.0)
    if args.floor:
        res["floor"] = await floor(tmp, args.runs, tokens)
    if args.fleet:
        seconds = 2.0 if args.quick else 4.0
        res["fleet"] = [await fleet(tmp, 256, 50, seconds, args.pin), await fleet(tmp, 64, 200, seconds, args.pin)]
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens, shorter fleets")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also the profile by stage")
    parser.add_argument("--floor", action="store_true",
                        help="also one stream at 2/10/30 ms steps beside a bare trio and epoll relay")
    parser.add_argument("--fleet", action="store_true", help="also the GPU-rate fleets")
    parser.add_argument("--pin", action="store_true",
                        help="fleets: the control plane on a CPU of its own, worker and client on the rest")
    parser.add_argument("--out", type=Path, default=None, help="write the section into this markdown file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = trio.run(run, args, Path(tmp))
    text = report(res)
    print(text)
    if args.out is not None:
        replace_section(args.out, BEGIN, END, text)
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
