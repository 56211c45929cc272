"""Worker pool benchmark: aggregate streamed tok/s of ``--workers 2`` versus 1 (fake engine).

    python -m bench.pool_bench [--runs 3] [--streams 8] [--tokens 400] [--delay-ms 2]

Two workloads, each with 1 and 2 workers, ``--streams`` concurrent anonymous streams:

* **model-bound**: the fake worker spends ``--delay-ms`` per decode step (a stand-in for a
  model), so one worker's slots bound the rate; a second worker doubles the slots and the
  steps running at once. The ratio says whether the control plane keeps up with two workers
  (the issue's target: ≥ 1.8×).
* **control plane**: zero delay, so the server's own HTTP/SSE path is the bottleneck; a second
  worker cannot help there (on a 2-core machine it competes for the same CPUs).

Each figure is the median of ``--runs`` runs (min–max beside it). Servers are separate
processes (bench.lib.servers.ServerProcess); the client is a raw socket. Prints a markdown table
and a final JSON line. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

from bench.lib.client import stream_chat
from bench.lib.machine import machine
from bench.lib.servers import ServerProcess
from bench.lib.stats import summary


async def aggregate_tok_s(tmp: Path, *, workers: int, runs: int, streams: int, tokens: int,
                          delay_ms: float) -> dict[str, Any]:
    script = tmp / "script.json"
    script.write_text(json.dumps(["abcdefghij" * (tokens // 10)]))
    extra = {"worker_args": f"--token-delay-ms {delay_ms:g}"} if delay_ms > 0 else {}
    srv = ServerProcess.trioserve(tmp, engine="fake", fake_script=script, max_context=tokens + 256,
                                  queue_depth=max(16, streams), workers=workers, **extra)
    try:
        await srv.wait_ready()
        with trio.fail_after(60):  # every worker, not just the first, before timing
            while len(srv.health.get("workers", [None] * workers)) != workers or any(
                    w["status"] != "ready" for w in srv.health.get("workers", [])):
                await srv.wait_ready()
                await trio.sleep(0.05)
        body = {"model": "fake", "messages": [{"role": "user", "content": "go"}]}
        await stream_chat(srv.port, body)  # warm-up
        rates = []
        for _ in range(runs):
            results: list[dict[str, Any]] = []

            async def one() -> None:
                results.append(await stream_chat(srv.port, body))

            async with trio.open_nursery() as clients:
                for _ in range(streams):
                    clients.start_soon(one)
            total = sum(r["completion_tokens"] for r in results)
            wall = max(r["t_done"] for r in results) - min(r["t_sent"] for r in results)
            rates.append(total / wall)
        return summary(rates)
    finally:
        srv.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    res: dict[str, Any] = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        for label, delay in (("model-bound", args.delay_ms), ("control plane", 0.0)):
            for workers in (1, 2):
                res[f"{label}/{workers}"] = await aggregate_tok_s(
                    Path(tmp), workers=workers, runs=args.runs, streams=args.streams,
                    tokens=args.tokens, delay_ms=delay)
    return res


def table(res: dict[str, Any], args: argparse.Namespace) -> list[str]:
    lines = [f"Worker pool, fake engine, {args.streams} concurrent streams of {args.tokens} tokens, "
             f"aggregate tok/s (median of {args.runs}, min–max)", "",
             "| workload | --workers 1 | --workers 2 | ratio |", "|---|---|---|---|"]
    for label in ("model-bound", "control plane"):
        one, two = res[f"{label}/1"], res[f"{label}/2"]
        name = f"{label} ({args.delay_ms:g} ms/step)" if label == "model-bound" else label
        lines.append(f"| {name} | {one['median']:.0f} ({one['min']:.0f}–{one['max']:.0f}) | "
                     f"{two['median']:.0f} ({two['min']:.0f}–{two['max']:.0f}) | "
                     f"{two['median'] / one['median']:.2f}× |")
    return lines


def run_section(runs: int, quick: bool) -> dict[str, Any]:
    """The ``pool`` section of ``python -m bench``: {"pool_bench": results, with the settings used}."""
    args = argparse.Namespace(runs=2 if quick else runs, streams=8, tokens=200 if quick else 400,
                              delay_ms=2.0)
    res = trio.run(run, args)
    return {"pool_bench": {**res, "settings": vars(args)}}


def section_table(res: dict[str, Any]) -> list[str]:
    """The table of a ``run_section`` result."""
    pool = res["pool_bench"]
    return table(pool, argparse.Namespace(**pool["settings"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--delay-ms", type=float, default=2.0)
    args = ap.parse_args(argv)
    res = trio.run(run, args)
    print("\n".join(table(res, args)))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
