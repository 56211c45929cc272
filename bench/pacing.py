"""A decoding stream beside one long prompt, at the worker (issue #51): how fast the prompt
prefills while the stream decodes, and how long the stream waits for each token.

    python -m bench.pacing [--models qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M] [--words 2600]
                           [--threads N] [--step-target-ms MS] [--flash-attn auto|on|off]

Each model (bench.sizes' synthetic ladder, made and cached outside the repository) runs in
``trioserve-llama-worker`` with 2 slots of 20,480 tokens. A stream decodes (its end-of-turn
tokens banned, so it runs on), then a prompt of about ``--words`` words arrives (2,600 words
are ~4.2k tokens, 10,600 ~17.7k). Printed per model: the prompt's tokens, its rate beside the
stream, and the stream's longest wait in each quarter of the prompt's prefill (a prompt token
costs more the deeper it goes, so the quarters show the waits by depth). Step pacing is
cpp/scheduler.h StepPacer. No llama-server here: bench.sizes' prefill section runs both
servers. Never asserts on time; the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from bench.lib.machine import machine
from bench.lib.workers import Worker, worker_bin
from bench.peers_bench import long_text
from bench.sizes import end_of_turn_bias, parse_models
from testkit.quantize import DEFAULT_CACHE, quantized

STREAM_PROMPT = "<|im_start|>user\nTell a story.<|im_end|>\n<|im_start|>assistant\n"


def run(model: Path, words: int, threads: int, extra: list[str]) -> dict[str, Any]:
    """One stream decoding beside one prompt of ``words`` words in a fresh worker."""
    w = Worker([str(worker_bin()), "--model", str(model), "--threads", str(threads), "--ctx", "20480",
                "--capacity", "2", *extra])
    try:
        ban = [[int(k), v] for k, v in end_of_turn_bias(model).items()]
        w.send({"op": "generate", "id": 1, "prompt": STREAM_PROMPT, "max_new_tokens": 1 << 20,
                "temperature": 0, "logit_bias": ban})
        for _ in range(5):  # the stream is decoding
            while w.record()["type"] != "token":
                pass
        prompt = "<|im_start|>user\n" + long_text(91, words) + "<|im_end|>\n<|im_start|>assistant\n"
        t0 = last = time.perf_counter()
        w.send({"op": "generate", "id": 2, "prompt": prompt, "max_new_tokens": 1, "temperature": 0})
        waits: list[tuple[float, float]] = []  # (wait, when since the prompt was sent)
        while True:
            rec = w.record(timeout=3600)
            now = time.perf_counter()
            if rec.get("id") == 1 and rec["type"] == "token":
                waits.append((now - last, now - t0))
                last = now
            elif rec.get("id") == 2 and rec["type"] in ("done", "error"):
                break
        if rec["type"] == "error":
            raise RuntimeError(f"the prompt failed: {rec}")
        secs = now - t0
        quarters = [max((wt for wt, at in waits if q * secs / 4 <= at < (q + 1) * secs / 4), default=0.0)
                    for q in range(4)]
        return {"prompt_tokens": rec["prompt_tokens"], "seconds": round(secs, 1),
                "prompt_tok_s": round(rec["prompt_tokens"] / secs, 1), "stream_tokens": len(waits),
                "longest_wait_s": round(max((wt for wt, _ in waits), default=0.0), 2),
                "longest_wait_by_quarter_s": [round(q, 2) for q in quarters]}
    finally:
        w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3:1.5b:Q4_K_M,qwen35moe:3b:Q4_K_M")
    ap.add_argument("--words", type=int, default=2600)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--step-target-ms", type=float, default=None, help="the worker's (default: its own)")
    ap.add_argument("--flash-attn", choices=("auto", "on", "off"), default=None,
                    help="the worker's (default: its own)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE))
    args = ap.parse_args()
    extra = [] if args.step_target_ms is None else ["--step-target-ms", str(args.step_target_ms)]
    extra += [] if args.flash_attn is None else ["--flash-attn", args.flash_attn]
    result: dict[str, Any] = {"bench": "pacing", "machine": machine(), "words": args.words}
    print("| model | prompt tokens | prompt tok/s beside the stream | longest wait | by quarter of the prefill |")
    print("|---|---:|---:|---:|---|")
    for arch, params, qtype in parse_models(args.models):
        model = quantized(arch, params, qtype, Path(args.cache))
        r = run(model, args.words, args.threads, extra)
        result[model.name] = r
        quarters = " / ".join(f"{q:.2f}" for q in r["longest_wait_by_quarter_s"])
        print(f"| {model.name} | {r['prompt_tokens']} | {r['prompt_tok_s']} | {r['longest_wait_s']} s | {quarters} s |",
              flush=True)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
