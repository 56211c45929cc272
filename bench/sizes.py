"""trioserve beside llama-server at the sizes users run (issue #51): synthetic dense and MoE
models of 0.5–4B-class, quantized as users run them, made and cached outside the repository
(testkit/quantize.py: the F16 model of testkit/synthetic_models.py, then llama.h's quantizer).

    python -m bench.sizes --llama-server PATH [--models qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M]
                          [--section decode,streams,prefill,memory] [--threads 2] [--rounds 3]
                          [--prefill-sizes 4k,16k] [--cache DIR]

Per model, the sections of ``bench.peers_bench`` on that model (same threads, slots, context
and kernel path on both servers; llama-server with its defaults otherwise, flash attention
``auto`` as trioserve's worker): ``decode`` (one stream), ``streams`` (4 and 8, aggregate),
``prefill`` (4k and 16k prompts, alone and beside a decoding stream, with that stream's longest
gap), and ``memory``: start-up time of each server and the resident memory of trioserve's
worker and of llama-server after the same requests.

Random weights: speed only. Never asserts on time; the last line printed is one JSON object.
Measure alone: nothing else running on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.lib.client import stream_chat
from bench.lib.machine import LLAMA_SERVER_ENV, machine, rss_mb
from bench.lib.servers import ServerProcess
from bench.lib.workers import engine_env, worker_bin
from bench.peers_bench import decode_section, model_id, prefill_section, streams_section, table
from testkit.quantize import DEFAULT_CACHE, quantized

SIZES = {"0.5b": 500_000_000, "1.5b": 1_500_000_000, "3b": 3_000_000_000, "4b": 4_000_000_000}
DEFAULT_MODELS = "qwen3:0.5b:Q4_K_M,qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M,qwen3:4b:Q4_K_M"


def parse_models(spec: str) -> list[tuple[str, int, str]]:
    """``arch:size:type`` items, comma-separated (size: one of SIZES or a parameter count)."""
    out = []
    for item in filter(None, spec.split(",")):
        arch, size, qtype = item.split(":")
        out.append((arch, SIZES.get(size.lower()) or int(size), qtype))
    return out


async def memory_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[dict[str, Any]]]:
    """Start-up time and resident memory of each server (one at a time) after the same four
    concurrent requests."""
    ctx, rows = 4096, []
    body = {"temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": "Tell me about the sea. " * 40}]}
    for name in ("trioserve", "llama-server"):
        t0 = time.monotonic()
        srv = (ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                       slots=4, worker_bin=worker_bin(), speculative="off") if name == "trioserve"
               else ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, 4 * ctx, 4, env=engine_env()))
        try:
            await srv.wait_ready(timeout=1800)
            ready_s = time.monotonic() - t0
            mid = (await model_id(srv)) if name == "trioserve" else "x"
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(stream_chat, srv.port, {**body, "model": mid})
            pid = srv.worker_pid if name == "trioserve" else srv.pid
            rows.append({"server": name, "ready s": round(ready_s, 1), "RSS MB": round(rss_mb(pid), 0)})
        finally:
            srv.stop()
    md = (f"Start-up (process start to /health ready) and resident memory (trioserve: its worker) after 4 "
          f"concurrent requests, 4 slots of {ctx} tokens each:\n\n" + table(rows, ["server", "ready s", "RSS MB"]))
    return md, rows


SECTIONS = {"decode": decode_section, "streams": streams_section, "prefill": prefill_section,
            "memory": memory_section}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV))
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--section", default="decode,streams,prefill,memory")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill-sizes", default="4k,16k")
    ap.add_argument("--prefill-rounds", type=int, default=1)
    ap.add_argument("--stream-rounds", type=int, default=1)
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    args = ap.parse_args()
    if not args.llama_server:
        sys.exit(f"llama-server is needed: --llama-server or ${LLAMA_SERVER_ENV}")
    # What bench.peers_bench's sections read besides the above.
    args.gemma, args.stream_interval_ms, args.train_ctx = False, 0, 32768
    result: dict[str, Any] = {"bench": "sizes", "machine": machine(), "load_start": os.getloadavg()}
    for arch, params, qtype in parse_models(args.models):
        t0 = time.monotonic()
        model = quantized(arch, params, qtype, Path(args.cache))
        made_s = time.monotonic() - t0
        key = f"{arch}-{params // 10**8 / 10:g}B-{qtype}"
        print(f"## {key}: {model.name}, {model.stat().st_size / 2**30:.2f} GiB (ready in {made_s:.0f} s)", flush=True)
        result[key] = {}
        with tempfile.TemporaryDirectory() as d:
            for s in args.section.split(","):
                md, rows = trio.run(SECTIONS[s], args, Path(d), model)
                print(f"#### {s} ({key}, {args.threads} thread(s), load {os.getloadavg()[0]:.1f})\n\n{md}\n", flush=True)
                result[key][s] = rows
    m = machine()
    print(f"Generated by `python -m bench.sizes --models {args.models}` on {datetime.date.today()}: "
          f"{m['cores']} cores, {m['cpu']}.")
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
