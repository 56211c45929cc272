"""ExecuTorch slots benchmark: what N slots on one program load cost and give.

For one `.pte` (default: the committed tiny program; ``--pte`` or ``TRIOSERVE_BENCH_PTE`` for a
real one, with its tokenizer.json beside it) it starts trioserve-executorch-worker and prints:

* memory: the ready record's measured resident bytes per extra slot against the planned arenas,
  with XNNPACK's weight cache on and off (does an extra slot copy the weights?);
* throughput: N greedy streams at once on N slots (one forward call per slot per step) against
  one stream, total decode tokens/s over the batch's wall time;
* restore vs re-prefill: a session evicted by others (its state spilled to host memory) and
  resumed, the worker's `restore_ms`, against prefilling the same prompt from nothing.

Wall-clock figures on a shared machine: indications, never asserted. The last line is JSON.

    python -m bench.executorch_slots_bench [--pte PATH] [--slots 4] [--tokens 64] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import REPO
from bench.lib.workers import find_pte, worker_binary

TINY = REPO / "tests" / "data" / "executorch" / "tiny_sdpa.pte"


class Worker:
    """A worker process driven over the protocol with blocking reads (one request stream)."""

    def __init__(self, argv: list[str]):
        self.err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self.ready = self.read()
        if self.ready.get("type") != "ready":
            self.err.seek(0)
            raise RuntimeError(f"worker did not start: {self.err.read().decode(errors='replace')[-2000:]}")
        self.next_id = 1

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("worker closed its output")
        return json.loads(line)

    def send(self, objs: list[dict[str, Any]]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("".join(json.dumps(o) + "\n" for o in objs))
        self.proc.stdin.flush()

    def generate(self, prompts: list[list[int]], tokens: int, **fields: Any) -> dict[int, dict[str, Any]]:
        """Sends every prompt at once; returns the done records by request id."""
        ids = list(range(self.next_id, self.next_id + len(prompts)))
        self.next_id += len(prompts)
        self.send([{"op": "generate", "id": i, "prompt_segments": [{"ids": p}], "max_new_tokens": tokens, **fields} for i, p in zip(ids, prompts)])
        done: dict[int, dict[str, Any]] = {}
        while len(done) < len(ids):
            rec = self.read()
            if rec["type"] in ("done", "error"):
                done[rec["id"]] = rec
        return done

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)
        self.err.close()


def argv_for(pte: Path, threads: int, *flags: str) -> list[str]:
    return [str(worker_binary("trioserve-executorch-worker")), "--model", str(pte), "--tokenizer",
            str(pte.parent / "tokenizer.json"), "--threads", str(threads), *flags]


def prompt(n: int, salt: int, vocab: int) -> list[int]:
    return [(10 + salt * 7 + i * 13) % (vocab - 20) + 10 for i in range(n)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pte", default=None)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    args = ap.parse_args(argv)
    pte = find_pte(args.pte) or TINY
    out: dict[str, Any] = {"bench": "executorch_slots", "pte": str(pte), "threads": args.threads,
                           "load": os.getloadavg()[0]}

    memory = {}
    for cache in ("on", "off"):
        w = Worker(argv_for(pte, args.threads, "--capacity", str(args.slots), "--xnnpack-weight-cache", cache))
        memory[cache] = w.ready["executorch"]
        w.close()
    out["memory"] = memory
    print(f"{'weight cache':>12} {'slots':>5} {'planned/slot MB':>15} {'extra slot MB':>13} {'beyond arenas MB':>16} "
          f"{'program MB':>10} {'duplicated':>10}")
    for cache, et in memory.items():
        print(f"{cache:>12} {et['capacity']:>5} {et['planned_bytes_per_slot'] / 1e6:>15.2f} "
              f"{et['bytes_per_extra_slot'] / 1e6:>13.2f} "
              f"{(et['bytes_per_extra_slot'] - et['planned_bytes_per_slot']) / 1e6:>16.2f} "
              f"{et['program_bytes'] / 1e6:>10.1f} {str(et['weights_duplicated']):>10}")

    w = Worker(argv_for(pte, args.threads, "--capacity", str(args.slots), "--min-shared-prefix", "0"))
    vocab = int(w.ready["n_vocab"])
    n_ctx = int(w.ready["n_ctx"])
    try:
        rows = []
        for n in (1, args.slots):
            prompts = [prompt(args.prompt_tokens, 100 + s + 10 * n, vocab) for s in range(n)]
            w.generate(prompts, 2)  # warm: the prompts are resident, only decode is timed below
            t0 = time.perf_counter()
            done = w.generate([p for p in prompts], args.tokens)
            wall = time.perf_counter() - t0
            toks = sum(d.get("completion_tokens", 0) for d in done.values())
            rows.append({"streams": n, "tokens": toks, "wall_s": round(wall, 3), "tok_s": round(toks / wall, 1)})
        out["throughput"] = rows
        print(f"\n{'streams':>7} {'tokens':>7} {'wall s':>7} {'total tok/s':>11}")
        for r in rows:
            print(f"{r['streams']:>7} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tok_s']:>11.1f}")
        out["throughput_ratio"] = round(rows[1]["tok_s"] / rows[0]["tok_s"], 2)
        print(f"{args.slots} streams / 1 stream: x{out['throughput_ratio']}")
    finally:
        w.close()

    # Restore vs re-prefill: 2 slots (one bindable): session b evicts a, then a returns.
    long_n = min(n_ctx - 32, 1500)
    w = Worker(argv_for(pte, args.threads, "--capacity", "2", "--min-shared-prefix", "0"))
    try:
        long_p = prompt(long_n, 1, vocab)
        first = w.generate([long_p], 2, session_id="a")
        w.generate([prompt(16, 2, vocab)], 2, session_id="b")
        back = next(iter(w.generate([long_p + [11]], 2, session_id="a").values()))
        fresh = next(iter(w.generate([long_p], 2).values()))
    finally:
        w.close()
    restore = {"tokens": long_n, "plan": back.get("prefill_plan"), "restore_ms": back.get("restore_ms"),
               "reprefill_ms": round(next(iter(first.values()))["prefill_ms"], 1),
               "fresh_plan": fresh.get("prefill_plan")}
    out["restore"] = restore
    print(f"\nrestore of a {long_n}-token session: {restore['restore_ms']:.2f} ms (plan {restore['plan']}) vs "
          f"prefill {restore['reprefill_ms']:.1f} ms")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
