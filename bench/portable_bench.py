"""Portable llama.cpp build versus a native one: decode speed and start-up cost.

    python -m bench.portable_bench --portable-dir DIR [--native-dir DIR] [--runs 5] [--tokens 128]

Two builds of ``trioserve-llama-worker``, each linked to its own llama-cpp-python:

* native: llama-cpp-python's default build (``GGML_NATIVE=ON``: one CPU backend compiled with
  ``-march=native`` for the build machine). ``--native-dir``, default: the workers
  ``python -m bench`` uses (``TRIOSERVE_WORKER_DIR``, the installed package, ``build/dev``).
* portable: llama-cpp-python built with ``GGML_BACKEND_DL=ON GGML_CPU_ALL_VARIANTS=ON
  GGML_NATIVE=OFF``: one ``libggml-cpu-<variant>.so`` per x86 CPU generation, the best for the
  running CPU loaded at start (the ready record's ``kernel_path.cpu_variant``).
  ``--portable-dir`` or ``TRIOSERVE_BENCH_PORTABLE_WORKER_DIR``; without it ``python -m bench``
  skips this section with a note. README "Portable llama.cpp build" says how to build one.

Both workers are started (embedded SmolLM2-135M Q4_1, same threads, context, OpenMP
environment as the server gives them) and stay up; then, run by run, each decodes the same
greedy ``--tokens`` from the same prompt, one at a time, the order alternating, so machine
noise hits both alike. Decode tokens/s is measured from the first token record to the done
record (as bench/worker_bench.py); the ratio is portable ÷ native per run (target ≥ 0.95).
Start-up: each worker's start → ready wall clock, and the ready record's ``warmup_ms`` (the
verified-kernel-path warm-up) and ``startup_ms``. Also checks that both produced the same
greedy tokens. Prints a table and a JSON line. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.prompts import PROMPT
from bench.lib.stats import summary
from bench.lib.workers import Worker, find_bin_dir, find_model

PORTABLE_ENV = "TRIOSERVE_BENCH_PORTABLE_WORKER_DIR"


def start(bin_dir: Path, model: Path, threads: int) -> tuple[Worker, float]:
    t0 = time.monotonic()
    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", str(threads),
                "--ctx", "1024", "--capacity", "1"])
    return w, time.monotonic() - t0


def decode(w: Worker, n: int) -> tuple[float, list[int]]:
    """Greedy decode of up to n tokens: (tok/s from the first token record to done, ids)."""
    w.send({"op": "generate", "id": next(w.ids), "prompt": PROMPT, "max_new_tokens": n, "temperature": 0})
    t_first = None
    while True:
        rec = w.record()
        if rec["type"] == "token":
            t_first = t_first or time.perf_counter()
            continue
        assert rec["type"] == "done", rec
        return (rec["completion_tokens"] - 1) / (time.perf_counter() - t_first), rec.get("generated_token_ids", [])


def run(portable_dir: Path, native_dir: Path | None = None, runs: int = 5, tokens: int = 128,
        threads: int = 2) -> dict[str, Any]:
    native_dir = native_dir or find_bin_dir()
    model = find_model()
    builds = {"native": native_dir, "portable": portable_dir}
    workers: dict[str, Worker] = {}
    res: dict[str, Any] = {"portable_dirs": {k: str(v) for k, v in builds.items()}}
    try:
        for name, d in builds.items():
            w, ready_s = start(d, model, threads)
            workers[name] = w
            kp = w.ready.get("kernel_path", {})
            res[f"portable_{name}_cpu_backend"] = kp.get("cpu_backend", "?")
            res[f"portable_{name}_cpu_variant"] = kp.get("cpu_variant", "")
            res[f"portable_{name}_ready_s"] = ready_s
            res[f"portable_{name}_warmup_ms"] = kp.get("warmup_ms")
            res[f"portable_{name}_startup_ms"] = kp.get("startup_ms")
        decode(workers["native"], 8)  # first-request effects out of the timed runs
        decode(workers["portable"], 8)
        rates: dict[str, list[float]] = {"native": [], "portable": []}
        ids: dict[str, list[int]] = {}
        ratios = []
        for r in range(runs):
            order = ["native", "portable"] if r % 2 == 0 else ["portable", "native"]
            for name in order:
                tok_s, ids[name] = decode(workers[name], tokens)
                rates[name].append(tok_s)
            ratios.append(rates["portable"][-1] / rates["native"][-1])
        res.update(portable_native_decode_tok_s=summary(rates["native"]),
                   portable_portable_decode_tok_s=summary(rates["portable"]),
                   portable_decode_ratio=summary(ratios),
                   portable_same_tokens=ids["native"] == ids["portable"],
                   portable_tokens=len(ids["native"]))
    finally:
        for w in workers.values():
            w.close()
    return res


def run_section(portable_dir: str | None, threads: int, runs: int, tokens: int) -> dict[str, Any]:
    """For ``python -m bench``: the comparison, or ``portable_skipped`` with the reason."""
    chosen = portable_dir or os.environ.get(PORTABLE_ENV)
    if not chosen:
        return {"portable_skipped": f"no portable build given (--portable-worker-dir or {PORTABLE_ENV})"}
    if not (Path(chosen) / "trioserve-llama-worker").is_file():
        return {"portable_skipped": f"no trioserve-llama-worker in {chosen}"}
    return run(Path(chosen), None, runs, tokens, threads)


def table(res: dict[str, Any]) -> list[str]:
    if "portable_decode_ratio" not in res:
        return []
    variant = res.get("portable_portable_cpu_variant") or res.get("portable_portable_cpu_backend")
    lines = [f"| portable llama.cpp (CPU kernels: {variant}) vs native | median | min | max | runs |",
             "|---|---|---|---|---|"]
    for label, key, digits in (("native decode tok/s", "portable_native_decode_tok_s", 1),
                               ("portable decode tok/s", "portable_portable_decode_tok_s", 1),
                               ("decode ratio portable ÷ native (target ≥ 0.95)", "portable_decode_ratio", 3)):
        v = res[key]
        lines.append(f"| {label} | {v['median']:.{digits}f} | {v['min']:.{digits}f} | {v['max']:.{digits}f} | {v['n']} |")
    for name in ("native", "portable"):
        lines.append(f"| {name}: start → ready s / warm-up ms / worker start-up ms | "
                     f"{res[f'portable_{name}_ready_s']:.2f} / {res[f'portable_{name}_warmup_ms']:.0f} / "
                     f"{res[f'portable_{name}_startup_ms']:.0f} | | | 1 |")
    lines.append(f"| same greedy tokens ({res['portable_tokens']}) | {res['portable_same_tokens']} | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--portable-dir", default=os.environ.get(PORTABLE_ENV))
    ap.add_argument("--native-dir", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    if not args.portable_dir:
        ap.error(f"--portable-dir (or {PORTABLE_ENV}) is required")
    res = run(Path(args.portable_dir), Path(args.native_dir) if args.native_dir else None, args.runs, args.tokens,
              args.threads)
    print("\n".join(table(res)))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
