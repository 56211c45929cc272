"""Idle decode speed of the direct llama.h loop per OpenMP wait setting.

    python -m bench.spin_sweep [--rounds 16] [--budget 540] [--variant LABEL:THREADS:SPINCOUNT ...]

Runs ``trioserve-llama-direct`` (greedy, 128 tokens, ``--warmup``) once per variant per round,
the order rotated each round, and pairs every variant with the first one (the old default:
2 threads, libgomp's own spin count) round by round. A round counts only if processes other
than this one used less than ``--max-other`` cores during each of its runs (/proc/stat minus
our children's CPU time); before each round it waits for a 2-second window that quiet. This
is the least noisy idle-decode figure: no HTTP, no control plane. SPINCOUNT ``-`` = leave
``GOMP_SPINCOUNT`` unset. Prints a table; the last line is one JSON object. Never asserts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.lib.machine import machine
from bench.lib.prompts import PROMPT
from bench.lib.workers import find_bin_dir, find_model

DEFAULT_VARIANTS = ["old default:2:-", "spin 0:2:0", "spin 1k:2:1000", "spin 3k:2:3000", "spin 10k:2:10000",
                    "spin 30k:2:30000", "one thread:1:-"]


def _busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def decode_once(direct: Path, model: Path, threads: str, spin: str, tokens: int) -> tuple[float, float]:
    """(decode tokens/s after the first token, other processes' cores during the run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    if spin != "-":
        env["GOMP_SPINCOUNT"] = spin
    b0, c0, t0 = _busy_seconds(), _children_cpu(), time.monotonic()
    out = subprocess.run([str(direct), "--model", str(model), "--threads", threads, "--ctx", "4096",
                          "--capacity", "1", "--n", str(tokens), "--prompt", PROMPT, "--warmup"],
                         capture_output=True, text=True, env=env, timeout=300, check=True)
    wall = time.monotonic() - t0
    other = max(0.0, (_busy_seconds() - b0) - (_children_cpu() - c0)) / wall
    return json.loads(out.stdout.strip().splitlines()[-1])["decode_tok_s_after_first"], other


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.spin_sweep", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=16, help="quiet rounds wanted (default 16)")
    ap.add_argument("--budget", type=float, default=540.0, help="stop after this many seconds (default 540)")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--max-other", type=float, default=0.1, help="cores other processes may use in a counted run")
    ap.add_argument("--variant", action="append", default=None,
                    help="LABEL:THREADS:SPINCOUNT, the first is the reference (default: a sweep from 0 to 30,000 "
                         "spins, one thread, and the old default first)")
    args = ap.parse_args(argv)
    variants = [v.rsplit(":", 2) for v in (args.variant or DEFAULT_VARIANTS)]
    direct, model = find_bin_dir() / "trioserve-llama-direct", find_model()
    deadline = time.monotonic() + args.budget
    rounds: list[dict[str, float]] = []
    skipped = 0
    while len(rounds) < args.rounds and time.monotonic() < deadline:
        b0 = _busy_seconds()
        time.sleep(2.0)
        if (_busy_seconds() - b0) / 2.0 > args.max_other:
            continue
        k = len(rounds) + skipped
        row, quiet = {}, True
        for label, threads, spin in variants[k % len(variants):] + variants[:k % len(variants)]:
            tok_s, other = decode_once(direct, model, threads, spin, args.tokens)
            row[label] = tok_s
            quiet &= other < args.max_other
        if quiet:
            rounds.append(row)
        else:
            skipped += 1
        print(f"[spin_sweep] round {k}: " + " ".join(f"{lb}={v:.1f}" for lb, v in row.items())
              + ("" if quiet else " (not quiet, left out)"), file=sys.stderr, flush=True)
    ref = variants[0][0]
    result: dict = {"machine": machine(), "rounds": len(rounds), "skipped": skipped, "tokens": args.tokens,
                    "variants": {}}
    print(f"| variant | threads | GOMP_SPINCOUNT | decode tok/s (median) | × {ref} (median of pairs) | min | max |")
    print("|---|---|---|---|---|---|---|")
    for label, threads, spin in variants:
        xs = [r[label] for r in rounds]
        pairs = [r[label] / r[ref] for r in rounds]
        if not xs:
            continue
        entry = {"threads": int(threads), "spin": spin, "tok_s": statistics.median(xs),
                 "ratio": statistics.median(pairs), "ratio_min": min(pairs), "ratio_max": max(pairs)}
        result["variants"][label] = entry
        print(f"| {label} | {threads} | {'unset' if spin == '-' else spin} | {entry['tok_s']:.1f} | "
              f"{entry['ratio']:.3f} | {entry['ratio_min']:.2f} | {entry['ratio_max']:.2f} |")
    print(f"note: {len(rounds)} quiet rounds counted, {skipped} left out")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
