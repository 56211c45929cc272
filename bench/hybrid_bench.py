"""Hybrid-model sessions side by side with llama-server (issue #48 item 5), on the synthetic
Qwen3.5-MoE (Gated DeltaNet recurrent layers + attention layers; testkit/quantize.py makes and
caches it outside the repository).

    python -m bench.hybrid_bench --llama-server PATH [--params 100000000] [--type F16]
                                 [--threads N] [--turns 8]

Two workloads, each played against trioserve (sessions keyed with ``x-session-id``) and
llama-server (same GGUF, threads, 4 slots of 4,096 tokens; ``cache_prompt`` on; its context
checkpoints at their defaults, which this build makes at user-message starts and near the end
of each prompt, and its host-memory prompt cache on):

* ``transcript``: a thinking agent's turns on a long system prompt. The model thinks (the
  template opens ``<think>``), the client sends back only the answer — what Qwen3.5's template
  does with earlier turns' reasoning — so every turn's prompt leaves the slot's state right
  where the previous answer began; a recurrent state cannot be cut back there.
* ``shared``: 4 sessions whose first requests share a ~2k-token system prompt, one after another.
* ``fan-out``: 4 sessions on another shared system prompt sent at once (an agent starting
  parallel sub-agents): TTFT of each, prefilled tokens in all.

Per turn and per session: prompt tokens, tokens reused, TTFT (request to the first streamed
byte of reasoning or content); sums; the checkpoint memory each server reports (trioserve:
``/metrics``; llama-server: the checkpoint sizes its log prints). Random weights: what the
model says is never read. Never asserts on time; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib.client import sse_events
from bench.lib.machine import LLAMA_SERVER_ENV, machine
from bench.lib.servers import ServerProcess, http_get
from bench.lib.workers import engine_env, worker_bin
from bench.peers_bench import model_id, table
from bench.resume_bench import SYSTEM, TOOLS_TEXT, USER_TURNS
from testkit.quantize import DEFAULT_CACHE, quantized

CTX, SLOTS = 4096, 4
# ~1.4k tokens with the synthetic models' tokenizer; not a prefix of the transcript's, so the
# second workload starts cold on both servers.
SHARED_SYSTEM = "Team handbook.\n" + (SYSTEM + "\n" + TOOLS_TEXT + "\n") * 2


async def turn(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: TTFT to the first reasoning or content byte, and usage."""
    t0 = time.perf_counter()
    ttft, usage, timings = None, {}, {}
    async for event in sse_events(client, {**body, "stream": True, "stream_options": {"include_usage": True}}):
        for choice in event.get("choices") or []:
            delta = choice.get("delta") or {}
            if ttft is None and (delta.get("content") or delta.get("reasoning_content")):
                ttft = time.perf_counter() - t0
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n", 0)
    return {"ttft_ms": round(1000 * (ttft if ttft is not None else time.perf_counter() - t0), 1),
            "prompt_tokens": usage.get("prompt_tokens", 0), "cached_tokens": cached}


async def transcript(url: str, model: str, turns: int, keyed: bool, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The agent's turns, its session named by a header on trioserve (every harness sends one)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM + "\n" + TOOLS_TEXT}]
    out = []
    headers = {"x-session-id": "agent"} if keyed else {}
    async with httpx.AsyncClient(base_url=url, timeout=900, headers=headers,
                                 limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for n, user in enumerate(USER_TURNS[:turns]):
            messages.append({"role": "user", "content": user})
            out.append(await turn(c, {"model": model, "messages": messages, "temperature": 0, "max_tokens": 16,
                                      **extra}))
            # The answer only: the reasoning the model wrote is not sent back.
            messages.append({"role": "assistant", "content": f"Done with step {n + 1}."})
    return out


async def shared(url: str, model: str, keyed: bool, extra: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=httpx.Limits(max_keepalive_connections=0)) as c:
        for s in range(4):
            if keyed:
                c.headers["x-session-id"] = f"shared-{s}"
            out.append(await turn(c, {"model": model, "temperature": 0, "max_tokens": 16, **extra, "messages": [
                {"role": "system", "content": SHARED_SYSTEM},
                {"role": "user", "content": f"Session {s}: {USER_TURNS[s]}"}]}))
    return out


async def fan_out(url: str, model: str, keyed: bool, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """4 sessions at once on a system prompt neither server has seen (sub-agents started together)."""
    system = "Sub-agent handbook.\n" + (TOOLS_TEXT + "\n" + SYSTEM + "\n") * 2
    out: list[dict[str, Any]] = [{} for _ in range(4)]

    async def one(s: int) -> None:
        headers = {"x-session-id": f"fan-{s}"} if keyed else {}
        async with httpx.AsyncClient(base_url=url, timeout=900, headers=headers) as c:
            out[s] = await turn(c, {"model": model, "temperature": 0, "max_tokens": 16, **extra, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Sub-agent {s}: {USER_TURNS[s + 4]}"}]})

    async with trio.open_nursery() as nursery:
        for s in range(4):
            nursery.start_soon(one, s)
    return out


async def checkpoint_bytes_trioserve(port: int) -> str:
    status, body = await http_get(port, "/metrics")
    found = [line for line in body.decode().splitlines() if "checkpoint" in line and not line.startswith("#")]
    return "; ".join(found) or "not reported"


def checkpoint_mib_llama_server(log: Any) -> str:
    sizes = [float(m) for m in re.findall(r"created context checkpoint .*?size = ([\d.]+) MiB", Path(log.name).read_text(errors="replace"))]
    return f"{len(sizes)} checkpoints made, {sum(sizes):.1f} MiB in all (largest {max(sizes, default=0):.2f} MiB)"


async def run(args: argparse.Namespace, tmp: Path, model: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in ("trioserve", "llama-server"):
        srv = (ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=CTX,
                                       slots=SLOTS, worker_bin=worker_bin(), speculative="off")
               if name == "trioserve" else
               ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, SLOTS * CTX, SLOTS,
                                          env=engine_env()))
        try:
            await srv.wait_ready(timeout=900)
            url = f"http://127.0.0.1:{srv.port}"
            keyed = name == "trioserve"
            mid = await model_id(srv) if keyed else "x"
            extra = {} if keyed else {"cache_prompt": True}
            t = await transcript(url, mid, args.turns, keyed, extra)
            s = await shared(url, mid, keyed, extra)
            f = await fan_out(url, mid, keyed, extra)
            memory = await checkpoint_bytes_trioserve(srv.port) if keyed else checkpoint_mib_llama_server(srv.log)
        finally:
            srv.stop()
        result[name] = {"transcript": t, "shared": s, "fan-out": f, "checkpoint_memory": memory}
    return result


def report(result: dict[str, Any]) -> str:
    parts = []
    for work in ("transcript", "shared", "fan-out"):
        ts, ls = result["trioserve"][work], result["llama-server"][work]
        rows = [{"#": i + 1, "prompt tokens": a["prompt_tokens"],
                 "reused: trioserve / llama-server": f"{a['cached_tokens']} / {b['cached_tokens']}",
                 "prefilled: trioserve / llama-server": f"{a['prompt_tokens'] - a['cached_tokens']} / "
                                                        f"{b['prompt_tokens'] - b['cached_tokens']}",
                 "TTFT ms: trioserve / llama-server": f"{a['ttft_ms']} / {b['ttft_ms']}"} for i, (a, b) in enumerate(zip(ts, ls))]
        rows.append({"#": "sum", "prefilled: trioserve / llama-server":
                     f"{sum(a['prompt_tokens'] - a['cached_tokens'] for a in ts)} / "
                     f"{sum(b['prompt_tokens'] - b['cached_tokens'] for b in ls)}",
                     "TTFT ms: trioserve / llama-server":
                     f"{round(sum(a['ttft_ms'] for a in ts), 1)} / {round(sum(b['ttft_ms'] for b in ls), 1)}"})
        parts.append(f"**{work}**\n\n" + table(rows, ["#", "prompt tokens", "reused: trioserve / llama-server",
                                                     "prefilled: trioserve / llama-server",
                                                     "TTFT ms: trioserve / llama-server"]))
    parts.append(f"Checkpoint memory: trioserve `{result['trioserve']['checkpoint_memory']}`; llama-server: "
                 f"{result['llama-server']['checkpoint_memory']}")
    return "\n\n".join(parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV))
    ap.add_argument("--params", type=int, default=100_000_000)
    ap.add_argument("--type", default="F16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    args = ap.parse_args()
    if not args.llama_server:
        raise SystemExit(f"llama-server is needed: --llama-server or ${LLAMA_SERVER_ENV}")
    model = quantized("qwen35moe", args.params, args.type, Path(args.cache))
    with tempfile.TemporaryDirectory() as d:
        result = trio.run(run, args, Path(d), model)
    m = machine()
    print(f"Generated by `python -m bench.hybrid_bench --params {args.params} --type {args.type}` ({model.name}), "
          f"{args.threads} thread(s), {m['cores']} cores, {m['cpu']}:\n")
    print(report(result))
    print(json.dumps({"bench": "hybrid", "model": model.name, "machine": m, **result}))


if __name__ == "__main__":
    main()
