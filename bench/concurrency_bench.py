"""Concurrency benchmark: trioserve's batched worker against llama.cpp's ``llama-server``.

    python -m bench --only concurrency [--quick] [--llama-server PATH]
    python -m bench.concurrency_bench [--quick] [--llama-server PATH] [--runs N]

Both servers get the same model, threads, slots and context per slot, in the same run:
trioserve ``--slots 4 --max-context 4096`` versus ``llama-server -np 4 --ctx-size 16384``
(llama-server splits its context evenly over explicit slots: 4,096 each). llama-server also gets
the OpenMP wait trioserve sets for its worker (``GOMP_SPINCOUNT``, ``Settings.worker_env``):
with libgomp's default 300,000-spin barrier wait a loaded host costs it several times its
speed (docs/benchmarks/contention.md), and this benchmark compares the servers, not
that setting.

Figures (every one measured in this run, servers interleaved run by run so drift hits both):

* ``agg_tok_s_N``: N concurrent streams (N = 1, 2, 4, 8), each a fresh long-answer prompt,
  greedy, ``max_tokens`` 128: total completion tokens actually produced (from each stream's
  usage chunk) ÷ wall time from the first request sent to the last ``[DONE]``. Median of runs.
* ``ttft_ms_p50_N``: request sent → first content byte, p50 over every stream of every run.
* ``agg_vs_llama_server_N``: trioserve ÷ llama-server, paired run by run, median.
* ``agg_4_vs_1`` (and ``llama_server_agg_4_vs_1``): each server's 4-stream ÷ its own 1-stream
  aggregate, paired run by run, median: the batching gain, which on a CPU is bounded by the
  matrix kernels (both servers run the same ones), not by the scheduler alone.
* ``gap_ms_p99_admit``: three streams are decoding when a ~3,000-token prompt arrives; the
  inter-token gaps of the three, from that request sent until its first token, p99 (and max).
  This is what a prefill costs the streams already running (step budget vs. one big batch).
* ``solo_match_4``: four prompts streamed concurrently and then each alone (greedy): how many
  concurrent outputs equal the solo output exactly (text and token count).
* ``single_stream_vs_slots1``: one stream on the 4-slot worker ÷ one stream on a 1-slot worker
  (the previous default), decode tokens/s, paired run by run (both in the 1-stream rotation),
  median.

Everything is measured client-side with a raw trio socket; the raw bytes are timestamped as
they arrive and only parsed (h11 + SSE) after the stream ends, so the client's own CPU per
event is one ``recv``. Prints a table, and one JSON line last. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import h11
import trio

from bench.lib.markdown import replace_section
from bench.lib.servers import ServerProcess, free_port, http_get
from bench.lib.stats import median, percentile
from bench.lib.workers import worker_bin
from trioserve.config import Settings
from trioserve.machine import embedded_model_path
from trioserve.worker.launch import env_for

LEVELS = (1, 2, 4, 8)
SLOTS = 4
CTX_PER_SLOT = 4096
# Prompts that make SmolLM2 write long answers at temperature 0 (ignore_eos has no trioserve
# equivalent, so the prompt has to do it; the tokens actually produced are reported).
TOPICS = ("a robot who learns to paint", "a lighthouse keeper and a storm", "a dragon who collects clocks",
          "two astronauts lost on Mars", "a baker in medieval Paris", "a cat who becomes a detective",
          "a girl who builds a boat", "a city under the sea", "an old man and his garden",
          "a musician who loses her hearing")
STORY = "Tell me a very long and detailed story about {topic} (story number {k}). Describe every scene."
MARKER_BEGIN = "<!-- concurrency:begin (bench/concurrency_bench.py) -->"
MARKER_END = "<!-- concurrency:end -->"


def story(k: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": STORY.format(topic=TOPICS[k % len(TOPICS)], k=k)}]


def long_prompt(approx_tokens: int, k: int) -> list[dict[str, str]]:
    """A user message of about ``approx_tokens`` tokens (SmolLM2's tokenizer, one token per
    digit: ~21 per numbered sentence below); the exact count comes back in ``usage.prompt_tokens``.
    ``k`` opens the message, so no repetition finds an earlier one's prefix in a prompt cache
    (both servers keep one): every admission prefills the whole prompt."""
    sentences = [f"Note {i}: the inventory of shelf {i % 97} lists {i * 7 % 1000} jars of jam."
                 for i in range(approx_tokens // 21)]
    return [{"role": "user", "content": f"Notebook {k}. Read these notes and summarise them.\n" + "\n".join(sentences)}]


# -- client -----------------------------------------------------------------------------

async def stream(port: int, body: dict[str, Any], on_chunk: Callable[[int], None] | None = None,
                 record: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed chat completion. Records (arrival time, raw bytes) per ``recv`` and parses
    afterwards. ``on_chunk(n)`` is called with the number of chunks received so far. When
    ``record`` is given, ``t_sent`` and the chunk list are kept there as they arrive, so a
    caller that cancels the stream can still parse what came (``parse``)."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    payload = json.dumps(body).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
               + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
    chunks: list[tuple[float, bytes]] = []
    sock = await trio.open_tcp_stream("127.0.0.1", port)
    async with sock:
        t_sent = time.perf_counter()
        if record is not None:
            record.update(t_sent=t_sent, chunks=chunks)
        await sock.send_all(request)
        tail = b""
        with trio.fail_after(600):
            while True:
                data = await sock.receive_some(1 << 18)
                if not data:
                    break
                chunks.append((time.perf_counter(), data))
                if on_chunk:
                    on_chunk(len(chunks))
                tail = (tail + data)[-64:]
                if b"data: [DONE]" in tail:
                    break
    return parse(t_sent, chunks)


def parse(t_sent: float, chunks: list[tuple[float, bytes]]) -> dict[str, Any]:
    """De-chunk with h11, split SSE events, time each content event by the ``recv`` that
    completed it."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="POST", target="/", headers=[("Host", "x"), ("Content-Length", "0")]))
    conn.send(h11.EndOfMessage())
    status, buf = 0, b""
    times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    finish = None
    for t, raw in chunks:
        conn.receive_data(raw)
        while True:
            ev = conn.next_event()
            if ev is h11.NEED_DATA or ev is h11.PAUSED or isinstance(ev, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
            if isinstance(ev, h11.Response):
                status = ev.status_code
            elif isinstance(ev, h11.Data):
                buf += bytes(ev.data)
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data: {"):
                    continue
                obj = json.loads(line[6:])
                if obj.get("usage"):
                    usage = obj["usage"]
                for choice in obj.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        times.append(t)
                        pieces.append(content)
        if status and status != 200:
            break
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {b''.join(c for _, c in chunks)[:400]!r}")
    t_done = chunks[-1][0]
    return {"t_sent": t_sent, "t_first": times[0] if times else t_done, "t_done": t_done, "times": times,
            "text": "".join(pieces), "completion_tokens": int(usage.get("completion_tokens", 0)),
            "prompt_tokens": int(usage.get("prompt_tokens", 0)), "finish_reason": finish}


async def burst(port: int, bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """All ``bodies`` at once; results in the same order."""
    results: list[dict[str, Any]] = [{}] * len(bodies)

    async def one(i: int) -> None:
        results[i] = await stream(port, bodies[i])

    async with trio.open_nursery() as nursery:
        for i in range(len(bodies)):
            nursery.start_soon(one, i)
    return results


async def admit_long(port: int, base: dict[str, Any], k: int, long_tokens: int) -> dict[str, Any]:
    """Three streams decoding; once each has received a few chunks, a long prompt arrives.
    Returns the running streams' inter-token gaps inside [long sent, long's first token]."""
    records: list[dict[str, Any]] = [{} for _ in range(3)]
    started = [trio.Event() for _ in range(3)]
    long_result: dict[str, Any] = {}

    async def runner(i: int) -> None:
        def seen(n: int) -> None:
            if n >= 8:
                started[i].set()
        await stream(port, {**base, "max_tokens": 1000, "messages": story(1000 + 10 * k + i)}, seen, records[i])
        started[i].set()

    async with trio.open_nursery() as nursery:
        for i in range(3):
            nursery.start_soon(runner, i)
        for e in started:
            await e.wait()
        long_result.update(await stream(port, {**base, "max_tokens": 8, "messages": long_prompt(long_tokens, k)}))
        # The running streams are only needed until the long prompt's first token (plus the
        # few tokens after it already received): stop them rather than wait for 1,000 tokens.
        nursery.cancel_scope.cancel()
    running = [parse(r["t_sent"], list(r["chunks"])) for r in records]
    lo, hi = long_result["t_sent"], long_result["t_first"]
    inside, outside = [], []
    for r in running:
        for a, b in zip(r["times"], r["times"][1:]):
            # A gap belongs to the admission window when it ends inside it or spans its end.
            (inside if lo < b and a < hi else outside).append((b - a) * 1000)
    streams_alive = sum(1 for r in running if r["times"] and r["times"][-1] > hi)
    return {"inside": inside, "outside": outside, "prefill_ms": (hi - lo) * 1000,
            "prompt_tokens": long_result["prompt_tokens"], "alive": streams_alive}


# -- servers ----------------------------------------------------------------------------

def start_servers(tmp: Path, llama_server: str | None, threads: int, with_slots1: bool) -> dict[str, Any]:

    model = embedded_model_path()
    wbin = str(worker_bin())
    servers: dict[str, Any] = {
        "trioserve": ServerProcess.trioserve(tmp, engine="llama", threads=threads, max_context=CTX_PER_SLOT,
                                             slots=SLOTS, worker_bin=wbin, queue_depth=32)}
    if with_slots1:
        servers["trioserve_slots1"] = ServerProcess.trioserve(tmp, engine="llama", threads=threads,
                                                              max_context=CTX_PER_SLOT, slots=1, worker_bin=wbin)
    if llama_server:
        port = free_port()
        argv = [llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
                "-tb", str(threads), "--ctx-size", str(CTX_PER_SLOT * SLOTS), "-np", str(SLOTS), "--jinja"]
        servers["llama_server"] = ServerProcess(argv, port, "llama-server", tmp / f"llama-server-np-{port}.log",
                                                env={**os.environ, **env_for(Settings())})
    servers["_worker_bin"] = wbin
    return servers


# -- the benchmark ------------------------------------------------------------------------

async def concurrency(tmp: Path, llama_server: str | None = None, threads: int = 2, runs: int = 5,
                      tokens: int = 128, levels: tuple[int, ...] = LEVELS, long_tokens: int = 3000,
                      match_reps: int = 2, quick: bool = False) -> dict[str, Any]:
    """Run the section; returns the flat result dict (see the module docstring for keys)."""
    servers = start_servers(tmp, llama_server, threads, with_slots1=not quick)
    wbin = servers.pop("_worker_bin")
    names = [n for n in ("trioserve", "llama_server") if n in servers]
    out: dict[str, Any] = {"conc_worker_bin": wbin, "conc_tokens": tokens, "conc_runs": runs,
                           "conc_levels": list(levels), "conc_slots": SLOTS, "conc_ctx_per_slot": CTX_PER_SLOT}
    try:
        for s in servers.values():
            await s.wait_ready()
        models: dict[str, str] = {}
        for name, s in servers.items():
            models[name] = json.loads((await http_get(s.port, "/v1/models"))[1])["data"][0]["id"]
            # Warm every slot: first-request allocations, weights paged in.
            await burst(s.port, [{"model": models[name], "temperature": 0, "max_tokens": 8,
                                  "messages": [{"role": "user", "content": f"Hi {i}"}]} for i in range(SLOTS)])

        def base(name: str) -> dict[str, Any]:
            return {"model": models[name], "temperature": 0, "max_tokens": tokens}

        agg: dict[tuple[str, int], list[float]] = {}
        ttft: dict[tuple[str, int], list[float]] = {}
        ntok: dict[tuple[str, int], list[int]] = {}
        single: dict[str, list[float]] = {}
        k = 0
        for run in range(runs):
            for n in levels:
                # One stream also on the 1-slot worker (the previous default), in the same
                # rotation, so the 4-slot ÷ 1-slot ratio pairs neighbouring runs.
                level_names = names + ["trioserve_slots1"] if n == 1 and "trioserve_slots1" in servers else names
                order = level_names if run % 2 == 0 else level_names[::-1]
                for name in order:
                    k += 1
                    bodies = [{**base(name), "messages": story(100 * k + i)} for i in range(n)]
                    rs = await burst(servers[name].port, bodies)
                    total = sum(r["completion_tokens"] for r in rs)
                    wall = max(r["t_done"] for r in rs) - min(r["t_sent"] for r in rs)
                    agg.setdefault((name, n), []).append(total / wall)
                    ttft.setdefault((name, n), []).extend((r["t_first"] - r["t_sent"]) * 1000 for r in rs)
                    ntok.setdefault((name, n), []).extend(r["completion_tokens"] for r in rs)
                    if n == 1:
                        r = rs[0]
                        single.setdefault(name, []).append((r["completion_tokens"] - 1) / (r["t_done"] - r["t_first"]))
        for name in names:
            pre = "" if name == "trioserve" else "llama_server_"
            for n in levels:
                out[f"{pre}agg_tok_s_{n}"] = median(agg[(name, n)])
                out[f"{pre}agg_tok_s_{n}_minmax"] = [min(agg[(name, n)]), max(agg[(name, n)])]
                out[f"{pre}ttft_ms_p50_{n}"] = percentile(ttft[(name, n)], 50)
                out[f"{pre}tokens_per_stream_{n}"] = [min(ntok[(name, n)]), median(ntok[(name, n)]), max(ntok[(name, n)])]
            if name in single:
                out[f"{pre}single_decode_tok_s"] = median(single[name])
        if "trioserve_slots1" in single and "trioserve" in single:
            out["slots1_single_decode_tok_s"] = median(single["trioserve_slots1"])
            out["single_stream_vs_slots1"] = median([a / b for a, b in zip(single["trioserve"],
                                                                            single["trioserve_slots1"])])
        if 1 in levels and 4 in levels:
            # Both servers' own batching gain, so a reader can tell a scheduler shortfall from
            # what this machine's CPU kernels allow anyone. Paired run by run (the 1- and
            # 4-stream bursts of one run are seconds apart), like the ratio to llama-server:
            # shared machines drift by tens of percent over minutes.
            for name in names:
                pre = "" if name == "trioserve" else "llama_server_"
                gains = [a / b for a, b in zip(agg[(name, 4)], agg[(name, 1)])]
                out[f"{pre}agg_4_vs_1"] = median(gains)
                out[f"{pre}agg_4_vs_1_minmax"] = [min(gains), max(gains)]
        if "llama_server" in servers:
            for n in levels:
                # Paired run by run (same run index, adjacent in time).
                ratios = [a / b for a, b in zip(agg[("trioserve", n)], agg[("llama_server", n)])]
                out[f"agg_vs_llama_server_{n}"] = median(ratios)
                out[f"agg_vs_llama_server_{n}_minmax"] = [min(ratios), max(ratios)]

        if long_tokens:
            for name in names:
                pre = "" if name == "trioserve" else "llama_server_"
                inside, outside, prefill, ptoks, alive = [], [], [], [], []
                for _rep in range(max(1, runs - 1)):
                    k += 1
                    a = await admit_long(servers[name].port, base(name), k, long_tokens)
                    inside += a["inside"]
                    outside += a["outside"]
                    prefill.append(a["prefill_ms"])
                    ptoks.append(a["prompt_tokens"])
                    alive.append(a["alive"])
                out[f"{pre}gap_ms_p99_admit"] = percentile(inside, 99)
                out[f"{pre}gap_ms_max_admit"] = max(inside, default=float("nan"))
                out[f"{pre}gap_ms_p50_steady"] = percentile(outside, 50)
                out[f"{pre}admit_ttft_ms"] = median(prefill)
                out[f"{pre}admit_prompt_tokens"] = ptoks[0]
                out[f"{pre}admit_streams_alive"] = min(alive)

        if match_reps:
            for name in names:
                pre = "" if name == "trioserve" else "llama_server_"
                same, total, samples, diverge = 0, 0, [], []
                for rep in range(match_reps):
                    k += 1
                    bodies = [{**base(name), "messages": story(100 * k + i)} for i in range(4)]
                    together = await burst(servers[name].port, bodies)
                    for i, body in enumerate(bodies):
                        alone = (await burst(servers[name].port, [body]))[0]
                        t = together[i]
                        equal = t["text"] == alone["text"] and t["completion_tokens"] == alone["completion_tokens"]
                        same += equal
                        total += 1
                        if not equal:
                            at = next((j for j, (x, y) in enumerate(zip(t["text"], alone["text"])) if x != y),
                                      min(len(t["text"]), len(alone["text"])))
                            diverge.append(at)
                        if rep == 0:
                            samples.append({"prompt": body["messages"][0]["content"], "tokens": t["completion_tokens"],
                                            "finish": t["finish_reason"], "equal_solo": equal, "text": t["text"]})
                out[f"{pre}solo_match_4"] = f"{same}/{total}"
                out[f"{pre}solo_match_4_diverge_chars"] = diverge
                out[f"{pre}samples_4"] = samples
    finally:
        for s in servers.values():
            s.stop()
    return out


# -- report -------------------------------------------------------------------------------

def _f(v: Any, nd: int = 1) -> str:
    if isinstance(v, float):
        return "—" if v != v else f"{v:,.{nd}f}"
    return "—" if v is None else str(v)


def table(res: dict[str, Any]) -> list[str]:
    levels = res.get("conc_levels", [])
    peer = "llama_server_agg_tok_s_1" in res
    head = "| streams | trioserve agg tok/s | " + ("llama-server agg tok/s | ratio (paired) | " if peer else "") \
        + "trioserve TTFT p50 ms | " + ("llama-server TTFT p50 ms | " if peer else "") + "tokens/stream (min/med/max) |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for n in levels:
        row = [str(n), f"{_f(res.get(f'agg_tok_s_{n}'))} ({_f(res.get(f'agg_tok_s_{n}_minmax', [None])[0])}–"
               f"{_f(res.get(f'agg_tok_s_{n}_minmax', [None, None])[1])})"]
        if peer:
            row += [f"{_f(res.get(f'llama_server_agg_tok_s_{n}'))} ({_f(res.get(f'llama_server_agg_tok_s_{n}_minmax', [None])[0])}–"
                    f"{_f(res.get(f'llama_server_agg_tok_s_{n}_minmax', [None, None])[1])})",
                    _f(res.get(f"agg_vs_llama_server_{n}"), 3)]
        row.append(_f(res.get(f"ttft_ms_p50_{n}")))
        if peer:
            row.append(_f(res.get(f"llama_server_ttft_ms_p50_{n}")))
        tps = res.get(f"tokens_per_stream_{n}")
        row.append("/".join(_f(x, 0) for x in tps) if tps else "—")
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    lines += ["| figure | trioserve | " + ("llama-server | " if peer else "") + "target | met |",
              "|---|---|" + ("---|" if peer else "") + "---|---|"]

    def row(label: str, key: str, nd: int, target: str = "", ok: Callable[[], bool] | None = None) -> None:
        if key not in res and f"llama_server_{key}" not in res:
            return
        cells = [label, _f(res.get(key), nd)]
        if peer:
            cells.append(_f(res.get(f"llama_server_{key}"), nd))
        met = ""
        if ok is not None:
            try:
                met = "yes" if ok() else "**no**"
            except (KeyError, TypeError):
                met = ""
        lines.append("| " + " | ".join(cells + [target, met]) + " |")

    row("aggregate tok/s at 4 streams ÷ llama-server (paired median)", "agg_vs_llama_server_4", 3, "≥ 1.0",
        lambda: res["agg_vs_llama_server_4"] >= 1.0)
    row("aggregate tok/s at 4 streams ÷ own 1-stream (paired median)", "agg_4_vs_1", 3, "≥ 1.3", lambda: res["agg_4_vs_1"] >= 1.3)
    row("TTFT p50 at 4 streams, ms", "ttft_ms_p50_4", 1, "≤ llama-server",
        (lambda: res["ttft_ms_p50_4"] <= res["llama_server_ttft_ms_p50_4"]) if peer else None)
    row("single-stream decode tok/s (first → last token)", "single_decode_tok_s", 1)
    row("single stream, 4-slot ÷ 1-slot worker", "single_stream_vs_slots1", 3, "≈ 1 (no worse)",
        lambda: res["single_stream_vs_slots1"] >= 0.97)
    row("inter-token gap p99 while a long prompt is admitted, ms", "gap_ms_p99_admit", 1)
    row("inter-token gap max while admitted, ms", "gap_ms_max_admit", 1)
    row("inter-token gap p50, steady decode (3 streams), ms", "gap_ms_p50_steady", 1)
    row("long prompt: tokens / TTFT ms", "admit_prompt_tokens", 0)
    row("long prompt TTFT ms (3 streams decoding)", "admit_ttft_ms", 1)
    row("4 concurrent streams equal to their solo output", "solo_match_4", 0)
    return lines


def markdown_section(res: dict[str, Any], command: str) -> str:
    load = res.get("conc_loadavg", [float("nan")] * 2)
    lines = [MARKER_BEGIN, "## Concurrency (batched worker vs llama-server)", "",
             f"`{command}`, {res.get('conc_date', '')}, {res.get('conc_elapsed_s', float('nan')):.0f} s; "
             f"load average (1 min) before / after: {load[0]:.2f} / {load[1]:.2f} "
             "(2 shared cores; other jobs may have run). Worker: `" + Path(res.get("conc_worker_bin", "")).name + "` "
             f"from `{res.get('conc_worker_bin', '')}`.", "",
             f"trioserve `--slots {SLOTS} --max-context {CTX_PER_SLOT} --threads {res.get('conc_threads', 2)}` "
             f"(default `--batch-tokens` 512) vs `llama-server -np {SLOTS} --ctx-size {SLOTS * CTX_PER_SLOT} "
             f"-t/-tb {res.get('conc_threads', 2)} --jinja` (defaults otherwise: continuous batching, "
             f"`-b 2048 -ub 512`, prompt cache on; run with trioserve's worker setting `GOMP_SPINCOUNT=1000`). Greedy, `max_tokens` {res.get('conc_tokens')}, a fresh "
             f"long-story prompt per stream; {res.get('conc_runs')} runs per level, the two servers "
             "interleaved (alternating which goes first). Aggregate tok/s = completion tokens actually "
             "produced (usage) ÷ first request sent → last `[DONE]`, median (min–max) of runs; the ratio is "
             "paired run by run. TTFT = request sent → first content byte, p50 over every stream of every run.", "",
             *table(res), ""]
    if "gap_ms_p99_admit" in res:
        lines += [f"Admission: three streams decoding (`max_tokens` 1000, stopped once the long prompt answers), then a "
                  f"{res.get('admit_prompt_tokens')}-token prompt; the gaps between the running streams' tokens from "
                  "that request sent until its first token (it needs a free slot: 3 + 1 = 4). trioserve's scheduler "
                  "gives every decoding stream its token first and fills the rest of the step budget with prefill "
                  "chunks, the budget paced so a step takes about `--step-target-ms` (default 1000 on CPU, at most "
                  "512 tokens); llama-server puts up to `-b` 2048 prompt tokens in one batch with the decodes.", ""]
    for pre, who in (("", "trioserve"), ("llama_server_", "llama-server")):
        if f"{pre}solo_match_4" not in res:
            continue
        lines += [f"Batch vs solo ({who}): {res[f'{pre}solo_match_4']} concurrent outputs (4 at once, greedy) equal the "
                  "same prompt streamed alone, text and token count"
                  + (f"; the others diverge at character {res[f'{pre}solo_match_4_diverge_chars']}"
                     if res[f"{pre}solo_match_4_diverge_chars"] else "")
                  + ". Samples (one batch of 4, first 160 characters):", ""]
        for s in res.get(f"{pre}samples_4", []):
            text = s["text"][:160].replace("\n", " ").replace("|", "\\|")
            lines.append(f"- {s['tokens']} tokens, {s['finish']}, solo-equal {s['equal_solo']}: “{text}…”")
        lines.append("")
    lines.append(MARKER_END)
    return "\n".join(lines)


def splice(path: Path, section: str) -> None:
    """Replace the concurrency section of ``path`` (between the markers), or put it before the
    raw JSON of the main report, or append it."""
    replace_section(path, MARKER_BEGIN, MARKER_END, section, before="\n<details><summary>raw JSON</summary>",
                    empty="# Benchmarks\n")


def run_section(llama_server: str | None, threads: int, quick: bool, runs: int | None = None) -> dict[str, Any]:
    """The section as ``python -m bench`` runs it: full (levels 1/2/4/8, 128 tokens, 5 runs,
    admission, solo-vs-batch) or quick (levels 1/4, 32 tokens, 1 run, no admission)."""
    started = time.monotonic()
    load0 = os.getloadavg()[0]
    # The servers run in their own sessions: turn SIGTERM (e.g. from `timeout`) into
    # KeyboardInterrupt so the finally that stops them runs instead of leaving them behind.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="trioserve-conc-") as tmpdir:
        if quick:
            res = trio.run(lambda: concurrency(Path(tmpdir), llama_server, threads, runs=runs or 1, tokens=32,
                                               levels=(1, 4), long_tokens=0, match_reps=1, quick=True))
        else:
            res = trio.run(lambda: concurrency(Path(tmpdir), llama_server, threads, runs=runs or 5))
    res["conc_loadavg"] = [load0, os.getloadavg()[0]]
    res["conc_elapsed_s"] = time.monotonic() - started
    res["conc_threads"] = threads
    res["conc_date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.concurrency_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--llama-server", default=os.environ.get("TRIOSERVE_BENCH_LLAMA_SERVER") or None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=None)
    ap.add_argument("--out", default=None, help="markdown file whose concurrency section to replace")
    args = ap.parse_args(argv)
    res = run_section(args.llama_server, args.threads, args.quick, args.runs)
    print("\n".join(table(res)))
    for pre in ("", "llama_server_"):
        for s in res.get(f"{pre}samples_4", []):
            print(f"sample {pre or 'trioserve_'}: {s['tokens']} tok {s['finish']} equal={s['equal_solo']}: {s['text'][:200]!r}")
    if args.out:
        splice(Path(args.out), markdown_section(res, "python -m bench.concurrency_bench"
                                                + (" --quick" if args.quick else "") + (" --llama-server PATH" if args.llama_server else "")))
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
