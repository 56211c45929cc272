"""trioserve benchmark harness: every figure, in one run, on one machine.

    python -m bench [--quick] [--llama-server PATH] [--out docs/benchmarks/main.md]

Sections (each figure is the median of ``--runs`` runs, default 5, with min and max;
``--quick`` streams fewer tokens and does fewer disconnects/kills, about 1 minute):

* control plane (fake worker, zero delay, one token per byte): streamed tokens/s through
  HTTP/SSE for one stream and for 8 concurrent streams (aggregate); tokens are counted from
  the final usage chunk, time runs from the request sent to ``[DONE]``. A keep-up check runs
  the fake worker at 2 ms/token and reports SSE events per token and the inter-event gap:
  coalescing must only happen when the client is slower than the model.
* end to end (embedded SmolLM2 through llama.cpp, greedy): decode tokens/s and TTFT through
  trioserve versus the direct loop ``trioserve-llama-direct`` (same library, model, threads,
  context, prompt text after templating, token count), paired run by run; optionally the
  same streaming benchmark against llama.cpp's ``llama-server`` (the peer row).
* memory: control-plane and worker RSS (VmRSS) at idle and under 8 streams.
* cancellation (bench/cancel_bench.py) and the worker protocol (bench/worker_bench.py).
  The control plane and keep-up are bench/control_plane_bench.py, end to end bench/e2e_bench.py.
* concurrency (bench/concurrency_bench.py): 1/2/4/8 streams on the 4-slot batched worker versus
  llama-server ``-np 4`` (aggregate tok/s, TTFT, gaps while a long prompt is admitted, batch vs
  solo outputs); its section of the markdown is spliced between markers, so
  ``--only concurrency`` updates only that section.
* startup (bench/startup_bench.py): the llama worker's start → ready with its kernel-path
  verification: extra buffer types off (warm-up only), auto (probe + warm-up), auto with the
  probe killed by SIGILL (fault injection: the fallback path); the warm-up's and the probe's ms.
* portable build (bench/portable_bench.py): decode tok/s of the worker linked to a portable
  llama.cpp (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``, ``GGML_NATIVE=OFF``: CPU kernels
  chosen at run time) versus the native build, side by side, their ratio (target ≥ 0.95), the
  chosen CPU variant and each build's warm-up / start-up cost; skipped with a note when no
  portable worker directory is given (``--portable-worker-dir`` or
  ``TRIOSERVE_BENCH_PORTABLE_WORKER_DIR``).
* ExecuTorch engine (bench/executorch_bench.py): decode tok/s of the ExecuTorch worker on a
  SmolLM2 `.pte` versus the llama.cpp worker on the GGUF, and their ratio; skipped with a note
  when no `.pte` is present (``TRIOSERVE_BENCH_PTE``; it is not committed).
* worker pool (bench/pool_bench.py): aggregate tok/s of ``--workers 2`` versus 1 on the fake
  engine, model-bound (2 ms per decode step) and control-plane-bound (no delay); printed only.
* routers (bench/router_bench.py): time to first byte through nginx and vllm-router (each as
  docs/deployment.md configures it, when installed) versus straight to the replica, three fake
  replicas; printed only.
* CPU contention, quick (bench/contention_bench.py --quick, ~30 s): a 4-token request's median
  latency with the shipped CPU settings next to 1 and 2 busy-loop processes, as a ratio to
  idle. The full comparison (old default, llama-server) is ``python -m bench.contention_bench``,
  run on its own (minutes), which writes its own page, docs/benchmarks/contention.md.

* side by side with llama-server and the bare loop (bench/peers_bench.py: single-stream decode,
  TTFT, prefill, 4/8 streams, speculative decoding against every ``--spec-type`` mode, the worker's
  per-token profile): run on its own (tens of minutes on a shared host); it writes its own
  page, docs/benchmarks/peers.md.

This module is the runner only: it parses the command line, runs the sections (``bench/*_bench.py``)
and hands their results to the report writer (bench/report.py); the sections share only the
library (bench/lib/).

Servers run as separate processes (``python -m trioserve.cli serve``), so the client's
own cost is not charged to the server; the client is a raw socket on trio and its CPU
share is reported. Prints a markdown table, writes it to ``--out`` (full mode default:
docs/benchmarks/main.md; the concurrency section goes to docs/benchmarks/concurrency.md, or
into ``--out`` when one is given) and prints one JSON object as its last line. Never asserts on
time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from bench import (
    cancel_bench,
    concurrency_bench,
    contention_bench,
    control_plane_bench,
    e2e_bench,
    executorch_bench,
    pool_bench,
    portable_bench,
    report,
    router_bench,
    startup_bench,
    worker_bench,
)
from bench.lib import REPO
from bench.lib.machine import LLAMA_SERVER_BUILD, LLAMA_SERVER_ENV, machine

# One page per topic (docs/benchmarks.md is their index).
PAGES = REPO / "docs" / "benchmarks"


def markdown_section_tables(res: dict[str, Any]) -> list[str]:
    """The startup and portable-build tables as the markdown file shows them under the main
    table (each followed by a blank line), or nothing for a section that did not run."""
    lines: list[str] = []
    if "startup_ready_s_off" in res:
        lines += [*startup_bench.table(res), "",
                  f"Startup: extra buffer types offered {res.get('startup_extra_buffer_types')}, weights in "
                  f"{res.get('startup_weight_buffers')}; probe outcomes {res.get('startup_probe_outcomes')}.", ""]
    portable = portable_bench.table(res)
    if portable:
        lines += [*portable, ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="CI mode: fewer tokens, disconnects and kills (~1 minute)")
    ap.add_argument("--llama-server", default=os.environ.get(LLAMA_SERVER_ENV) or None,
                    help=f"llama-server binary for the peer row [env {LLAMA_SERVER_ENV}]; built with: "
                         f"{LLAMA_SERVER_BUILD}".replace("%", "%%"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--runs", type=int, default=5, help="runs per figure (default 5)")
    ap.add_argument("--out", default=None,
                    help="markdown file to write (default: docs/benchmarks/main.md in full mode, none with --quick)")
    ap.add_argument("--portable-worker-dir", default=None,
                    help="workers built against a portable llama-cpp-python (CPU kernels chosen at run time) for the "
                         "portable-vs-native decode row [env TRIOSERVE_BENCH_PORTABLE_WORKER_DIR]; without it the "
                         "section is skipped")
    ap.add_argument("--only", default=None,
                    help="comma-separated sections to run: control,keepup,e2e,e2e1,cancel,worker,concurrency,executorch,startup,"
                         "portable,contention,pool,router "
                         "(default: all; --quick skips e2e1)")
    args = ap.parse_args(argv)
    runs = args.runs
    only = set((args.only or ("control,keepup,e2e,cancel,worker,concurrency,executorch,startup,portable,contention,pool,router"
                              if args.quick else
                              "control,keepup,e2e,e2e1,cancel,worker,concurrency,executorch,startup,portable,contention,pool,router")).split(","))
    out_path = args.out if args.out is not None else (None if args.quick else str(PAGES / "main.md"))
    # The concurrency section has its own page (docs/benchmarks.md indexes them); an explicit
    # --out gets everything.
    concurrency_path = out_path if args.out is not None else str(PAGES / "concurrency.md")
    res: dict[str, Any] = {"machine": machine(), "date": datetime.date.today().isoformat(),
                           "mode": "quick" if args.quick else "full", "runs": runs, "threads": args.threads}
    notes: list[str] = []
    if args.llama_server and not (shutil.which(args.llama_server) or Path(args.llama_server).is_file()):
        notes.append(f"llama-server not found at {args.llama_server}: peer row skipped")
        args.llama_server = None
    elif not args.llama_server:
        notes.append(f"peer row skipped: no llama-server given (--llama-server PATH or {LLAMA_SERVER_ENV})")
    started = time.monotonic()
    res["loadavg_before"] = os.getloadavg()

    def section(name: str, fn: Any, *a: Any) -> None:
        t = time.monotonic()
        print(f"[bench] {name} ...", file=sys.stderr, flush=True)
        try:
            res.update(fn(*a))
        except Exception as exc:  # one broken section must not hide the others' figures
            notes.append(f"section {name} failed: {exc!r}")
            print(f"[bench] {name} FAILED: {exc!r}", file=sys.stderr, flush=True)
        print(f"[bench] {name} done in {time.monotonic() - t:.0f} s", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="trioserve-bench-") as tmpdir:
        tmp = Path(tmpdir)
        if "control" in only:
            section("control plane", trio.run, control_plane_bench.control_plane, tmp, runs, 20_000 if args.quick else 100_000, 8)
        if "keepup" in only:
            section("keep-up", trio.run, control_plane_bench.keep_up, tmp, runs)
        if "e2e" in only:
            section("end to end", trio.run, e2e_bench.end_to_end, tmp, runs, 64 if args.quick else 128, args.threads,
                    args.ctx, args.llama_server)
        if "e2e1" in only:
            # Diagnostic: the same comparison with one model thread, so a core is left for the
            # control plane and the client (on 2 cores, 2 model threads leave none).
            t1 = {}
            section("end to end, 1 thread", lambda: t1.update(trio.run(
                e2e_bench.end_to_end, tmp, runs, 64 if args.quick else 128, 1, args.ctx, args.llama_server)) or {})
            for key in ("e2e_decode_ratio", "ttft_overhead_ms", "vs_llama_server_decode_ratio",
                        "trioserve_decode_tok_s", "direct_decode_tok_s"):
                if key in t1:
                    res["t1_" + key] = t1[key]
        if "cancel" in only:
            section("cancellation", trio.run, cancel_bench.run_section, 6 if args.quick else 45, 2 if args.quick else runs,
                    args.threads, 2.0)
        if "worker" in only:
            w = {}
            section("worker protocol", lambda: w.update(worker_bench.run_section(
                runs, 64 if args.quick else 128, 6 if args.quick else 20, args.threads)) or {})
            if "decode_ratio" in w:
                res.update(worker_decode_ratio=w["decode_ratio_per_run"], fake_tokens_per_s=w["fake_tokens_per_s"],
                           worker_cancel_decode_ms_p99=w["cancel_decode_ms_p99"],
                           worker_cancel_prefill_ms_p99=w["cancel_prefill_ms_p99"])
            elif w:
                notes.append(f"worker bench failed: {w.get('worker_bench_error', '')[-300:]}")
        if "concurrency" in only:
            # bench/concurrency_bench.py: batched slots vs llama-server -np 4 (its own servers).
            section("concurrency", concurrency_bench.run_section, args.llama_server, args.threads, args.quick,
                    None if args.quick else runs)
        if "startup" in only:
            section("startup", startup_bench.run, 1 if args.quick else 3, args.threads)
        if "portable" in only:
            section("portable build", portable_bench.run_section, args.portable_worker_dir, args.threads,
                    2 if args.quick else runs, 64 if args.quick else 128)
            if "portable_skipped" in res:
                notes.append(f"portable-build section skipped: {res['portable_skipped']}")
        if "executorch" in only:
            section("executorch", executorch_bench.run_section, args.threads, 2 if args.quick else runs,
                    64 if args.quick else 128)
            if "et_skipped" in res:
                notes.append(f"ExecuTorch section skipped: {res['et_skipped']}")
        if "contention" in only:
            section("contention (quick)", contention_bench.run_quick)
        if "pool" in only:
            section("worker pool", pool_bench.run_section, runs, args.quick)
        if "router" in only:
            section("routers", router_bench.run_section, args.quick)
    checks = res.get("e2e_checks")
    if checks and not all(checks.values()):
        notes.append(f"e2e sanity checks failed: {checks}")
    elif checks:
        notes.append("e2e: trioserve, the direct loop" + (" and llama-server" if args.llama_server else "")
                     + " saw the same prompt token count and produced the same number of tokens in every run.")
    res["loadavg_after"] = os.getloadavg()
    if "worker_decode_ratio" in res and "e2e_decode_ratio" in res:
        notes.append(
            f"Same run, {args.threads} threads: worker protocol alone (a Python reader waking per token, no HTTP) "
            f"{res['worker_decode_ratio']['median']:.3f} of the direct loop; full HTTP path "
            f"{res['e2e_decode_ratio']['median']:.3f}; llama-server ÷ direct "
            f"{res.get('llama_server_vs_direct_ratio', {}).get('median', float('nan')):.3f}.")
    notes.append(f"load average before / after: {res['loadavg_before'][0]:.2f} / {res['loadavg_after'][0]:.2f} "
                 "(the machine is shared; other jobs may have run during the benchmark)")
    res["notes"] = notes
    elapsed = time.monotonic() - started
    res["elapsed_s"] = elapsed
    lines = report.table(res)
    if "agg_tok_s_1" in res:
        lines += ["", *concurrency_bench.table(res)]
    if "startup_ready_s_off" in res:
        lines += ["", *startup_bench.table(res)]
    if "portable_decode_ratio" in res:
        lines += ["", *portable_bench.table(res)]
    if "et_decode_tok_s" in res:
        lines += ["", *executorch_bench.table(res)]
    if "pool_bench" in res:
        lines += ["", *pool_bench.section_table(res)]
    if "router_bench" in res:
        lines += ["", *router_bench.table(res["router_bench"])]
    print("\n".join(lines))
    for n in notes:
        print(f"note: {n}")
    if out_path:
        if only - {"concurrency", "pool", "router"}:  # pool, router: printed only
            Path(out_path).write_text(report.markdown(res, args, elapsed, markdown_section_tables(res))
                                      + report.kept_contention_section(Path(out_path)))
        if "agg_tok_s_1" in res:  # the concurrency section is spliced in (alone: into the existing file)
            concurrency_bench.splice(Path(concurrency_path), concurrency_bench.markdown_section(
                res, f"python -m bench{' --quick' if args.quick else ''}{' --only ' + args.only if args.only else ''}"
                     f"{' --llama-server PATH' if args.llama_server else ''}"))
        print(f"wrote {out_path}" + (f" and {concurrency_path}" if "agg_tok_s_1" in res
                                         and concurrency_path != out_path else ""))
    print(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
