"""ExecuTorch engine benchmark: decode tokens/s of trioserve-executorch-worker on a SmolLM2
`.pte` against trioserve-llama-worker on the embedded SmolLM2 GGUF, same threads, same prompt,
greedy, run in alternating pairs (so load on the shared machine hits both alike).

Decode tok/s is the worker's own figure from its done record (``decode_tok_s``: the shared
worker loop times both engines the same way). The ratio is per pair, ExecuTorch ÷ llama.cpp;
the issue's target is ≥ 0.8.

The `.pte` is not committed (~94 MB): make it with scripts/executorch/export_smollm2_pte.py
(14-32 min) and point ``TRIOSERVE_BENCH_PTE`` (or ``--pte``) at it; the default location is
build/executorch-smollm2/smollm2.pte, with its tokenizer.json beside it. Without it the
section is skipped with a note. Never asserts on time.

    python -m bench.executorch_bench [--pte PATH] [--runs 5] [--tokens 128] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.lib.workers import DEFAULT_PTE, PTE_ENV, find_pte, worker_binary
from trioserve.worker.launch import env_for
PROMPT = ("<|im_start|>user\nTell me a very long and detailed story about a robot who learns to paint."
          "<|im_end|>\n<|im_start|>assistant\n")


def _run_worker(argv: list[str], requests: list[dict[str, Any]], env: dict[str, str]) -> list[dict[str, Any]]:
    """Starts a worker, sends the generates one after another, returns their done records."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env, text=True)
        try:
            ready = json.loads(proc.stdout.readline() or "{}")
            if ready.get("type") != "ready":
                err.seek(0)
                raise RuntimeError(f"{argv[0]} did not start: {err.read().decode(errors='replace')[-500:]}")
            dones = []
            for req in requests:
                proc.stdin.write(json.dumps(req) + "\n")
                proc.stdin.flush()
                while True:
                    rec = json.loads(proc.stdout.readline())
                    if rec.get("type") in ("done", "error"):
                        if rec["type"] == "error":
                            raise RuntimeError(f"{argv[0]}: {rec}")
                        dones.append(rec)
                        break
            return dones
        finally:
            proc.stdin.close()
            proc.wait(30)


def run_section(threads: int = 2, runs: int = 5, tokens: int = 128, pte: str | None = None) -> dict[str, Any]:
    """The figures as a dict (``et_*`` keys), or ``{"et_skipped": reason}``."""
    path = find_pte(pte)
    if path is None:
        return {"et_skipped": f"no SmolLM2 .pte ({PTE_ENV} or {DEFAULT_PTE}); make one with "
                              "scripts/executorch/export_smollm2_pte.py"}
    tokenizer = path.parent / "tokenizer.json"
    from tokenizers import Tokenizer

    from trioserve.config import Settings
    from trioserve.machine import embedded_model_path
    ids = Tokenizer.from_file(str(tokenizer)).encode(PROMPT, add_special_tokens=False).ids
    env = {**os.environ, **env_for(Settings())}
    et_argv = [str(worker_binary("trioserve-executorch-worker")), "--model", str(path), "--tokenizer", str(tokenizer),
               "--threads", str(threads)]
    ll_argv = [str(worker_binary("trioserve-llama-worker")), "--model", str(embedded_model_path()), "--threads", str(threads),
               "--ctx", "2048", "--capacity", "1"]
    et_rates, ll_rates, ratios, et_tokens, ll_tokens = [], [], [], [], []
    for run in range(runs):
        # Each request on a fresh slot state: the first generate of a fresh worker (no reuse).
        et = _run_worker(et_argv, [{"op": "generate", "id": 1, "prompt_segments": [{"ids": ids}],
                                    "max_new_tokens": tokens}], env)[0]
        ll = _run_worker(ll_argv, [{"op": "generate", "id": 1, "prompt": PROMPT, "max_new_tokens": tokens}], env)[0]
        et_rates.append(et["decode_tok_s"])
        ll_rates.append(ll["decode_tok_s"])
        et_tokens.append(et["completion_tokens"])
        ll_tokens.append(ll["completion_tokens"])
        if ll["decode_tok_s"] > 0:
            ratios.append(et["decode_tok_s"] / ll["decode_tok_s"])
        print(f"[executorch bench] run {run + 1}/{runs}: executorch {et['decode_tok_s']:.1f} tok/s "
              f"({et['completion_tokens']} tokens), llama.cpp {ll['decode_tok_s']:.1f} tok/s "
              f"({ll['completion_tokens']} tokens)", file=sys.stderr, flush=True)

    def st(v: list[float]) -> dict[str, float]:
        return {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}

    return {"et_pte": str(path), "et_pte_mb": path.stat().st_size / 1e6, "et_threads": threads,
            "et_decode_tok_s": st(et_rates), "et_llama_decode_tok_s": st(ll_rates),
            "et_decode_ratio": st(ratios), "et_tokens": et_tokens, "et_llama_tokens": ll_tokens}


def table(res: dict[str, Any]) -> list[str]:
    if "et_skipped" in res:
        return [f"ExecuTorch engine: skipped ({res['et_skipped']})"]

    def fmt(s: dict[str, float], p: str = ".1f") -> str:
        return f"{s['median']:{p}} ({s['min']:{p}}–{s['max']:{p}}, n={s['n']})"

    return [f"ExecuTorch engine ({Path(res['et_pte']).name}, {res['et_pte_mb']:.1f} MB) vs llama.cpp (embedded "
            f"SmolLM2-135M GGUF), {res['et_threads']} threads, greedy, median (min–max)",
            "",
            "| engine | decode tok/s |",
            "|---|---|",
            f"| ExecuTorch (.pte, trioserve-executorch-worker) | {fmt(res['et_decode_tok_s'])} |",
            f"| llama.cpp (Q4_1 GGUF, trioserve-llama-worker) | {fmt(res['et_llama_decode_tok_s'])} |",
            f"| ratio ExecuTorch ÷ llama.cpp (per pair; target ≥ 0.8) | {fmt(res['et_decode_ratio'], '.2f')} |"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pte", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    res = run_section(args.threads, args.runs, args.tokens, args.pte)
    print("\n".join(table(res)))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
