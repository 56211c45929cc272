"""Resume benchmark: does an agent's next turn prefill only what is new?

A 10-turn agent transcript — a long system prompt describing tools, then turns that grow the
history with the model's own replies and tool results — is played against:

* ``trioserve keyed``: every turn names the session (``prompt_cache_key``);
* ``trioserve anonymous``: no key (the worker's longest-common-prefix slot choice);
* ``llama-server``: llama.cpp's server, same model, same threads, ``-np 4`` slots,
  ``--ctx-size`` 4 × 4096, ``cache_prompt`` on;
* with ``--pte PATH`` also ``executorch keyed`` and ``executorch anonymous``: the same
  transcripts on the ExecuTorch engine (4 slots on one load of that program, e.g. the SmolLM2
  ``.pte`` of scripts/executorch/export_smollm2_pte.py, tokenizer.json beside it), side by side
  with the llama.cpp engine on the GGUF, and its restore vs re-prefill on a session that fits
  the program's context.

Each turn is streamed with usage; TTFT is request → first content byte. Figures:

* ``reused_fraction``: cached tokens ÷ (previous turn's prompt + completion tokens), per turn
  2..10 (min and mean reported; target ≥ 0.9);
* ``ttft_last_vs_first``: TTFT of turn 10 ÷ turn 1 (keyed; target ≤ 2);
* ``ttft_sum_vs_llama_server``: Σ TTFT keyed ÷ Σ TTFT llama-server (target ≤ 1.0);
* ``restore_ms`` vs ``reprefill_ms``: a ~3,000-token session evicted from its slot (spilled),
  then resumed — the worker's time to load its state back — against prefilling the same
  prompt from nothing (target: restore ≤ 0.1 × re-prefill).

Timings are wall clock on a shared machine: read them as indications. Prints tables; the last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib.client import sse_events
from bench.lib.machine import machine
from bench.lib.servers import free_port, running_server
from trioserve.config import EMBEDDED_MODEL_ID, Settings

LLAMA_SERVER = "/work/llama-server-build/bin/llama-server"

TOOLS_TEXT = "\n".join(
    f"- {name}({args}): {doc}" for name, args, doc in [
        ("get_weather", "city: string", "current weather, temperature in Celsius and wind for a city"),
        ("search_docs", "query: string, limit: integer", "full-text search over the team wiki; "
         "returns titles, dates and short excerpts"),
        ("book_hotel", "city: string, nights: integer, budget: number",
         "reserves a hotel room within a nightly budget and returns a confirmation code"),
        ("convert_currency", "amount: number, from: string, to: string",
         "converts money at today's rate"),
        ("list_flights", "origin: string, destination: string, date: string",
         "direct and one-stop flights with times and prices"),
        ("send_message", "to: string, text: string", "sends a chat message to a colleague"),
    ])
SYSTEM = (
    "You are the planning assistant of a small travel team. You answer briefly and precisely. "
    "When a question needs live data, write one line `CALL name(arguments)` and wait for the "
    "tool result, which the user pastes back as `RESULT name: ...`. Never invent results. "
    "Keep answers under three sentences. Available tools:\n" + TOOLS_TEXT + "\n"
    "Rules: prefer direct flights; keep hotel budgets under 180 EUR per night; confirm every "
    "booking with the code the tool returns; write dates as YYYY-MM-DD; convert prices to EUR. "
) * 2

USER_TURNS = [
    "We need to plan a trip to Lisbon for three people next month. Where do we start?",
    "RESULT list_flights: TP1234 Paris-Lisbon 08:05-09:45 direct 142 EUR; AF7890 10:20-12:00 direct 168 EUR",
    "Which flight is better for a morning meeting at 11:00?",
    "RESULT get_weather: Lisbon 21 C, light wind, clear sky",
    "Good. Now find a hotel near the river for four nights.",
    "RESULT book_hotel: Hotel Ribeira, 4 nights, 156 EUR per night, confirmation RB-5521",
    "Convert the total hotel cost to US dollars.",
    "RESULT convert_currency: 624 EUR = 676 USD",
    "Write a short message to Ana with the flight and the hotel.",
    "Thanks. Summarize the whole plan in three bullet points.",
]


async def stream_turn(client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed turn: TTFT (to the first content byte), text and usage."""
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    timings: dict[str, Any] | None = None
    async for event in sse_events(client, body):
        for choice in event.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(text)
        usage = event.get("usage") or usage
        timings = event.get("timings") or timings
    total = time.perf_counter() - t0
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None and timings is not None:
        cached = timings.get("cache_n")
    return {"ttft_ms": 1000 * (ttft if ttft is not None else total), "total_ms": 1000 * total,
            "text": "".join(parts), "prompt_tokens": usage.get("prompt_tokens", 0),
            "completion_tokens": usage.get("completion_tokens", 0), "cached_tokens": cached or 0}


async def play_transcript(base_url: str, model: str, max_tokens: int,
                          extra: dict[str, Any]) -> list[dict[str, Any]]:
    """The 10 turns; each appends the model's own reply to the history. ``extra`` holds the
    server-specific body fields (a session key, llama.cpp's ``cache_prompt``)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
    turns = []
    # A new connection per turn (no keep-alive): reusing a connection the server is closing
    # fails with "Server disconnected" (llama-server closes idle connections).
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        for user in USER_TURNS:
            messages.append({"role": "user", "content": user})
            body: dict[str, Any] = {"model": model, "messages": messages, "temperature": 0,
                                    "max_tokens": max_tokens, "stream": True,
                                    "stream_options": {"include_usage": True}, **extra}
            turn = await stream_turn(client, body)
            turns.append(turn)
            messages.append({"role": "assistant", "content": turn["text"]})
    return turns


def fractions(turns: list[dict[str, Any]]) -> list[float]:
    return [t["cached_tokens"] / max(1, p["prompt_tokens"] + p["completion_tokens"])
            for p, t in zip(turns, turns[1:])]


def mode_summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    f = fractions(turns)
    return {"reused_fraction_min": round(min(f), 3), "reused_fraction_mean": round(sum(f) / len(f), 3),
            "ttft_first_ms": round(turns[0]["ttft_ms"], 1), "ttft_last_ms": round(turns[-1]["ttft_ms"], 1),
            "ttft_sum_ms": round(sum(t["ttft_ms"] for t in turns), 1),
            "ttft_last_vs_first": round(turns[-1]["ttft_ms"] / turns[0]["ttft_ms"], 3),
            "prompt_tokens_last": turns[-1]["prompt_tokens"]}


def worker_bin() -> str:
    override = os.environ.get("TRIOSERVE_WORKER_DIR")
    return str(Path(override) / "trioserve-llama-worker") if override else ""


async def trioserve_transcript(settings: dict[str, Any], keyed: bool, max_tokens: int,
                               model: str = EMBEDDED_MODEL_ID) -> list[dict[str, Any]]:
    async with running_server(**settings) as server:
        extra = {"prompt_cache_key": "bench-agent"} if keyed else {}
        return await play_transcript(server.url, model, max_tokens, extra)


async def llama_server_transcript(model_path: str, threads: int, max_tokens: int) -> list[dict[str, Any]]:
    port = free_port()
    cmd = [LLAMA_SERVER, "-m", model_path, "-t", str(threads), "-np", "4", "--ctx-size", str(4 * 4096),
           "--cache-prompt", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    log = open("/tmp/resume_bench_llama_server.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        with trio.fail_after(120):
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"llama-server exited with {proc.returncode} (see the log)")
                try:
                    async with httpx.AsyncClient(timeout=2) as c:
                        if (await c.get(url + "/health")).status_code == 200:
                            break
                except httpx.HTTPError:
                    pass
                await trio.sleep(0.3)
        return await play_transcript(url, "model", max_tokens, {"cache_prompt": True})
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


async def restore_vs_reprefill(settings: dict[str, Any], model: str = EMBEDDED_MODEL_ID,
                               notes: int = 620) -> dict[str, Any]:
    """A ~3,000-token session (``notes`` 620) is evicted (spilled) by three others and resumed;
    compare the worker's restore time with prefilling the same prompt in a fresh session."""
    words = " ".join(f"note{i} alpha" for i in range(notes))  # 620: ~3,000 tokens (SmolLM2: a token per digit)
    long_msgs = [{"role": "user", "content": "Remember these notes: " + words}]
    async with running_server(**settings) as server:
        runtime = server.quart_app.services.default.pool
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as client:
            async def post(messages: list[dict[str, Any]], key: str) -> dict[str, Any]:
                resp = await client.post("/v1/chat/completions", json={
                    "model": model, "messages": messages, "max_tokens": 2,
                    "temperature": 0, "prompt_cache_key": key})
                if resp.status_code != 200:
                    raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
                return [r for r in runtime.history if r.get("session_id") == key][-1]

            first = await post(long_msgs, "long")
            for i in range(3):  # capacity 4 → 3 bindable slots: the third evicts "long"
                await post([{"role": "user", "content": f"short session {i}"}], f"short{i}")
            follow = long_msgs + [{"role": "assistant", "content": "ok"},
                                  {"role": "user", "content": "Thanks."}]
            resumed = await post(follow, "long")
            fresh = await post(long_msgs, "fresh")  # same prompt, nothing resident
    return {"session_tokens": first["prompt_tokens"], "plan": resumed.get("prefill_plan"),
            "restored_tokens": resumed.get("restored_prompt_tokens", 0),
            "restore_ms": round(float(resumed.get("restore_ms", float("nan"))), 2),
            "reprefill_ms": round(float(fresh["prefill_ms"]), 1),
            "resumed_prefill_ms": round(float(resumed["prefill_ms"]), 1),
            "resumed_reused": resumed["reused_prompt_tokens"]}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    # Generous liveness deadlines: on a loaded shared CPU one 512-token prefill step can take
    # longer than the default 30 s stall window.
    settings = dict(engine="llama", worker_bin=worker_bin(), threads=args.threads, max_context=4096,
                    stall_timeout=300.0, health_timeout=120.0)
    model_path = Settings(**settings).resolved_model_path()
    results: dict[str, Any] = {}
    modes: dict[str, list[dict[str, Any]]] = {}
    restore = await restore_vs_reprefill(settings)
    print("restore vs re-prefill:", restore, flush=True)
    modes["trioserve_keyed"] = await trioserve_transcript(settings, True, args.max_tokens)
    modes["trioserve_anonymous"] = await trioserve_transcript(settings, False, args.max_tokens)
    et_restore = None
    if args.pte:
        pte = Path(args.pte)
        et_settings = dict(engine="executorch", model_path=str(pte), tokenizer_path=str(pte.parent / "tokenizer.json"),
                           threads=args.threads, slots=4, stall_timeout=300.0, health_timeout=120.0)
        if os.environ.get("TRIOSERVE_WORKER_DIR"):
            et_settings["worker_bin"] = str(Path(os.environ["TRIOSERVE_WORKER_DIR"]) / "trioserve-executorch-worker")
        # The exported program's context is 2,048 tokens: a ~1,700-token session.
        et_restore = await restore_vs_reprefill(et_settings, pte.stem, notes=340)
        print("executorch restore vs re-prefill:", et_restore, flush=True)
        modes["executorch_keyed"] = await trioserve_transcript(et_settings, True, args.max_tokens, pte.stem)
        modes["executorch_anonymous"] = await trioserve_transcript(et_settings, False, args.max_tokens, pte.stem)
    for name, turns in modes.items():
        print(name, mode_summary(turns), flush=True)
    llama_error = None
    if shutil.which(LLAMA_SERVER) and not args.no_llama_server:
        for attempt in range(2):  # the shared machine has killed it once; retry once
            try:
                modes["llama_server"] = await llama_server_transcript(model_path, args.threads,
                                                                      args.max_tokens)
                llama_error = None
                break
            except (RuntimeError, httpx.HTTPError) as exc:
                llama_error = f"attempt {attempt + 1}: {exc!r}"
                print("llama-server run failed:", llama_error, flush=True)
    print(f"{'turn':>4} " + " ".join(f"{m + ' ttft/cached/prompt':>38}" for m in modes))
    for i in range(len(USER_TURNS)):
        cells = [f"{t[i]['ttft_ms']:>12.0f} ms {t[i]['cached_tokens']:>8} {t[i]['prompt_tokens']:>8}"
                 for t in modes.values()]
        print(f"{i + 1:>4} " + " ".join(f"{c:>38}" for c in cells))
    for name, turns in modes.items():
        results[name] = mode_summary(turns)
        print(name, results[name])
    keyed = results["trioserve_keyed"]
    figures = {
        "reused_fraction": keyed["reused_fraction_min"],
        "reused_fraction_mean": keyed["reused_fraction_mean"],
        "reused_fraction_anonymous": results["trioserve_anonymous"]["reused_fraction_min"],
        "ttft_last_vs_first": keyed["ttft_last_vs_first"],
        "ttft_sum_vs_llama_server": (round(keyed["ttft_sum_ms"] / results["llama_server"]["ttft_sum_ms"], 3)
                                     if "llama_server" in results else None),
        "restore_ms": restore["restore_ms"],
        "reprefill_ms": restore["reprefill_ms"],
        "restore_vs_reprefill": round(restore["restore_ms"] / restore["reprefill_ms"], 4),
    }
    if et_restore is not None:
        figures["executorch_restore_vs_reprefill"] = round(et_restore["restore_ms"] / et_restore["reprefill_ms"], 4)
        figures["executorch_ttft_sum_vs_llama_engine"] = round(
            results["executorch_keyed"]["ttft_sum_ms"] / keyed["ttft_sum_ms"], 3)
    return {"bench": "resume", "figures": figures, "llama_server_error": llama_error, "modes": results, "restore": restore,
            "executorch_restore": et_restore,
            "threads": args.threads, "max_tokens": args.max_tokens, "machine": machine()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--pte", default=None, help="also run the transcripts on the ExecuTorch engine with this .pte")
    out = trio.run(main, ap.parse_args())
    print(json.dumps(out))
