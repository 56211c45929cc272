"""Worker benchmark: decode overhead of the protocol and cancel latency.

Measures, on the real embedded model (SmolLM2-135M-Instruct Q4_1) through llama.cpp:

* decode_ratio: trioserve-llama-worker decode tokens/s, measured HERE from the first token
  record received to the done record received (protocol round trip included), divided by
  trioserve-llama-direct (a plain llama.h greedy loop: same library, model, context
  parameters, threads, prompt and token count) measured over the same span (first sampled
  token to the last). Target >= 0.98.
* cancel_decode_ms: cancel frame written -> done record received, mid-decode. Target <= one
  decode step + 20 ms (p99).
* cancel_prefill_ms: the same while a ~2,000-token prompt is being prefilled.
* fake_tokens_per_s: protocol throughput of the fake worker with no delays (control-plane
  ceiling, no model).

Prints a table; the last line is one JSON object. Never asserts on timings.

    python -m bench.worker_bench [--runs 5] [--tokens 128] [--threads 2] [--cancels 20]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.lib import REPO
from bench.lib.prompts import PROMPT
from bench.lib.stats import summary
from bench.lib.workers import Worker, engine_env, find_bin_dir, find_model

LONG_PROMPT = ("<|im_start|>user\nSummarize: " + "the quick brown fox jumps over the lazy dog. " * 200
               + "<|im_end|>\n<|im_start|>assistant\n")


def pct(xs: list[float], p: float) -> float:
    """The nearest-rank percentile (a value that was measured, never an interpolation)."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(p / 100.0 * (len(xs) - 1) + 0.4999))))
    return xs[k]


def worker_decode(w: Worker, n: int) -> tuple[float, int, list[int]]:
    """Greedy generation of up to n tokens; returns (tok/s first-record->done, tokens, ids)."""
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "prompt": PROMPT, "max_new_tokens": n, "temperature": 0})
    t_first = None
    while True:
        rec = w.record()
        if rec["type"] == "token":
            if t_first is None:
                t_first = time.perf_counter()
            continue
        t_done = time.perf_counter()
        assert rec["type"] == "done", rec
        k = rec["completion_tokens"]
        return (k - 1) / (t_done - t_first), k, rec.get("generated_token_ids", [])


def direct_decode(bin_dir: Path, model: Path, args, n: int) -> dict:
    out = subprocess.run([str(bin_dir / "trioserve-llama-direct"), "--model", str(model), "--threads", str(args.threads),
                          "--ctx", str(args.ctx), "--capacity", str(args.capacity), "--n", str(n), "--prompt", PROMPT,
                          "--prefill-chunk", str(args.prefill_chunk), "--gpu-layers", str(args.gpu_layers)],
                         capture_output=True, text=True, check=True, timeout=600, env=engine_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


def cancel_and_time(w: Worker, rid: int) -> tuple[dict, float]:
    """Write the cancel frame for ``rid``; return its terminal record and ms until it came."""
    t0 = time.perf_counter()
    w.cancel(rid)
    while (rec := w.record())["type"] == "token":
        pass
    return rec, (time.perf_counter() - t0) * 1000.0


def cancel_decode(w: Worker, rng: random.Random) -> float:
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "prompt": PROMPT, "max_new_tokens": 1000, "session_id": "bench"})
    for _ in range(rng.randint(2, 12)):
        rec = w.record()
        assert rec["type"] == "token", rec
    rec, ms = cancel_and_time(w, rid)
    assert rec["type"] == "done" and rec["cancelled"], rec
    return ms


def cancel_prefill(w: Worker, rng: random.Random) -> tuple[float, bool]:
    rid = next(w.ids)
    w.send({"op": "generate", "id": rid, "prompt": LONG_PROMPT, "max_new_tokens": 8, "session_id": "bench"})
    time.sleep(rng.uniform(0.02, 0.3))
    rec, ms = cancel_and_time(w, rid)
    assert rec["type"] == "done", rec
    mid_prefill = rec["cancelled"] and rec["completion_tokens"] == 0
    return ms, mid_prefill


def fake_throughput(bin_dir: Path, tokens: int = 50_000) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(["x" * tokens], f)
    try:
        w = Worker([str(bin_dir / "trioserve-fake-worker"), "--script", f.name, "--ctx", str(tokens + 16)])
        rid = next(w.ids)
        t0 = time.perf_counter()
        w.send({"op": "generate", "id": rid, "prompt": "go"})
        n = 0
        while (rec := w.record())["type"] == "token":
            n += 1
        t1 = time.perf_counter()
        w.close()
        return rec["completion_tokens"] / (t1 - t0)
    finally:
        os.unlink(f.name)


def run_section(runs: int, tokens: int, cancels: int, threads: int) -> dict[str, Any]:
    """The ``worker`` section of ``python -m bench``: this benchmark in a process of its own;
    its JSON line, or ``worker_bench_error`` with the end of its stderr."""
    out = subprocess.run([sys.executable, "-m", "bench.worker_bench", "--runs", str(runs), "--tokens", str(tokens),
                          "--cancels", str(cancels), "--threads", str(threads)],
                         capture_output=True, text=True, timeout=900, cwd=REPO)
    if out.returncode != 0:
        return {"worker_bench_error": out.stderr[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--capacity", type=int, default=4)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--cancels", type=int, default=20)
    ap.add_argument("--gpu-layers", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    bin_dir, model = find_bin_dir(), find_model()

    w = Worker([str(bin_dir / "trioserve-llama-worker"), "--model", str(model), "--threads", str(args.threads),
                "--ctx", str(args.ctx), "--capacity", str(args.capacity), "--prefill-chunk", str(args.prefill_chunk),
                "--gpu-layers", str(args.gpu_layers)])
    # Warm-up, and the token count both sides will generate (the worker stops at EOS).
    _, n, ids_w = worker_decode(w, args.tokens)
    worker_rates, direct_rates, ratios = [], [], []
    same_tokens = True
    for _ in range(args.runs):  # interleaved so drift hits both sides alike
        d = direct_decode(bin_dir, model, args, n)
        rw, k, ids = worker_decode(w, n)
        same_tokens &= ids == d["token_ids"][:k] and k == n
        worker_rates.append(rw)
        direct_rates.append(d["decode_tok_s_after_first"])
        ratios.append(rw / d["decode_tok_s_after_first"])

    step_ms = 1000.0 / statistics.median(worker_rates)
    dec = [cancel_decode(w, rng) for _ in range(args.cancels)]
    pre, mid = [], 0
    for _ in range(max(5, args.cancels // 2)):
        ms, was_mid = cancel_prefill(w, rng)
        if was_mid:
            pre.append(ms)
            mid += 1
    rid = next(w.ids)
    w.send({"op": "tokenize", "id": rid, "text": LONG_PROMPT})
    n_long = len(w.record()["ids"])
    w.close()
    fake_tps = fake_throughput(bin_dir)

    s_w, s_d, s_r = summary(worker_rates), summary(direct_rates), summary(ratios)
    rows = [
        ("worker decode tok/s (first token rec -> done)", s_w),
        ("direct loop decode tok/s (same span)", s_d),
        ("decode_ratio (per run)", s_r),
    ]
    print(f"model={model.name} threads={args.threads} tokens={n} runs={args.runs} ctx={args.ctx} "
          f"capacity={args.capacity} prefill_chunk={args.prefill_chunk}")
    print(f"{'metric':<48} {'median':>10} {'min':>10} {'max':>10} {'n':>4}")
    for name, s in rows:
        print(f"{name:<48} {s['median']:>10.3f} {s['min']:>10.3f} {s['max']:>10.3f} {s['n']:>4}")
    for name, xs in (("cancel mid-decode ms (write -> done)", dec), (f"cancel mid-prefill ms ({n_long}-tok prompt)", pre)):
        if xs:
            print(f"{name:<48} {statistics.median(xs):>10.2f} {min(xs):>10.2f} {max(xs):>10.2f} {len(xs):>4}"
                  f"   p99={pct(xs, 99):.2f}")
    print(f"{'decode step ms (1000 / median worker tok/s)':<48} {step_ms:>10.2f}")
    print(f"{'fake worker protocol tokens/s':<48} {fake_tps:>10.0f}")
    print(f"greedy tokens identical worker vs direct: {same_tokens}")
    result = {
        # Median of paired (interleaved) per-run ratios: robust to machine drift between runs.
        "decode_ratio": s_r["median"],
        "decode_ratio_of_medians": statistics.median(worker_rates) / statistics.median(direct_rates),
        "decode_ratio_per_run": s_r,
        "worker_decode_tok_s": s_w,
        "direct_decode_tok_s": s_d,
        "decode_step_ms": step_ms,
        "cancel_decode_ms_p50": statistics.median(dec),
        "cancel_decode_ms_p99": pct(dec, 99),
        "cancel_decode_target_ms": step_ms + 20.0,
        "cancel_prefill_ms_p50": statistics.median(pre) if pre else None,
        "cancel_prefill_ms_p99": pct(pre, 99) if pre else None,
        "cancel_prefill_mid_prefill_samples": mid,
        "long_prompt_tokens": n_long,
        "fake_tokens_per_s": fake_tps,
        "greedy_identical": same_tokens,
        "tokens": n,
        "threads": args.threads,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
