"""The worker's extra-buffer-type choices side by side: 1 and 4 streams with each choice.

    python -m bench.extra_buffers_bench [--rounds 3] [--threads 2] [--tokens 128] [--variant V]

Why: when AMX faults (some Sapphire Rapids VMs) the worker keeps CPU_REPACK through the best
variant without AMX (cpp/engines/llama/kernel_path.h) instead of dropping every extra buffer
type; this measures what each choice is worth on this CPU. Choices: ``on`` (every type the
variant offers, no probe), ``off`` (plain buffers), and ``auto`` (the worker's rule). For each,
in alternating order per round: one stream and four concurrent streams of ``--tokens`` greedy
tokens of the embedded model through the worker protocol (no HTTP), decode tok/s = generated
tokens ÷ wall time from the first token to the last done record. Prints a table (medians) and one
JSON line. Never asserts on time.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

from bench.lib.workers import find_bin_dir, find_model
from testkit.worker_process import Worker

CHAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"
QUESTIONS = ["Tell me a long story about a robot.", "Describe the sea in detail.",
             "Explain how a bicycle works.", "Write a long poem about autumn."]


def run(worker: Worker, ids: itertools.count, streams: int, tokens: int) -> float:
    batch = [{"op": "generate", "id": next(ids), "prompt": CHAT.format(q=q), "max_new_tokens": tokens,
              "temperature": 0} for q in QUESTIONS[:streams]]
    worker.send_many(batch)
    first = None
    generated = 0
    pending = {b["id"] for b in batch}
    while pending:
        rec = worker.record(300)
        if rec["type"] == "token" and first is None:
            first = time.perf_counter()
        elif rec["type"] in ("done", "error"):
            assert rec["type"] == "done", rec
            generated += rec["completion_tokens"]
            pending.discard(rec["id"])
    assert first is not None
    return generated / (time.perf_counter() - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--variant", default="", help="force this CPU variant for every choice")
    args = ap.parse_args()
    model = find_model()
    exe = find_bin_dir() / "trioserve-llama-worker"
    results: dict[tuple[str, int], list[float]] = {}
    paths: dict[str, dict] = {}
    modes = ["on", "off", "auto"]
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else list(reversed(modes)):
            argv = [str(exe), "--model", str(model), "--threads", str(args.threads), "--ctx", "1024",
                    "--capacity", "4", "--cpu-extra-buffers", mode]
            if args.variant:
                argv += ["--cpu-variant", args.variant]
            w = Worker(argv)
            try:
                ready = w.wait_ready(300)
                kp = ready["kernel_path"]
                paths[mode] = {"variant": kp.get("cpu_variant"), "kept": kp["extra_buffer_types_kept"],
                               "weights": kp.get("weight_buffers")}
                ids = itertools.count(1)
                run(w, ids, 1, 8)  # warm
                for streams in (1, 4):
                    results.setdefault((mode, streams), []).append(run(w, ids, streams, args.tokens))
            finally:
                w.close()
    rows = []
    for mode in modes:
        one = statistics.median(results[(mode, 1)])
        four = statistics.median(results[(mode, 4)])
        rows.append({"choice": mode, "variant": paths[mode]["variant"], "kept": ",".join(paths[mode]["kept"]) or "none",
                     "1 stream tok/s": round(one, 1), "4 streams tok/s": round(four, 1),
                     "4 / 1": round(four / one, 2)})
    cols = list(rows[0])
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in cols) + " |")
    print(json.dumps({"extra_buffers": rows, "rounds": args.rounds, "threads": args.threads}))


if __name__ == "__main__":
    main()
