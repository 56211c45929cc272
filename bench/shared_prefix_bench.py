"""Shared-prefix benchmark: new sessions that send a system prompt another session already
sent, trioserve against llama.cpp's ``llama-server`` in the same run.

    python -m bench.shared_prefix_bench [--llama-server PATH] [--threads N] [--quick]
    python -m bench.shared_prefix_bench --pte smollm2.pte --servers "trioserve,trioserve executorch" \
        --ctx-per-slot 2048 --fleet-tokens 1500     # the ExecuTorch engine beside the llama.cpp one

Both servers get the same model, threads and 4 slots of 8,192 tokens (trioserve
``--slots 4 --max-context 8192``; ``llama-server -np 4 -c 32768``, its host-memory prompt cache
at its default). llama-server runs twice: with the machine's environment, and with the OpenMP
wait trioserve sets for its worker (``GOMP_SPINCOUNT``: "llama-server + worker env"), which
matters on a loaded host. Every request is streamed, greedy, ``max_tokens`` 8; sessions are named with
``prompt_cache_key`` (llama-server ignores it and picks a slot by prompt similarity).

Sections:

* ``shared``: session 1 sends a long system prompt (~1,500 tokens) and its question; then
  sessions 2–8, one after the other, send the same system prompt with their own question. All
  servers run at once and take each session's requests in turn (interleaved, the order
  rotating), so that the machine's load changes do not favour whichever server ran first.
  Also reported: each new session's TTFT over that of session 1 coming back with the same
  question (its slot already holds the system prompt, so only the question is prefilled: the
  suffix's own prefill *after* the prefix, which attention over the prefix makes about twice
  the suffix alone on this CPU): the cost of starting from another session's prefix.
  Reported per server: session 1's TTFT, the TTFTs of sessions 2–8 (median, max), and the
  ratio of each to the TTFT of its *own suffix alone* (the same question without the system
  prompt, sent to the same server right after: the time to prefill that suffix). Target of
  target: ≤ 1.1× and ≤ llama-server.
* ``fleet``: 8 new sessions of 3 turns each, all started at once over the 4 slots, with a
  ~6,000-token shared system prompt; each turn appends the reply and a new user message.
  Reported: summed TTFT over the 24 requests, and the wall time. Target: ≤ llama-server.

Prints a markdown table and one JSON line last. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench.lib.client import stream_chat
from bench.lib.machine import LLAMA_SERVER_BUILD
from bench.lib.servers import ServerProcess, free_port
from bench.lib.workers import find_pte, worker_bin, worker_binary
from trioserve.config import Settings
from trioserve.machine import embedded_model_path
from trioserve.worker.launch import env_for

SLOTS = 4
CTX_PER_SLOT = 8192
MAX_TOKENS = 8
QUESTIONS = ["List the files you would read first.", "Which tool edits a file?", "Name one risk of this change.",
             "How do you run the tests?", "What does the read tool return?", "Summarize your rules in a line.",
             "Which command lists a directory?", "What do you do before an edit?"]


def system_prompt(approx_tokens: int) -> str:
    """A deterministic agent-style system prompt with a tool block, about `approx_tokens` long
    for SmolLM2's tokenizer (~3 characters a token on this text)."""
    lines = ["You are a coding agent working in a repository. Read before you edit; explain each "
             "change in one sentence; never invent file names. The tools you may call follow."]
    i = 0
    while sum(len(x) for x in lines) < approx_tokens * 2.9:
        lines.append(f"Tool {i}: name=tool_{i}_{(i * 7919) % 1000}; arguments: path (string), "
                     f"line {i % 37} (integer), mode {('read', 'write', 'list')[i % 3]}; returns the "
                     f"result as text, at most {100 + i} lines; errors are reported as JSON.")
        i += 1
    return "\n".join(lines)


def body(messages: list[dict[str, str]], session: str | None) -> dict[str, Any]:
    b: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    if session is not None:
        b["prompt_cache_key"] = session
    return b


async def ttft(port: int, messages: list[dict[str, str]], session: str | None) -> tuple[float, int]:
    """(request sent → first content byte, prompt tokens) of one streamed request."""
    r = await stream_chat(port, body(messages, session))
    return r["t_first"] - r["t_sent"], r["prompt_tokens"]


async def shared_section(servers: dict[str, ServerProcess], sys_text: str, sessions: int) -> dict[str, Any]:
    """The ``shared`` rows of every server, measured INTERLEAVED: all servers run at once, and
    each session's request (then its suffix alone) goes to every server in turn, the order
    rotating by session, so a change in the machine's load shifts every column alike (run one
    after the other, the server that went first on a busier minute looked several times slower)."""
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    names = list(servers)
    first_session = f"shared-0-{time.monotonic_ns()}"
    for k in range(sessions):
        q = "First: " + QUESTIONS[k % len(QUESTIONS)] + f" (session {k + 1})"
        messages = [{"role": "system", "content": sys_text}, {"role": "user", "content": q}]
        # Session 1's return: the same question but for its first word (same token count), so
        # that no slot holds more of it than the system prompt.
        warm_messages = [messages[0], {"role": "user", "content": "Again:" + q.removeprefix("First:")}]
        for name in names[k % len(names):] + names[:k % len(names)]:
            port = servers[name].port
            t, n = await ttft(port, messages, first_session if k == 0 else f"shared-{k}-{time.monotonic_ns()}")
            # The suffix alone: the same question without the system prompt (what a session that
            # reuses the system prompt still has to prefill), anonymous.
            t_suffix, n_suffix = await ttft(port, [{"role": "user", "content": q}], None)
            row = {"session": k + 1, "ttft_s": t, "prompt_tokens": n, "suffix_ttft_s": t_suffix,
                   "suffix_tokens": n_suffix, "ratio": t / t_suffix if t_suffix > 0 else float("nan")}
            if k > 0:
                # The same suffix after the prefix in the slot that already holds it: session 1
                # comes back with this question (its slot is cut back to the system prompt and
                # prefills the question). What sharing can at best reach: the new session's
                # TTFT over this is the cost of starting from another session's prefix.
                t_warm, n_warm = await ttft(port, warm_messages, first_session)
                row.update(warm_ttft_s=t_warm, warm_prompt_tokens=n_warm,
                           warm_ratio=t / t_warm if t_warm > 0 else float("nan"))
            rows[name].append(row)
    return {name: summarize_shared(r) for name, r in rows.items()}


def summarize_shared(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = rows[1:]
    return {"rows": rows, "first_ttft_s": rows[0]["ttft_s"],
            "later_ttft_s_median": statistics.median(r["ttft_s"] for r in later),
            "later_ttft_s_max": max(r["ttft_s"] for r in later),
            "later_ratio_median": statistics.median(r["ratio"] for r in later),
            "later_ratio_max": max(r["ratio"] for r in later),
            "later_warm_ratio_median": statistics.median(r["warm_ratio"] for r in later),
            "later_warm_ratio_max": max(r["warm_ratio"] for r in later),
            "prompt_tokens": rows[0]["prompt_tokens"]}


async def fleet_section(port: int, sys_text: str, sessions: int, turns: int) -> dict[str, Any]:
    ttfts: list[float] = []
    prompt_tokens: list[int] = []
    t0 = time.perf_counter()
    stamp = time.monotonic_ns()

    async def agent(k: int) -> None:
        messages = [{"role": "system", "content": sys_text}]
        for turn in range(turns):
            messages.append({"role": "user", "content": QUESTIONS[(k + turn) % len(QUESTIONS)] + f" (agent {k})"})
            r = await stream_chat(port, body(messages, f"fleet-{k}-{stamp}"))
            ttfts.append(r["t_first"] - r["t_sent"])
            prompt_tokens.append(r["prompt_tokens"])
            messages.append({"role": "assistant", "content": f"Step {turn} done."})

    async with trio.open_nursery() as nursery:
        for k in range(sessions):
            nursery.start_soon(agent, k)
    return {"summed_ttft_s": sum(ttfts), "wall_s": time.perf_counter() - t0, "requests": len(ttfts),
            "ttft_s_median": statistics.median(ttfts), "ttft_s_max": max(ttfts),
            "prompt_tokens_first_turn": min(prompt_tokens)}


async def started(srv: ServerProcess) -> ServerProcess:
    await srv.wait_ready()
    await stream_chat(srv.port, body([{"role": "user", "content": "warm up"}], None))
    return srv


def table(res: dict[str, dict[str, Any]]) -> list[str]:
    names = list(res)
    lines = ["| figure | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]

    def row(label: str, section: str, key: str, fmt: str = "{:.2f}") -> None:
        cells = []
        for n in names:
            v = res[n].get(section, {}).get(key)
            cells.append(fmt.format(v) if isinstance(v, (int, float)) else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")

    row("shared: prompt tokens (system + question)", "shared", "prompt_tokens", "{}")
    row("shared: session 1 TTFT, s", "shared", "first_ttft_s")
    row("shared: sessions 2–8 TTFT median, s", "shared", "later_ttft_s_median")
    row("shared: sessions 2–8 TTFT max, s", "shared", "later_ttft_s_max")
    row("shared: sessions 2–8 TTFT ÷ own-suffix TTFT, median", "shared", "later_ratio_median")
    row("shared: sessions 2–8 TTFT ÷ own-suffix TTFT, max", "shared", "later_ratio_max")
    row("shared: sessions 2–8 TTFT ÷ same suffix on the slot holding the prefix, median", "shared",
        "later_warm_ratio_median")
    row("shared: sessions 2–8 TTFT ÷ same suffix on the slot holding the prefix, max", "shared",
        "later_warm_ratio_max")
    row("fleet: first-turn prompt tokens", "fleet", "prompt_tokens_first_turn", "{}")
    row("fleet: summed TTFT of every request (sessions × turns), s", "fleet", "summed_ttft_s")
    row("fleet: TTFT median, s", "fleet", "ttft_s_median")
    row("fleet: TTFT max, s", "fleet", "ttft_s_max")
    row("fleet: wall time, s", "fleet", "wall_s")
    return lines


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    model = embedded_model_path()
    sections = args.sections.split(",")
    res: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        servers = [("trioserve", lambda: ServerProcess.trioserve(
            tmp, engine="llama", threads=args.threads, max_context=args.ctx_per_slot, slots=SLOTS,
            queue_depth=32, worker_bin=str(worker_bin())))]
        pte = find_pte(args.pte) if args.pte else None
        if args.pte and pte is None:
            raise SystemExit(f"--pte {args.pte}: no such file")
        if pte is not None:
            # The ExecuTorch engine on the same model exported to a .pte (its context is the
            # program's max_context_len, so --ctx-per-slot must not exceed it), served under the
            # GGUF model's name so that every server gets the same request bodies.
            servers.append(("trioserve executorch", lambda: ServerProcess.trioserve(
                tmp, engine="executorch", model_path=str(pte), tokenizer_path=str(pte.parent / "tokenizer.json"),
                model_id="SmolLM2-135M-Instruct", threads=args.threads, max_context=args.ctx_per_slot,
                slots=SLOTS, queue_depth=32, worker_bin=str(worker_binary("trioserve-executorch-worker")))))
        if args.llama_server:
            def peer(env: dict[str, str] | None = None) -> ServerProcess:
                port = free_port()
                argv = [args.llama_server, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                        "-t", str(args.threads), "-tb", str(args.threads), "-c", str(args.ctx_per_slot * SLOTS),
                        "-np", str(SLOTS), "--jinja"]
                return ServerProcess(argv, port, "llama-server", tmp / f"llama-server-{port}.log", env=env)
            servers.append(("llama-server", peer))
            # The same binary with the OpenMP wait trioserve gives its worker (GOMP_SPINCOUNT,
            # config.Settings.worker_env): on a loaded host libgomp's default 300,000-spin
            # barrier wait costs llama-server several times its idle speed (docs/benchmarks/
            # contention.md); this column separates that from prefix sharing.
            spin_env = {**os.environ, **env_for(Settings())}
            servers.append(("llama-server + worker env", lambda: peer(spin_env)))
        chosen = [(name, make) for name, make in servers if name in args.servers.split(",")]
        if "shared" in sections:
            running: dict[str, ServerProcess] = {}
            try:
                for name, make in chosen:
                    running[name] = make()
                    await started(running[name])
                print("-- shared (all servers at once, interleaved)", file=sys.stderr, flush=True)
                shared = await shared_section(running, system_prompt(args.shared_tokens), args.sessions)
            finally:
                for srv in running.values():
                    srv.stop()
            for name in running:
                res.setdefault(name, {})["shared"] = shared[name]
        if "fleet" in sections:
            # Concurrent load: one server at a time.
            for name, make in chosen:
                print(f"-- fleet: {name}", file=sys.stderr, flush=True)
                srv = await started(make())
                try:
                    res.setdefault(name, {})["fleet"] = await fleet_section(
                        srv.port, system_prompt(args.fleet_tokens), args.sessions, args.turns)
                finally:
                    srv.stop()
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default="", help="llama-server binary for the side-by-side peer; "
                    "build it with: " + LLAMA_SERVER_BUILD)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--servers", default="trioserve,llama-server,llama-server + worker env",
                    help="which of the servers to run (comma-separated names)")
    ap.add_argument("--sections", default="shared,fleet")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--shared-tokens", type=int, default=1500)
    ap.add_argument("--fleet-tokens", type=int, default=6000)
    ap.add_argument("--quick", action="store_true", help="smaller prompts (400 / 1,500 tokens), 4 sessions")
    ap.add_argument("--pte", default="", help="also run the ExecuTorch engine on this .pte (tokenizer.json beside "
                    "it; scripts/executorch/export_smollm2_pte.py) as the server 'trioserve executorch'; "
                    "add it to --servers")
    ap.add_argument("--ctx-per-slot", type=int, default=CTX_PER_SLOT,
                    help="context per slot for every server (a .pte caps it at its max_context_len: 2048 for "
                         "the SmolLM2 export, so use --ctx-per-slot 2048 --fleet-tokens 1500 with --pte)")
    args = ap.parse_args(argv)
    if args.quick:
        args.shared_tokens, args.fleet_tokens, args.sessions = 400, 1500, 4
    res = trio.run(main_async, args)
    print("\n".join(table(res)))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
