"""State store benchmark: a returning long agent turn cold, warm and from disk; decode with the
store on and off (spec/worker-protocol.md §6.4).

On the llama worker with the embedded model (``--threads 2``), at the worker protocol level:

* ``cold``: a worker without a store gets the returning turn (turn 1 + its reply + a short new
  user message, ``--tokens`` long) with nothing resident: TTFT of a full prefill;
* ``warm``: the worker that served turn 1 keeps the session in its slot (never restarted);
* ``from disk after restart``: a worker with the store, started after the one that served turn
  1 exited (stdin EOF: the drain wrote its state), gets the returning turn;
* ``from disk after SIGKILL``: the same after the first worker was SIGKILLed once the state
  file appeared (written while it idled).

Figures: ``ttft_ms`` (the worker's read → first token), ``reused`` (prompt tokens not
prefilled) and ``ttft / cold``. Then decode tok/s of short greedy generations in one session,
store on (a write after every turn) and off, medians of ``--decode-runs``, and the ratio.

``--health``: the same over HTTP (``trioserve serve`` on the embedded model, store on and off):
``/health`` is asked every 10 ms while keyed sessions of ``--tokens`` prompt tokens are served
and written, and a short request is sent the moment each turn ends (when the store starts its
write): latency of ``/health`` (p50, p99, max) and TTFT of the short request, on vs off.

Timings are wall clock on a shared machine: read them as indications. Prints a table; the last
line is one JSON object. ``python -m bench.state_store_bench [--tokens 6000]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

from bench.lib.client import stream_chat
from bench.lib.machine import machine
from bench.lib.servers import ServerProcess
from bench.lib.stats import percentile
from testkit.worker_process import Worker, model_path, worker_dir

CHAT = "<|im_start|>system\n{s}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
NOTE = ("File src/module_{i}.py defines class Handler{i} with methods open, read, write and close; "
        "its tests live in tests/test_module_{i}.py and cover the error paths. ")
TURN2 = "<|im_end|>\n<|im_start|>user\nNow fix the failing test and show the diff.<|im_end|>\n<|im_start|>assistant\n"


def _worker(state_dir: Path | None, ctx: int) -> Worker:
    store = ["--state-dir", str(state_dir)] if state_dir else []
    w = Worker([str(worker_dir() / "trioserve-llama-worker"), "--model", str(model_path()), "--threads", "2",
                "--ctx", str(ctx), "--capacity", "2", *store])
    w.wait_ready(300)
    w.ids = itertools.count(1)  # type: ignore[attr-defined]
    return w


def _gen(w: Worker, **fields: Any) -> dict[str, Any]:
    _, done = w.generate(next(w.ids), timeout=1800, **fields)  # type: ignore[attr-defined]
    assert done["type"] == "done", done
    return done


def _system(w: Worker, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens (counted by the worker's tokenizer)."""
    text, i = "", 0
    while True:
        text += NOTE.format(i=i)
        i += 1
        if i % 10 == 0:
            n = w.request({"op": "tokenize", "id": next(w.ids), "text": text, "count_only": True})["count"]  # type: ignore[attr-defined]
            if n >= tokens:
                return text


def _wait_file(state_dir: Path, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not list(state_dir.glob("*.tss")):
        assert time.monotonic() < deadline, "no state written"
        time.sleep(0.05)


def _returning_turn(w: Worker, p1: str, d1: dict[str, Any]) -> list[dict[str, Any]]:
    ids1 = w.request({"op": "tokenize", "id": next(w.ids), "text": p1})["ids"]  # type: ignore[attr-defined]
    return [{"ids": ids1 + d1["generated_token_ids"]}, {"text": TURN2}]


def ttft_rows(tokens: int, ctx: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        restart, killed = Path(tmp) / "restart", Path(tmp) / "killed"
        # warm: a worker without a store serves turn 1, then the returning turn in its slot.
        w = _worker(None, ctx)
        p1 = CHAT.format(s=_system(w, tokens), q="Which module handles the parser errors?")
        d1 = _gen(w, prompt=p1, max_new_tokens=16, session_id="agent")
        turn2 = _returning_turn(w, p1, d1)
        rows.append({"case": "turn 1 (cold)", **_fields(d1)})
        rows.append({"case": "warm (never restarted)", **_fields(_gen(w, prompt_segments=turn2, max_new_tokens=8,
                                                                      session_id="agent"))})
        w.close()
        w = _worker(None, ctx)
        rows.insert(0, {"case": "cold (returning turn)", **_fields(_gen(w, prompt_segments=turn2, max_new_tokens=8))})
        w.close()
        # restart: turn 1 with the store, stdin EOF (the drain), a new worker.
        w = _worker(restart, ctx)
        _gen(w, prompt=p1, max_new_tokens=16, session_id="agent")
        w.close()
        w = _worker(restart, ctx)
        rows.append({"case": "from disk after restart", **_fields(_gen(w, prompt_segments=turn2, max_new_tokens=8,
                                                                       session_id="agent"))})
        w.close()
        # SIGKILL once the state was written (while the worker idled), a new worker.
        w = _worker(killed, ctx)
        _gen(w, prompt=p1, max_new_tokens=16, session_id="agent")
        _wait_file(killed)
        w.kill()
        w.close()
        w = _worker(killed, ctx)
        rows.append({"case": "from disk after SIGKILL", **_fields(_gen(w, prompt_segments=turn2, max_new_tokens=8,
                                                                       session_id="agent"))})
        w.close()
    cold = rows[0]["ttft_ms"]
    for r in rows:
        r["vs_cold"] = round(r["ttft_ms"] / cold, 3)
    return rows


def _fields(done: dict[str, Any]) -> dict[str, Any]:
    return {"prompt_tokens": done["prompt_tokens"], "reused": done["reused_prompt_tokens"],
            "ttft_ms": round(done["ttft_ms"], 1), "copy_source": done.get("copy_source"),
            "copy_ms": round(done["copy_ms"], 1) if "copy_ms" in done else None}


def decode_rates(runs: int, state_dir: Path) -> tuple[list[float], list[float]]:
    """decode tok/s of ``runs`` 64-token greedy turns of one growing session on a worker
    without the store and one with it, interleaved (the same background load for both); a
    pause after each turn lets the store's write (while its worker idles) finish first."""
    workers = {"off": _worker(None, 4096), "on": _worker(state_dir, 4096)}
    prompts = dict.fromkeys(workers, CHAT.format(s="You are a storyteller who never stops.",
                                                 q="Tell a very long story about a lighthouse keeper."))
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(runs):
        for name, w in workers.items():
            done = _gen(w, prompt=prompts[name], max_new_tokens=64, session_id="story")
            if done["completion_tokens"] >= 32:  # a turn the model ended at once says nothing
                rates[name].append(done["decode_tok_s"])
            prompts[name] += "<|im_end|>\n<|im_start|>user\nContinue the story at length.<|im_end|>\n<|im_start|>assistant\n"
            time.sleep(0.5)
    for w in workers.values():
        w.close()
    return rates["off"], rates["on"]


async def _health_while_writing(tmp: Path, store: bool, tokens: int, turns: int) -> dict[str, Any]:
    state_dir = tmp / "states"
    settings: dict[str, Any] = {"threads": 2, "slots": 2, "max_context": tokens + 1024}
    if store:
        settings["state_dir"] = state_dir
    srv = ServerProcess.trioserve(tmp, **settings)
    latencies: list[float] = []
    short_ttft: list[float] = []
    try:
        await srv.wait_ready()
        notes = "".join(NOTE.format(i=i) for i in range(tokens // 45))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}", timeout=600) as client:
            async def poll_health() -> None:
                while True:
                    t0 = time.perf_counter()
                    assert (await client.get("/health")).status_code == 200
                    latencies.append((time.perf_counter() - t0) * 1000)
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(poll_health)
                for turn in range(turns):
                    body = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0, "prompt_cache_key": f"agent{turn}",
                            "messages": [{"role": "system", "content": f"Session {turn}. {notes}"},
                                         {"role": "user", "content": "Which module handles the parser errors?"}]}
                    await stream_chat(srv.port, body)
                    # The turn just ended: the store serializes the session's state now.
                    r = await stream_chat(srv.port, {"model": "SmolLM2-135M-Instruct", "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": f"Say hi {turn}."}]})
                    short_ttft.append((r["t_first"] - r["t_sent"]) * 1000)
                    await trio.sleep(1.0)
                nursery.cancel_scope.cancel()
        written = sum(f.stat().st_size for f in state_dir.glob("*.tss")) if store else 0
    finally:
        srv.stop()
    return {"store": "on" if store else "off", "health_ms_p50": round(percentile(latencies, 50), 1),
            "health_ms_p99": round(percentile(latencies, 99), 1), "health_ms_max": round(max(latencies), 1),
            "health_polls": len(latencies), "short_ttft_ms": [round(t) for t in short_ttft],
            "stored_mb": round(written / 1e6, 1)}


def health_rows(tokens: int, turns: int) -> list[dict[str, Any]]:
    rows = []
    for store in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            rows.append(trio.run(_health_while_writing, Path(tmp), store, tokens, turns))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=6000, help="system prompt tokens [6000]")
    parser.add_argument("--decode-runs", type=int, default=5)
    parser.add_argument("--decode-only", action="store_true", help="skip the TTFT cases")
    parser.add_argument("--health", action="store_true", help="only /health and a short request while states are written")
    parser.add_argument("--turns", type=int, default=3, help="keyed sessions written in --health [3]")
    args = parser.parse_args()
    if args.health:
        print(f"machine: {machine()}")
        rows = health_rows(args.tokens, args.turns)
        for r in rows:
            print(r)
        print(json.dumps({"bench": "state_store_health", "machine": machine(), "tokens": args.tokens, "rows": rows}))
        return
    ctx = max(4096, args.tokens + 1024)
    rows = [] if args.decode_only else ttft_rows(args.tokens, ctx)
    print(f"machine: {machine()}")
    print(f"{'case':26} {'prompt':>7} {'reused':>7} {'ttft ms':>9} {'vs cold':>8} {'source':>7} {'copy ms':>8}")
    for r in rows:
        print(f"{r['case']:26} {r['prompt_tokens']:>7} {r['reused']:>7} {r['ttft_ms']:>9} {r['vs_cold']:>8} "
              f"{r['copy_source'] or '-':>7} {r['copy_ms'] if r['copy_ms'] is not None else '-':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        off, on = decode_rates(args.decode_runs, Path(tmp))
    print(f"decode tok/s per turn: off {off}, on {on}")
    decode = {"off_tok_s": round(statistics.median(off), 1), "on_tok_s": round(statistics.median(on), 1)}
    decode["on_vs_off"] = round(decode["on_tok_s"] / decode["off_tok_s"], 3)
    print(f"decode tok/s (median of {len(off)} and {len(on)} turns of 32+ tokens): store off {decode['off_tok_s']}, "
          f"on {decode['on_tok_s']} ({decode['on_vs_off']}x)")
    print(json.dumps({"bench": "state_store", "machine": machine(), "ttft": rows, "decode": decode}))


if __name__ == "__main__":
    main()
