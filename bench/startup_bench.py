"""Startup cost of the llama worker's verified kernel path.

    python -m bench.startup_bench [--runs 3] [--threads 2]

Starts ``trioserve-llama-worker`` on the embedded model, as the server does (same flags and
OpenMP environment), in three modes, interleaved run by run so machine noise hits each alike:

* ``off``: extra buffer types off, no probe; the in-process warm-up only.
* ``auto``: the default; when the CPU offers extra buffer types (CPU_REPACK, AMX) a probe
  process loads the model with them and warms up first, then the worker loads and warms up.
* ``auto, probe killed``: ``--test-probe-fault sigill``; the fallback path.

Reports, per mode: process start → ready record (wall clock, seconds), and from the ready
record's ``kernel_path`` the in-process warm-up and the probe (spawn → reaped), milliseconds.
The warm-up's own cost is ``warmup_ms``; the probe's is ``probe_ms`` (a second model load and
warm-up). Prints a table and a JSON line. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.lib.stats import summary
from bench.lib.workers import engine_env, find_bin_dir, find_model

MODES = {"off": ["--cpu-extra-buffers", "off"], "auto": [],
         "auto, probe killed": ["--test-probe-fault", "sigill"]}


def start_to_ready(binary: Path, model: Path, threads: int, flags: list[str]) -> tuple[float, dict[str, Any]]:
    """Seconds from spawn to the ready record, and the record's kernel_path."""
    t0 = time.monotonic()
    proc = subprocess.Popen([str(binary), "--model", str(model), "--threads", str(threads), *flags],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={k: v for k, v in engine_env().items() if k != "TRIOSERVE_CANCEL_FD"})
    try:
        buf = b""
        deadline = t0 + 300
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
                raise TimeoutError("no ready record within 300 s")
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"worker exited before ready ({proc.wait()})")
            buf += chunk
        elapsed = time.monotonic() - t0
        return elapsed, json.loads(buf.split(b"\n")[0])["kernel_path"]
    finally:
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()


def run(runs: int, threads: int) -> dict[str, Any]:
    binary, model = find_bin_dir() / "trioserve-llama-worker", find_model()
    ready: dict[str, list[float]] = {m: [] for m in MODES}
    warm: dict[str, list[float]] = {m: [] for m in MODES}
    probe: dict[str, list[float]] = {m: [] for m in MODES}
    last: dict[str, Any] = {}
    for _ in range(runs):
        for mode, flags in MODES.items():
            seconds, kp = start_to_ready(binary, model, threads, flags)
            ready[mode].append(seconds)
            warm[mode].append(float(kp["warmup_ms"]))
            if "probe_ms" in kp:
                probe[mode].append(float(kp["probe_ms"]))
            last[mode] = kp
    res: dict[str, Any] = {"startup_extra_buffer_types": last["auto"]["extra_buffer_types"],
                           "startup_weight_buffers": last["auto"]["weight_buffers"],
                           "startup_probe_outcomes": {m: last[m]["probe"] for m in MODES}}
    for mode in MODES:
        key = mode.replace(", ", "_").replace(" ", "_")
        res[f"startup_ready_s_{key}"] = summary(ready[mode])
        res[f"startup_warmup_ms_{key}"] = summary(warm[mode])
        if probe[mode]:
            res[f"startup_probe_ms_{key}"] = summary(probe[mode])
    return res


def table(res: dict[str, Any]) -> list[str]:
    lines = ["| startup (llama worker, embedded model) | median | min | max | runs |", "|---|---|---|---|---|"]
    for mode in MODES:
        key = mode.replace(", ", "_").replace(" ", "_")
        for label, name, digits in (("start → ready, s", "ready_s", 2), ("in-process warm-up, ms", "warmup_ms", 0),
                                    ("probe (spawn → reaped), ms", "probe_ms", 0)):
            v = res.get(f"startup_{name}_{key}")
            if v:
                lines.append(f"| {mode}: {label} | {v['median']:.{digits}f} | {v['min']:.{digits}f} | "
                             f"{v['max']:.{digits}f} | {v['n']} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    res = run(args.runs, args.threads)
    print("\n".join(table(res)))
    print(f"extra buffer types offered: {res['startup_extra_buffer_types']}; "
          f"weights in {res['startup_weight_buffers']}; probe: {res['startup_probe_outcomes']}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
