"""Grammar-step benchmark: what a constrained generation's grammar masks cost
the other streams of the same worker.

On the real embedded model through trioserve-llama-worker (worker protocol, no HTTP), with the
environment trioserve gives its worker (OpenMP waiting): a bystander generation streams at
temperature 0; after its 20th token a generation constrained to ``"`` + one of N enum values
+ ``"`` (the grammar the control plane makes for a ``json_schema`` enum) starts. Measured:

* the bystander's median and longest gap between two token records while the constrained one
  runs (a gap is one decode step when nothing holds the step up);
* the constrained generation's time (read to done, from its done record) and, from its done
  record, how many of its samples needed the full-vocabulary mask and their total time on the
  worker's sampler thread (``deferred_samples``, ``deferred_sample_ms``; absent on workers that
  mask inside the step).

``--worker-dir DIR`` (repeatable) compares worker builds, e.g. one from before the change; runs
alternate between them so load changes hit both. Prints a table; the last line is one JSON
object. Never asserts on time.

    python -m bench.grammar_step_bench --worker-dir build/rel --worker-dir /tmp/old/build/rel
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.lib.machine import machine
from trioserve.config import Settings
from trioserve.machine import embedded_model_path
from trioserve.worker.launch import env_for

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


def enum_grammar(n: int) -> str:
    values = " | ".join(f'"value number {i}"' for i in range(n))
    return f'root ::= "\\"" ( {values} ) "\\""'


class Worker:
    """A llama worker on pipes; records are read with their arrival time."""

    def __init__(self, worker_dir: str, threads: int) -> None:
        env = {**os.environ, **env_for(Settings())}
        self.proc = subprocess.Popen(
            [str(Path(worker_dir) / "trioserve-llama-worker"), "--model", str(embedded_model_path()),
             "--threads", str(threads), "--ctx", "2048", "--capacity", "4"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
        assert self.record()[1]["type"] == "ready"

    def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(obj).encode() + b"\n")
        self.proc.stdin.flush()

    def record(self) -> tuple[float, dict[str, Any]]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the worker closed its output")
        return time.perf_counter(), json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def run_once(worker: Worker, n: int, first_id: int) -> dict[str, Any]:
    by, pick = first_id, first_id + 1
    worker.send({"op": "generate", "id": by, "prompt": CHAT.format(q="Tell a long story about the sea."),
                 "max_new_tokens": 400, "temperature": 0})
    times: list[float] = []
    while len(times) < 20:
        t, r = worker.record()
        if r.get("id") == by and r["type"] == "token":
            times.append(t)
    worker.send({"op": "generate", "id": pick, "prompt": CHAT.format(q="Pick one."), "max_new_tokens": 16,
                 "grammar": enum_grammar(n)})
    start = len(times)
    done: dict[str, Any] = {}
    while not done:
        t, r = worker.record()
        if r.get("id") == by and r["type"] == "token":
            times.append(t)
        elif r.get("id") == pick and r["type"] in ("done", "error"):
            done = r
    end = len(times)
    while True:  # let the bystander finish (its own done record)
        _, r = worker.record()
        if r.get("id") == by and r["type"] in ("done", "error"):
            break
    gaps = [(b - a) * 1000 for a, b in zip(times[start - 1:end], times[start:end + 1])]
    return {"median_gap_ms": statistics.median(gaps) if gaps else float("nan"),
            "max_gap_ms": max(gaps, default=float("nan")),
            "constrained_ms": done.get("total_ms", float("nan")),
            "deferred_samples": done.get("deferred_samples"),
            "deferred_sample_ms": done.get("deferred_sample_ms")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker-dir", action="append", default=[],
                        help="a directory holding trioserve-llama-worker (repeatable; default: "
                             "$TRIOSERVE_WORKER_DIR)")
    parser.add_argument("--enum", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    dirs = args.worker_dir or [os.environ.get("TRIOSERVE_WORKER_DIR", "")]
    rows: list[dict[str, Any]] = []
    for run in range(args.runs):
        for d in dirs:
            w = Worker(d, args.threads)
            try:
                for k, n in enumerate(args.enum):
                    r = run_once(w, n, first_id=1 + 2 * k)
                    rows.append({"worker_dir": d, "run": run, "enum": n,
                                 "load": round(os.getloadavg()[0], 2), **r})
            finally:
                w.close()
    print(f"{'worker dir':<36} {'enum':>5} {'load':>5} {'bystander median ms':>20} {'max gap ms':>11} "
          f"{'constrained ms':>15} {'deferred':>9} {'deferred ms':>12}")
    for r in rows:
        ds = "-" if r["deferred_samples"] is None else str(r["deferred_samples"])
        dm = "-" if r["deferred_sample_ms"] is None else f"{r['deferred_sample_ms']:.0f}"
        print(f"{r['worker_dir'][-36:]:<36} {r['enum']:>5} {r['load']:>5} {r['median_gap_ms']:>20.1f} "
              f"{r['max_gap_ms']:>11.0f} {r['constrained_ms']:>15.0f} {ds:>9} {dm:>12}")
    print(json.dumps({"machine": machine(), "threads": args.threads, "rows": rows}))


if __name__ == "__main__":
    main()
